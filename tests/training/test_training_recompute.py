"""recompute_config in data_parallel mode (CPU included): whole-layer and selective
recomputation leave the training arithmetic unchanged (same losses and weights as without, to
float32 rounding) while the backward pass recomputes the marked activations. Memory and speed
effects are measured in benchmarks/recompute_effect.py (BENCHMARKS.md), not here."""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from msllm.config import RecomputeConfig, load_config
from msllm.models.llama.model import LlamaForCausalLM
from msllm.parallel.apply import apply_recompute
from msllm.training.step import TrainStep
from msllm.training.setup import build_optimizer

SEED = 11
TINY = "configs/llama/run_llama_tiny.yaml"
pytestmark = pytest.mark.usefixtures("graph_mode")  # tests/conftest.py


def run_steps(recompute: RecomputeConfig, weights, batches):
    cfg = load_config(TINY, ["--model.model_config.seq_length=16", "--model.model_config.num_layers=2",
                             "--parallel_config.data_parallel=1"])
    net = LlamaForCausalLM(cfg.model_config, fast_paths=cfg.fast_paths)
    for p in net.trainable_params():
        p.set_data(Tensor(weights[p.name]))
    marked = apply_recompute(net, recompute)
    opt = build_optimizer(net, cfg, np.full(len(batches), 1e-3, np.float32))
    step = TrainStep(net, opt, loss_scale="none", max_grad_norm=1.0)
    step.set_train()
    losses = [float(step(Tensor(b), Tensor(b))[0].asnumpy()) for b in batches]
    return marked, losses, {p.name: p.asnumpy() for p in net.trainable_params()}


@pytest.fixture(scope="module")
def reference():
    print(f"seed {SEED}")
    ms.set_seed(SEED)
    cfg = load_config(TINY, ["--model.model_config.seq_length=16", "--model.model_config.num_layers=2"])
    net = LlamaForCausalLM(cfg.model_config)
    weights = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    rng = np.random.default_rng(SEED)
    batches = [rng.integers(3, 32000, (2, 17)).astype(np.int32) for _ in range(3)]
    marked, losses, after = run_steps(RecomputeConfig(), weights, batches)
    assert marked == 0
    return weights, batches, losses, after


@pytest.mark.parametrize("rc", [RecomputeConfig(recompute=True), RecomputeConfig(select_recompute=True)],
                         ids=["full", "selective"])
def test_recompute_changes_no_number(reference, rc):
    weights, batches, losses, after = reference
    marked, got, got_after = run_steps(rc, weights, batches)
    assert marked == 2
    np.testing.assert_allclose(got, losses, rtol=1e-6)
    for name, w in after.items():
        np.testing.assert_allclose(got_after[name], w, rtol=1e-5, atol=1e-7, err_msg=name)
