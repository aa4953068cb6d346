"""Packed rows compute what unpacked rows compute (issue #33): for the same conversations, one row
holding several documents with ``actual_seq_len`` versus one padded row per document.

* SmolLM2-135M-Instruct (the real model, ``smollm2_dir``; real Alpaca conversations rendered with
  its chat template): every document's loss from the packed row's logits equals its loss from its
  own unpacked row within 1e-5, and the packed batch's mean loss equals the unpacked batch's, on
  msllm's CPU flash kernel and on the composed operators (the mask path).
* A small random model (every parameter's gradient within 1e-4 in fp32 is a backward pass over all
  parameters; on SmolLM2 that takes 25-40 s per side here in PYNATIVE): mean loss within 1e-5 and
  every parameter's gradient within 1e-4, on the kernel path, the composed fast path and the layout
  path (Ascend's shapes), with a sliding window too.

The packed rows of the small-model test are built here by plain concatenation, with each
document's first label left as it is (not ignored, as ``pack_samples`` writes it): the model's own
rule must keep the last token of a document from predicting the next document's first token.
References are the unpacked rows through the same model (causal attention of a row alone), which
tests/models/test_llama_model.py checks against transformers and numpy.
"""

import os

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from modeltest_helpers import smollm2_samples

from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import LlamaForCausalLM

# PyNative for every test (tests/conftest.py's fixture; a module-level set_context happens at collection and
# is undone by the modules that run before this one)
pytestmark = pytest.mark.usefixtures("pynative")

SEED = 20261127
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IGNORE = -100


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    from msllm.kernels import build

    build.build(verbose=False)


def doc_losses(logits, ids, labels):
    """Per-document mean NLL in float64 from logits (T, V) of tokens ids[:-1] and targets labels[1:]."""
    z = np.asarray(logits, np.float64)
    tgt = labels[1:]
    keep = tgt != IGNORE
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse[keep] - z[keep][np.arange(keep.sum()), tgt[keep]]
    return nll.sum(), int(keep.sum())


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_flash_kernel", "composed_mask"])
def test_smollm2_packed_documents_lose_what_unpacked_ones_do(smollm2_dir, kernels):
    from msllm.config import load_config
    from msllm.data.packing import pack_samples
    from msllm.data.samples import pad_sample
    from msllm.generation.loading import load_for_inference

    samples = smollm2_samples(smollm2_dir)
    t = 255
    cfg = load_config(os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml"),
                      [f"--load_checkpoint={smollm2_dir}", f"--model.model_config.seq_length={t}",
                       f"--model.model_config.cpu_kernels={kernels}"])
    net, mc, _ = load_for_inference(cfg, fast_paths=True)
    assert (net.kernels.cpu is not None) == kernels
    rows = pack_samples(samples, t, 0)
    assert len(rows) < len(samples) and sum(len(r[2]) for r in rows) == len(samples)
    ids = np.stack([r[0] for r in rows])
    labels = np.stack([r[1] for r in rows])
    width = max(len(r[2]) for r in rows) + 1
    ends = np.stack([np.concatenate([r[2], np.full(width - len(r[2]), t)]) for r in rows]).astype(np.int32)
    logits = net(Tensor(ids[:, :-1]), None, Tensor(ends)).asnumpy()             # (R, T, V)
    long = max(len(s[0]) for s in samples) - 1
    unpacked = [pad_sample(d_ids, d_lab, long, 0) for d_ids, d_lab in samples]
    u_logits = net(Tensor(np.stack([u[0][:-1] for u in unpacked]))).asnumpy()   # (N, long, V)
    total = [0.0, 0]
    for k, (d_ids, d_lab) in enumerate(samples):
        u_nll, u_n = doc_losses(u_logits[k], *unpacked[k])
        # document k in the packed rows: row r, slots s .. s + n - 1
        r = next(i for i, row in enumerate(rows) if sum(len(x[2]) for x in rows[:i + 1]) > k)
        j = k - sum(len(x[2]) for x in rows[:r])
        s = 0 if j == 0 else int(rows[r][2][j - 1])
        n = len(d_ids)
        p_lab = np.full(n + 1, IGNORE, np.int32)
        p_lab[1:n] = labels[r, s + 1:s + n]
        p_nll, p_n = doc_losses(logits[r, s:s + n], np.zeros(n + 1, np.int32), p_lab)
        assert p_n == u_n > 0
        print(f"document {k}: {n} tokens, {u_n} targets, loss unpacked {u_nll / u_n:.7f} packed {p_nll / p_n:.7f}")
        assert abs(p_nll / p_n - u_nll / u_n) <= 1e-5
        total[0] += u_nll
        total[1] += u_n
    packed_loss = float(net(Tensor(ids), Tensor(labels), Tensor(ends)).asnumpy())
    assert abs(packed_loss - total[0] / total[1]) <= 1e-5


def tiny(fast_paths, cpu_kernels, window=None):
    cfg = LlamaConfig(vocab_size=113, hidden_size=48, num_layers=2, num_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=64, seq_length=96, rope_theta=10000.0, cpu_kernels=cpu_kernels,
                      sliding_window=window)
    return LlamaForCausalLM(cfg, fast_paths=fast_paths)


PATHS = {"cpu_flash_kernel": (True, True), "cpu_composed": (True, False), "layout_path": (False, None)}


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
@pytest.mark.parametrize("path", list(PATHS))
def test_packed_gradients_equal_unpacked(path, window):
    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    lengths = [17, 40, 3, 29]                       # 89 tokens in a row of 96 + 1: a padding tail
    docs = []
    for n in lengths:
        ids = rng.integers(3, 113, n).astype(np.int32)
        lab = ids.copy()
        lab[: n // 3] = IGNORE                       # a prompt part, as SFT rows have
        lab[0] = ids[0]                              # left as it is: the model must not use it
        docs.append((ids, lab))
    t = 96
    ids = np.zeros(t + 1, np.int32)
    lab = np.full(t + 1, IGNORE, np.int32)
    ends, s = [], 0
    for d_ids, d_lab in docs:
        ids[s:s + len(d_ids)], lab[s:s + len(d_lab)] = d_ids, d_lab
        s += len(d_ids)
        ends.append(s)
    ends = np.array([ends + [t, t]], np.int32)      # padded with T, as MindFormers pads it
    long = max(lengths)
    u_ids = np.zeros((len(docs), long + 1), np.int32)
    u_lab = np.full((len(docs), long + 1), IGNORE, np.int32)
    for k, (d_ids, d_lab) in enumerate(docs):
        u_ids[k, :len(d_ids)], u_lab[k, :len(d_lab)] = d_ids, d_lab
    ms.set_seed(SEED)
    net = tiny(*PATHS[path], window=window)
    weights = net.trainable_params()
    lp, gp = ms.value_and_grad(lambda a, b, c: net(a, b, c), None, weights)(
        Tensor(ids[None]), Tensor(lab[None]), Tensor(ends))
    lu, gu = ms.value_and_grad(lambda a, b: net(a, b), None, weights)(Tensor(u_ids), Tensor(u_lab))
    print(f"loss packed {float(lp):.8f} unpacked {float(lu):.8f}")
    assert abs(float(lp) - float(lu)) <= 1e-5
    for w, a, b in zip(weights, gp, gu):
        err = float(np.abs(a.asnumpy() - b.asnumpy()).max())
        assert err <= 1e-4, f"{w.name}: max |grad packed - grad unpacked| = {err:.2e}"
    assert max(float(np.abs(g.asnumpy()).max()) for g in gu) > 1e-3     # the gradients are not all ~0


def test_packed_rows_need_the_document_rule():
    """Without ``actual_seq_len`` the same packed row gives another loss (the check above can fail)."""
    rng = np.random.default_rng(SEED)
    ids = rng.integers(3, 113, (1, 41)).astype(np.int32)
    ms.set_seed(SEED)
    net = tiny(True, True)
    ends = np.array([[12, 30, 40]], np.int32)
    a = float(net(Tensor(ids), Tensor(ids), Tensor(ends)).asnumpy())
    b = float(net(Tensor(ids), Tensor(ids)).asnumpy())
    assert abs(a - b) > 1e-3


def test_train_step_on_packed_rows_equals_unpacked_step():
    """One TrainStep (SGD, the trainer's step cell) on the packed row and on the unpacked batch of the
    same documents leaves every parameter the same (within 1e-6): the third input reaches the network
    and its gradient through the step."""
    from mindspore import nn

    from msllm.training.step import TrainStep

    print("seed", SEED)
    rng = np.random.default_rng(SEED)
    lengths, t = [20, 31, 9], 64
    ids = np.zeros((1, t + 1), np.int32)
    lab = np.full((1, t + 1), IGNORE, np.int32)
    u_ids = np.zeros((3, 32), np.int32)
    u_lab = np.full((3, 32), IGNORE, np.int32)
    s = 0
    for k, n in enumerate(lengths):
        d = rng.integers(3, 113, n).astype(np.int32)
        ids[0, s:s + n], lab[0, s + 1:s + n] = d, d[1:]
        u_ids[k, :n], u_lab[k, 1:n] = d, d[1:]
        s += n
    ends = np.array([[20, 51, 60, t]], np.int32)
    after = []
    for packed in (True, False):
        ms.set_seed(SEED)
        net = tiny(True, True)
        step = TrainStep(net, nn.SGD(net.trainable_params(), learning_rate=0.5), loss_scale="none", max_grad_norm=None)
        args = (Tensor(ids), Tensor(lab), Tensor(ends)) if packed else (Tensor(u_ids), Tensor(u_lab))
        loss = float(step(*args)[0].asnumpy())
        after.append((loss, {p.name: p.asnumpy().copy() for p in net.trainable_params()}))
    assert abs(after[0][0] - after[1][0]) <= 1e-5
    moved = 0.0
    ms.set_seed(SEED)
    start = {p.name: p.asnumpy() for p in tiny(True, True).trainable_params()}
    for name, value in after[0][1].items():
        assert np.abs(value - after[1][1][name]).max() <= 1e-6, name
        moved = max(moved, float(np.abs(value - start[name]).max()))
    assert moved > 1e-4      # the step did change the parameters
