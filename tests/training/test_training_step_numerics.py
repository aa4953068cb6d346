"""The compiled train step (msllm/training/step.py) against independent references:
gradient accumulation equals one step on the whole batch; an overflowing step changes no
parameter or AdamW moment and halves the dynamic loss scale, which grows again after
``scale_window`` clean steps (MindSpore's ``DynamicLossScaleUpdateCell`` rule); clipping equals
``torch.nn.utils.clip_grad_norm_`` on the same gradients, with and without loss scaling.

Gradients are read through plain SGD with learning rate 1 (``p_after = p_before - g``). Tiny
model (hidden 32, 1 layer, vocab 64, seq 8), GRAPH_MODE as in training."""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from msllm.config import RunConfig
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import LlamaForCausalLM
from msllm.training.step import TrainStep
from msllm.training.setup import build_optimizer

SEED = 20240613
CFG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, n_kv_heads=2, intermediate_size=48,
                  seq_length=8)
pytestmark = pytest.mark.usefixtures("graph_mode")  # tests/conftest.py


@pytest.fixture(scope="module")
def init():
    """Initial weights and a batch (B=4, T+1=9), all targets valid, from a fixed, printed seed."""
    print(f"seed {SEED}")
    ms.set_seed(SEED)
    net = LlamaForCausalLM(CFG)
    rng = np.random.default_rng(SEED)
    weights = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    batches = [rng.integers(0, CFG.vocab_size, (4, CFG.seq_length + 1)).astype(np.int32) for _ in range(8)]
    return weights, batches


class Poisoned(nn.Cell):
    """``loss * poison``: poison = inf makes every gradient inf/NaN (an overflowing step)."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net
        self.poison = Parameter(Tensor(1.0, ms.float32), name="poison", requires_grad=False)

    def construct(self, input_ids, labels):
        return self.net(input_ids, labels) * self.poison


def network(weights, fast_paths=False):
    net = LlamaForCausalLM(CFG, fast_paths=fast_paths)
    for p in net.trainable_params():
        p.set_data(Tensor(weights[p.name]))
    return net


def sgd_step(weights, **step_kwargs):
    """A TrainStep over a fresh network with ``weights`` and SGD (lr 1, no momentum/decay)."""
    net = network(weights)
    opt = nn.SGD(net.trainable_params(), learning_rate=1.0)
    step = TrainStep(net, opt, **step_kwargs)
    step.set_train()
    return net, step


def gradients(weights, net, batch, step):
    """Run one step on ``batch``; return ({name: g}, outputs) read through the SGD update."""
    t = Tensor(batch)
    out = step(t, t)
    return {p.name: weights[p.name] - p.asnumpy() for p in net.trainable_params()}, out


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_over_k_micro_batches_equals_one_step_on_the_batch(init, k):
    weights, batches = init
    net1, whole = sgd_step(weights, loss_scale="none", max_grad_norm=None, accum_steps=1)
    netk, accum = sgd_step(weights, loss_scale="none", max_grad_norm=None, accum_steps=k)
    g1, (loss1, *_) = gradients(weights, net1, batches[0], whole)
    gk, (lossk, *_) = gradients(weights, netk, batches[0], accum)
    assert abs(float(loss1.asnumpy()) - float(lossk.asnumpy())) < 1e-6
    assert max(np.abs(g).max() for g in g1.values()) > 1e-3       # the step did something
    for name in g1:
        np.testing.assert_allclose(gk[name], g1[name], atol=1e-6, rtol=0, err_msg=name)


PLAN = [1.0, float("inf"), 1.0, 1.0, 1.0, 1.0, 1.0, float("inf")]  # poison per step: inf = overflow


def poisoned_step(weights, branch_free_skip, fast_paths=False):
    """(poisoned network, TrainStep with the trainer's AdamW and a dynamic scale 1024 / 2 / 3);
    ``fast_paths``: the CPU model on msllm's kernels, whose AdamW then runs the one-pass CPU update."""
    poisoned = Poisoned(network(weights, fast_paths))
    opt = build_optimizer(poisoned.net, RunConfig(), np.full(16, 1e-3, np.float32))  # the trainer's AdamW
    assert (opt.cpu_kernels is not None) == (fast_paths and kernels_built())
    step = TrainStep(poisoned, opt, loss_scale="dynamic", scale_sense=1024.0, scale_factor=2.0, scale_window=3,
                     max_grad_norm=1.0, branch_free_skip=branch_free_skip)
    step.set_train()
    return poisoned, step


@pytest.mark.parametrize("branch_free_skip,fast_paths", [(False, False), (True, False), (False, True)])
def test_overflow_skips_the_update_and_halves_the_scale_then_it_grows_after_the_window(init, branch_free_skip,
                                                                                       fast_paths):
    weights, batches = init
    poisoned, step = poisoned_step(weights, branch_free_skip, fast_paths)

    scale_state = ("loss_scale", "current_iterator_step", "last_overflow_iterator_step", "poison")

    def state():  # everything but the loss-scale bookkeeping
        return {p.name: p.asnumpy().copy() for p in step.get_parameters() if p.name not in scale_state}

    def run_step(i, poison=1.0):
        poisoned.poison.set_data(Tensor(poison, ms.float32))
        t = Tensor(batches[i])
        _, overflow, used, _ = step(t, t)
        return bool(overflow.asnumpy()), float(used.asnumpy())

    # Reference: MindSpore DynamicLossScaleUpdateCell's documented rule: on overflow scale /=
    # factor (not below 1) and the clean-step counter restarts; after `window` clean steps in a
    # row scale *= factor.
    expected, scale, clean, observed = [], 1024.0, 0, []
    for i, poison in enumerate(PLAN):
        before = state()
        overflow, used = run_step(i, poison)
        observed.append((overflow, used))
        is_overflow = not np.isfinite(poison)
        expected.append((is_overflow, scale))
        if is_overflow:
            scale, clean = max(scale / 2.0, 1.0), 0
            after = state()
            assert after.keys() == before.keys() and any(n.startswith("adam_m.") for n in after)
            for name in before:  # weights, AdamW moments, the optimizer's step: bit-identical
                np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        else:
            clean += 1
            if clean == 3:
                scale, clean = scale * 2.0, 0
    print("observed (overflow, scale used):", observed)
    assert observed == expected
    assert [u for _, u in observed] == [1024, 1024, 512, 512, 512, 1024, 1024, 1024]
    assert float(step.loss_scale.asnumpy()) == 512.0                # halved by the last overflow


def test_branch_free_skip_takes_the_same_steps_bit_for_bit(init):
    """The branch-free form (Ascend) against the branch (CPU, the reference): after every step of
    a plan with clean and overflowed steps, every parameter, AdamW moment, the optimizer's step
    count and the loss-scale state are bit-identical."""
    weights, batches = init
    runs = [poisoned_step(weights, flag) for flag in (False, True)]
    for i, poison in enumerate(PLAN):
        states = []
        for poisoned, step in runs:
            poisoned.poison.set_data(Tensor(poison, ms.float32))
            t = Tensor(batches[i])
            loss, overflow, used, norm = step(t, t)
            states.append(({p.name: p.asnumpy().copy() for p in step.get_parameters()},
                           [x.asnumpy() for x in (loss, overflow, used, norm)]))
        (ref, ref_out), (got, got_out) = states
        assert ref.keys() == got.keys() and "global_step" in ref
        for name in ref:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=f"step {i}: {name}")
        for a, b in zip(got_out, ref_out):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i} outputs")
    assert int(ref["global_step"][0]) == PLAN.count(1.0)  # skipped steps did not count


@pytest.mark.parametrize("loss_scale", ["none", "dynamic"])
def test_clipping_equals_torch_clip_grad_norm(init, loss_scale):
    torch = pytest.importorskip("torch")
    weights, batches = init
    net0, plain = sgd_step(weights, loss_scale="none", max_grad_norm=None)
    raw, (_, _, _, norm0) = gradients(weights, net0, batches[1], plain)
    total = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in raw.values())))
    assert abs(float(norm0.asnumpy()) - total) < 1e-5 * total
    for max_norm in (total / 4, total * 2):  # clipping active, and inactive
        net, clipped = sgd_step(weights, loss_scale=loss_scale, scale_sense=1024.0, max_grad_norm=max_norm)
        got, (_, overflow, _, norm) = gradients(weights, net, batches[1], clipped)
        assert not bool(overflow.asnumpy())
        tensors = [torch.nn.Parameter(torch.zeros(g.shape)) for g in raw.values()]
        for t, g in zip(tensors, raw.values()):
            t.grad = torch.tensor(g)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(tensors, max_norm))
        assert abs(float(norm.asnumpy()) - ref_norm) < 1e-5 * ref_norm
        for (name, _), t in zip(raw.items(), tensors):
            np.testing.assert_allclose(got[name], t.grad.numpy(), atol=1e-6, rtol=1e-5, err_msg=name)
        if max_norm < total:
            clipped_norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in got.values()))
            assert abs(clipped_norm - max_norm) < 1e-4 * max_norm


def kernels_built() -> bool:
    from msllm import kernels

    return kernels.available()


@pytest.mark.skipif(not kernels_built(), reason="msllm's CPU kernels are not built (make install builds them)")
def test_the_cpu_update_takes_the_steps_mindspore_adamweightdecay_takes(init, monkeypatch):
    """The CPU model with the one-pass update (AdamW.cpu_update: the kernel writes the Parameters in
    place, ordered by data dependencies alone) against the same model with MindSpore's
    AdamWeightDecay and the clipping multiply: over 5 steps at lr 2e-2 with clipping active, the same
    losses (each computed from the weights before its step's update: a write that overtook a read
    would show as the next step's loss) and the same weights and moments to float32 rounding."""
    import msllm.training.setup as setup

    weights, batches = init
    runs = {}
    for cpu in (False, True):
        net = network(weights, fast_paths=True)
        if not cpu:
            monkeypatch.setattr(setup, "model_cpu_kernels", lambda network: None)
        opt = build_optimizer(net, RunConfig(), np.full(5, 2e-2, np.float32))
        monkeypatch.undo()
        assert (opt.cpu_kernels is not None) == cpu
        step = TrainStep(net, opt, loss_scale="dynamic", scale_sense=1024.0, max_grad_norm=0.5)
        step.set_train()
        losses, after = [], []
        for b in batches[:5]:
            loss, overflow, _, norm = step(Tensor(b), Tensor(b))
            assert not bool(overflow.asnumpy()) and float(norm.asnumpy()) > 0.5   # clipping active
            losses.append(float(loss.asnumpy()))
            after.append(float(net(Tensor(b), Tensor(b)).asnumpy()))   # the same batch on the updated weights
        runs[cpu] = losses, {p.name: p.asnumpy().copy() for p in step.get_parameters()}
        print(f"cpu update {cpu}: losses {losses}; the same batches after each update {after}")
    (l0, s0), (l1, s1) = runs[False], runs[True]
    np.testing.assert_allclose(l1, l0, rtol=2e-6)
    # a loss computed after its step's update (a write overtaking a read) would be this far off
    assert min(abs(a - b) / b for a, b in zip(after, l1)) > 1e-3
    assert s0.keys() == s1.keys() and any(k.startswith("adam_v.") for k in s0)
    for k in s0:
        np.testing.assert_allclose(s1[k], s0[k], atol=2e-6, rtol=1e-5, err_msg=k)


def test_both_model_paths_take_the_same_training_steps(init):
    """The CPU fast path (msllm's kernels where built, 2-D views, loss over target positions
    only) and the path Ascend and the parallel layouts run (3-D RMSNorm, 4-D softmax, the dense
    loss over every position) train alike: the same losses, gradient norms and AdamW updates over
    4 steps with the dynamic loss scale and clipping, on labels with ignored positions."""
    weights, batches = init
    cfg = RunConfig()
    runs = {}
    for fast in (False, True):
        net = LlamaForCausalLM(CFG, fast_paths=fast)
        assert net.compact_loss == fast
        for p in net.trainable_params():
            p.set_data(Tensor(weights[p.name]))
        opt = build_optimizer(net, cfg, np.full(4, 1e-3, np.float32))
        step = TrainStep(net, opt, loss_scale="dynamic", scale_sense=1024.0, max_grad_norm=0.5)
        step.set_train()
        losses, norms = [], []
        for b in batches[:4]:
            labels = b.copy()
            labels[:, :4] = -100  # prompt positions: no target (the compact loss skips them)
            loss, overflow, _, norm = step(Tensor(b), Tensor(labels))
            assert not bool(overflow.asnumpy())
            losses.append(float(loss.asnumpy()))
            norms.append(float(norm.asnumpy()))
        runs[fast] = losses, norms, {p.name: p.asnumpy() for p in net.trainable_params()}
        print(f"fast_paths={fast}: {net.kernels.describe()}; losses {losses}; grad norms {norms}")
    (l0, n0, w0), (l1, n1, w1) = runs[False], runs[True]
    assert n0[0] > 0.5  # clipping was active on the first step
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    np.testing.assert_allclose(n1, n0, rtol=1e-4)
    moved = max(np.abs(w0[k] - weights[k]).max() for k in w0)
    assert moved > 1e-3  # the weights did change (4 AdamW steps at lr 1e-3)
    for k in w0:
        np.testing.assert_allclose(w1[k], w0[k], atol=2e-6, rtol=0, err_msg=k)
