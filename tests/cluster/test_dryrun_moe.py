"""Issue #30: mixture of experts with ``expert_parallel`` compiled by MindSpore's dry-run.

Rank 5 of the tiny LLaMA with 4 experts (2 chosen) under dp4 x mp2, expert_parallel 4 (= dp, the
usual MindFormers setting: each data-parallel rank holds one expert), no pipeline, seq 64, compiled
with ``run_msllm.py --sim_level 1`` at ``jit_level: O1`` (on the stub layer without graph-kernel
fusion: before, MindSpore stopped there with a bare ``RuntimeError: stoi``); MindSpore's strategy file against msllm's offline one, and
the compiled graph's collectives against a table derived by hand:

* GShard's dispatch and combine (Lepikhin et al. 2020, sec. 2.2): one all-to-all into the experts'
  layout and one back, over the expert group (the ep ranks of one model-parallel index), per MoE
  layer forward, and one each backward;
* Megatron-LM inside each expert (Shoeybi et al. 2019, sec. 3): the fused ``gate_up_proj`` and
  ``down_proj`` are row parallel (``msllm/parallel/layout_rules.py`` ``_moe`` says why gate_up is not
  column parallel), so one all-reduce over the model-parallel group after each;
* the router's (N, E) combine weights, which MindSpore's default strategy computes split over every
  rank, gathered once over the model-parallel group back to the tokens' data-parallel layout;
* nothing inside a layer over the whole world: before this layout MindSpore gathered every token of
  the job on every rank for the experts (an AllGather over all 8 ranks per layer), and without
  ``enable_alltoall`` it builds each all-to-all from AllGather and slicing.

No seed: nothing random is compared (the compile allocates no weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
DP, MP, EP, RANK = 4, 2, 4, 5
LAYERS = 4  # the tiny model's, all MoE
LAYOUT = ["--parallel.parallel_mode=1", "--parallel.full_batch=True", f"--parallel_config.data_parallel={DP}",
          f"--parallel_config.model_parallel={MP}", "--parallel_config.pipeline_stage=1",
          f"--parallel_config.expert_parallel={EP}", "--runner_config.batch_size=1",
          "--model.model_config.seq_length=64", "--model.model_config.moe_config={expert_num: 4, num_experts_chosen: 2}",
          "--context.jit_level=O1"]  # msllm's 7B/13B/70B YAMLs' level

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("dryrun_moe")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY, "--run_mode", "train",
                           "--sim_level", "1", "--sim_rank_id", str(RANK), *LAYOUT, f"--output_dir={out / 'sim'}"],
                          capture_output=True, text=True, cwd=out, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    off = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY, "--only_save_strategy",
                          "True", *LAYOUT, f"--output_dir={out / 'offline'}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]
    report = json.loads((out / "sim" / "log" / f"rank_{RANK}" / "dryrun_report.json").read_text())
    assert "error" not in report, report.get("error")
    assert report["jit_level"] == "O1" and report["graph_kernel_fusion"] is False
    assert "O1 without graph-kernel fusion" in proc.stdout + proc.stderr
    assert report["peak_memory"]["used_peak_mib"] > 0  # the level-1 step ran
    return out, report


def test_moe_strategy_file_equals_msllm_offline_file(moe):
    from msllm.parallel.strategy_files import load_strategy_map

    out, _ = moe
    keys = ("dev_matrix", "tensor_map", "field", "opt_weight_shard_step", "opt_weight_shard_size")
    name = f"ckpt_strategy_rank_{RANK}.ckpt"
    ms_file, ours = ({n: {k: lay[k] for k in keys} for n, lay in load_strategy_map(str(d / "strategy" / name))
                      ["parallel_layout_item"].items()} for d in (out / "sim", out / "offline"))
    assert sorted(ms_file) == sorted(ours)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ms_file
    for n in ms_file:
        assert ms_file[n] == ours[n], n


def test_moe_collectives_match_gshard_and_megatron_accounting(moe):
    _, report = moe
    ops = report["collectives"]["ops"]
    mp_group = sorted({RANK, RANK ^ 1})                           # ranks = dp index * MP + mp index
    expert_group = [d * MP + RANK % MP for d in range(DP)]        # ep = dp: every data-parallel rank
    world = list(range(DP * MP))

    def forward(kind, group):
        return Counter(o["layer"] for o in ops if o["kind"] == kind and not o["backward"] and o["group"] == group
                       and "experts-Experts" in o["scope"])

    each_layer = range(LAYERS)
    assert forward("AlltoAll", expert_group) == Counter({i: 2 for i in each_layer})   # dispatch, combine
    assert forward("AllReduce", mp_group) == Counter({i: 2 for i in each_layer})      # gate_up, down
    assert forward("AllGather", mp_group) == Counter({i: 1 for i in each_layer})      # router weights
    in_experts = Counter((o["kind"], tuple(o["group"])) for o in ops if not o["backward"]
                         and "experts-Experts" in o["scope"])
    assert sum(in_experts.values()) == 5 * LAYERS, in_experts                         # nothing else
    backward_a2a = [o for o in ops if o["kind"] == "AlltoAll" and o["backward"]]
    assert len(backward_a2a) == 2 * LAYERS and all(o["group"] == expert_group for o in backward_a2a)
    in_layers = [o["scope"] for o in ops if o["layer"] is not None and o["group"] == world and not o["backward"]]
    assert in_layers == [], in_layers
    assert not [o for o in ops if o["kind"] == "AlltoAll" and o["group"] != expert_group]
