"""The LLaMA family's other members (Qwen2, Qwen3, Mistral, Gemma, LLaMA with attention_bias, and
the mixture-of-experts Mixtral, Qwen3-MoE, Qwen2-MoE) on the training forward and backward, against
transformers (the independent reference): the loss with labels (for MoE including the
load-balancing term, ``output_router_logits``) and every parameter's gradient of one step on each
model path (the layout path, the CPU fast path with msllm's kernels, and the same without them),
plus sizes and config rules."""

import dataclasses

import numpy as np
import pytest

import mindspore as ms

from helpers.families import FAMILY_CASES
from msllm.convert.configs import msllm_config_to_hf
from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig, preset

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)

torch = pytest.importorskip("torch")  # test reference only

SEED = 20261126
PATHS = {"ascend_path": (False, None), "cpu_kernels": (True, True), "cpu_composed": (True, False)}
T = 40  # longer than the Mistral case's window (16), so the window cuts


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    from msllm.kernels import build

    build.build(verbose=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{case: (HF model, msllm config, checkpoint path)} for every family case."""
    from msllm.convert.hf import convert_hf_to_msllm
    from msllm.convert.verify import make_random_hf_model

    torch.set_num_threads(1)
    out = {}
    for k, (case, kw) in enumerate(sorted(FAMILY_CASES.items())):
        d = tmp_path_factory.mktemp(case)
        model = make_random_hf_model(str(d / "hf"), seed=SEED + k, **kw)
        res = convert_hf_to_msllm(str(d / "hf"), str(d / "m.ckpt"), progress=False)
        out[case] = (model, res.config, str(d / "m.ckpt"))
    print("seed", SEED)
    return out


def msllm_net(cfg, ckpt, path):
    from msllm.formats.loading import load_into, load_params
    from msllm.models.llama.model import LlamaForCausalLM

    fast_paths, cpu_kernels = PATHS[path]
    cfg = dataclasses.replace(cfg, seq_length=T, cpu_kernels=cpu_kernels)
    net = LlamaForCausalLM(cfg, fast_paths=fast_paths)
    load_into(net, load_params(ckpt, cfg), ckpt)
    return net


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_loss_and_gradients_equal_transformers(converted, case, path):
    from msllm.models.llama.names import msllm_to_hf_name

    hf, cfg, ckpt = converted[case]
    rng = np.random.default_rng(SEED)
    ids = rng.integers(3, cfg.vocab_size, (2, T + 1)).astype(np.int32)
    labels = ids.copy()
    labels[0, :7] = -100          # a prompt
    labels[1, 30:] = -100         # padding
    net = msllm_net(cfg, ckpt, path)
    net.set_train(True)
    params = net.trainable_params()
    loss, grads = ms.value_and_grad(net, grad_position=None, weights=params)(ms.Tensor(ids), ms.Tensor(labels))
    hf.train()
    hf.zero_grad()
    # the T tokens msllm's sample layout runs (input_ids[:, :-1]) with their next-token targets
    # (labels[:, 1:]), so an MoE model's router statistics (the load-balancing term) cover the same rows
    targets = torch.from_numpy(labels[:, 1:]).long()
    out = hf(input_ids=torch.from_numpy(ids[:, :-1]).long(), labels=targets, shift_labels=targets)
    out.loss.backward()
    ref = out.loss.item()
    print(case, path, "loss", float(loss.asnumpy()), "transformers", ref)
    assert abs(float(loss.asnumpy()) - ref) <= 1e-5 * abs(ref)
    named = dict(hf.named_parameters())
    assert len(params) == len(named)
    for p, g in zip(params, grads):
        want = named[msllm_to_hf_name(p.name)].grad.numpy()
        err = np.linalg.norm(g.asnumpy() - want) / np.linalg.norm(want)
        assert np.linalg.norm(want) > 0 and err <= 1e-4, (p.name, err)


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_parameter_count_equals_transformers(converted, case):
    hf, cfg, _ = converted[case]
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())


def test_flops_per_token_count_the_window_and_skip_the_biases():
    base = preset("tiny", seq_length=256)
    windowed = dataclasses.replace(base, sliding_window=64)
    c, layers, heads, d = base.hidden_size, base.num_layers, base.num_heads, base.head_dim
    attention = 12.0 * layers * heads * d
    assert base.train_flops_per_token() - windowed.train_flops_per_token() == pytest.approx(attention * (256 - 64))
    assert dataclasses.replace(base, sliding_window=1024).train_flops_per_token() == base.train_flops_per_token()
    # biases and q/k norms are parameters but not matmul weights: 6N does not grow with them
    qwen = dataclasses.replace(base, qkv_has_bias=True, qk_norm=True)
    assert qwen.num_params() == base.num_params() + layers * (c + 2 * 64 + 2 * d)
    assert qwen.matmul_params() == base.matmul_params()


@pytest.mark.parametrize("switches, model_type, message", [
    (dict(qk_norm=True), "llama", "qk_norm=True has no place in a 'llama' config.json"),
    (dict(sliding_window=8), "qwen2", "sliding_window=8 has no place in a 'qwen2'"),
    (dict(qkv_has_bias=False), "qwen2", "qkv_has_bias=False but model_type 'qwen2' always has True"),
    (dict(hidden_act="gelu_pytorch_tanh"), "llama", "hidden_act='gelu_pytorch_tanh' has no place"),
])
def test_configs_a_family_cannot_hold_are_refused_when_written_as_it(switches, model_type, message):
    fixed = {"qwen2": dict(qkv_has_bias=True)}.get(model_type, {})
    cfg = LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, seq_length=16),
                         **fixed, **switches, "model_type": model_type})
    with pytest.raises(MsllmError, match=message):
        msllm_config_to_hf(cfg)


@pytest.mark.parametrize("kw, message", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not a family msllm runs"),
    (dict(hidden_act="relu"), "hidden_act='relu'"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(hidden_size=30), "hidden_size=30 must be divisible by num_heads=4 .or set head_dim."),
    (dict(head_dim=7), "head_dim=7 must be even"),
])
def test_bad_family_switches_are_one_error_naming_the_key(kw, message):
    with pytest.raises(MsllmError, match=message):
        LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, seq_length=16), **kw})


# run YAML -> the sum of the released checkpoint's tensors (the numbers, from the published
# safetensors indexes)
RELEASED = {"configs/llama/run_llama3_1_8b.yaml": 8_030_261_248, "configs/qwen2_5/run_qwen2_5_7b.yaml": 7_615_616_512,
            "configs/qwen3/run_qwen3_8b.yaml": 8_190_735_360,
            "configs/mistral/run_mistral_7b_v0_1.yaml": 7_241_732_096, "configs/gemma/run_gemma_7b.yaml": 8_537_680_896}


@pytest.mark.parametrize("path", sorted(RELEASED))
def test_released_shapes_count_like_their_checkpoints_and_transformers(path):
    """The family YAMLs: --show prints the released checkpoint's parameter count, and transformers'
    own model of the config.json msllm writes for them (meta device, no weights) has as many."""
    import os
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    from msllm.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mc = load_config(os.path.join(root, path)).model_config
    assert mc.num_params() == RELEASED[path]
    hf = msllm_config_to_hf(mc)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    assert sum(p.numel() for p in model.parameters()) == RELEASED[path]
    r = subprocess.run([sys.executable, os.path.join(root, "run_msllm.py"), "--config", os.path.join(root, path), "--show"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0 and f"parameters: {RELEASED[path]:,}" in r.stdout, r.stderr[-2000:]
