"""Issue #30: the Ascend job compiled by MindSpore's dry-run on this CPU machine.

One session fixture compiles 2 of the 8 ranks (rank 0: stage 0, rank 5: stage 1) of the tiny LLaMA
under dp2 x mp2 x pp2 (optimizer shard off, 2 micro batches, seq 64) with
``run_msllm.py --sim_level 1 --sim_rank_id 0,5``; the tests then read what MindSpore wrote:

* every named rank compiled, with MindSpore's peak memory and msllm's planner figure;
* MindSpore's strategy file of each rank equals msllm's offline ``--only_save_strategy`` file for
  that rank (parameters, dev_matrix, tensor_map, opt-shard fields);
* the compiled graph's collectives against a table derived by hand from Megatron-LM's accounting
  (Shoeybi et al. 2019, sec. 3: per transformer layer one all-reduce over the tensor-parallel
  group after the row-parallel o_proj and down_proj in the forward pass and two in the backward
  pass for the column-parallel inputs; data-parallel gradient all-reduce once per parameter;
  pipeline stages exchange activations forward and gradients backward point to point);
* ``tools/transform_ckpt.py``'s resharding gives the same rank checkpoints with MindSpore's
  strategy files as with msllm's;
* packed rows (issue #33): the same two ranks compiled again with ``train_dataset.dataset_dir`` a
  packed MindRecord of the bundled Alpaca data (``--pack``, seq 64), so the step takes the
  documents' ends (``actual_seq_len``) as its third input through the pipeline: the same strategy
  files and the same Megatron accounting (the per-row rotary and mask add no collective).

Seeds: the random checkpoint uses numpy seed 0 (printed). The stub device layer is built once
into $MSLLM_CACHE (about a minute the first time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
DP, MP, PP = 2, 2, 2
RANKS = (0, 5)
LAYOUT = ["--parallel.parallel_mode=1", "--parallel.full_batch=True", f"--parallel_config.data_parallel={DP}",
          f"--parallel_config.model_parallel={MP}", f"--parallel_config.pipeline_stage={PP}",
          "--parallel_config.micro_batch_num=2", "--runner_config.batch_size=1", "--model.model_config.seq_length=64"]
LAYERS_PER_STAGE = 2  # the tiny model's 4 layers over 2 stages
# parameters of one decoder layer split over the model-parallel group (q, k, v, o, gate, up, down)
# and replicated over it (the two RMSNorm weights)
SPLIT_PER_LAYER, REPLICATED_PER_LAYER = 7, 2

pytestmark = pytest.mark.slow


def packed_mindrecord(directory) -> str:
    """40 bundled Alpaca conversations, ``--pack``ed at seq 64 (most are cut to one a row: the
    dry-run reads only the ``actual_seq_len`` width, 2)."""
    from msllm.data.conversation import convert_alpaca_file
    from msllm.data.preprocess import preprocess_to_mindrecord

    conv = str(directory / "conv.json")
    convert_alpaca_file(os.path.join(ROOT, "examples", "data", "alpaca_en_demo.json"), conv)
    path = str(directory / "packed.mindrecord")
    preprocess_to_mindrecord(conv, "qa", os.path.join(ROOT, "examples", "data", "tokenizer.model"), 64, path,
                             pack=True, shuffle=False, progress=False, samples_num=40)
    return path


@pytest.fixture(scope="session")
def packed(tmp_path_factory):
    """The dry-run of the same ranks on packed rows: (output dir, reports)."""
    out = tmp_path_factory.mktemp("dryrun_packed")
    data = packed_mindrecord(out)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY, "--run_mode",
                           "train", "--sim_level", "1", "--sim_rank_id", ",".join(map(str, RANKS)), "--sim_jobs", "2",
                           *LAYOUT, f"--train_dataset.dataset_dir={data}", f"--output_dir={out / 'sim'}"],
                          capture_output=True, text=True, cwd=out, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return out, {r: json.loads((out / "sim" / "log" / f"rank_{r}" / "dryrun_report.json").read_text()) for r in RANKS}


@pytest.fixture(scope="session")
def dryrun(tmp_path_factory):
    out = tmp_path_factory.mktemp("dryrun")
    cmd = [sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY, "--run_mode", "train",
           "--sim_level", "1", "--sim_rank_id", ",".join(map(str, RANKS)), "--sim_jobs", "2", *LAYOUT,
           f"--output_dir={out / 'sim'}"]
    cwd = out / "cwd"  # a fresh working directory: the dry-run leaves nothing in it
    cwd.mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert list(cwd.iterdir()) == []  # no ./offload (MindSpore's offload_path) left behind
    off = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY, "--only_save_strategy",
                          "True", *LAYOUT, f"--output_dir={out / 'offline'}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]
    reports = {r: json.loads((out / "sim" / "log" / f"rank_{r}" / "dryrun_report.json").read_text()) for r in RANKS}
    return out, proc.stdout + proc.stderr, reports


def test_every_named_rank_compiles_with_memory_and_planner(dryrun):
    out, text, reports = dryrun
    assert "compile-only simulation" in text  # the one start-up line naming the stub layer
    for rank, r in reports.items():
        assert "error" not in r, r.get("error")
        assert r["stage"] == rank // (DP * MP) and r["rank_size"] == DP * MP * PP
        assert r["pipeline_train_step"] and r["input_shape"] == [1 * DP * 2, 65]
        assert r["peak_memory"]["used_peak_mib"] > 0 and r["planner_mib"] > 0
        assert 0.2 < r["ratio"] < 5, r  # same order of magnitude; the calibration itself is BENCHMARKS.md's
        assert os.path.isfile(r["strategy_file"])
        assert r["strategy_file"] == str(out / "sim" / "strategy" / f"ckpt_strategy_rank_{rank}.ckpt")
        assert f"rank {rank:>3} stage {r['stage']}" in text


def _layouts(path):
    from msllm.parallel.strategy_files import load_strategy_map

    keys = ("dev_matrix", "tensor_map", "field", "opt_weight_shard_step", "opt_weight_shard_size")
    return {n: {k: lay[k] for k in keys} for n, lay in load_strategy_map(path)["parallel_layout_item"].items()}


@pytest.mark.parametrize("rows", ["one sequence", "packed"])
@pytest.mark.parametrize("rank", RANKS)
def test_mindspore_strategy_file_equals_msllm_offline_file(dryrun, packed, rank, rows):
    out, _, _ = dryrun
    sim = packed[0] if rows == "packed" else out
    ms_file = _layouts(str(sim / "sim" / "strategy" / f"ckpt_strategy_rank_{rank}.ckpt"))
    ours = _layouts(str(out / "offline" / "strategy" / f"ckpt_strategy_rank_{rank}.ckpt"))
    assert sorted(ms_file) == sorted(ours)
    assert any(n.startswith("accu_grads.") for n in ms_file)  # the pipeline's accumulators are in both
    for name in ms_file:
        assert ms_file[name] == ours[name], name


@pytest.mark.parametrize("rows", ["one sequence", "packed"])
@pytest.mark.parametrize("rank", RANKS)
def test_collectives_match_megatron_accounting(dryrun, packed, rank, rows):
    """Table by hand for rank R of dp2 x mp2 x pp2 (2 layers per stage, 2 micro batches in one
    shared graph): model-parallel group {R, R^1}, data-parallel group {R, R^2}, stage group of 4."""
    reports = packed[1] if rows == "packed" else dryrun[2]
    assert reports[rank]["packed_documents"] == (2 if rows == "packed" else 0)   # the third input was fed
    c = reports[rank]["collectives"]
    stage = rank // (DP * MP)
    ops = c["ops"]
    mp_group = sorted({rank, rank ^ 1})
    dp_group = sorted({rank, rank ^ 2})
    stage_group = list(range(stage * DP * MP, (stage + 1) * DP * MP))
    fwd_ar = Counter((o["layer"], o["scope"].rsplit("/", 2)[-2]) for o in ops
                     if o["kind"] == "AllReduce" and not o["backward"] and o["group"] == mp_group and o["layer"] is not None)
    layers = range(stage * LAYERS_PER_STAGE, (stage + 1) * LAYERS_PER_STAGE)
    # Megatron g: one forward all-reduce after each row-parallel linear, none elsewhere in the layer
    assert fwd_ar == Counter({(i, p): 1 for i in layers for p in ("o_proj-Linear", "down_proj-Linear")}), fwd_ar
    # Megatron f's backward: one all-reduce per column-parallel input (attention in, MLP in) per layer
    bwd_mp = [o for o in ops if o["kind"] == "AllReduce" and o["backward"] and o["group"] == mp_group
              and "Mirror" not in o["scope"]]
    assert len(bwd_mp) == 2 * LAYERS_PER_STAGE, [o["scope"] for o in bwd_mp]
    # data-parallel gradient reduction: one per parameter, over the ranks holding the same slice
    mirror = Counter(tuple(o["group"]) for o in ops if "Mirror" in o["scope"])
    split = SPLIT_PER_LAYER * LAYERS_PER_STAGE
    replicated = REPLICATED_PER_LAYER * LAYERS_PER_STAGE + 1 + 0  # + embedding (stage 0) / final norm (stage 1)
    if stage == PP - 1:
        replicated += 1  # lm_head: vocab_emb_dp keeps the head replicated over the model-parallel group
    assert mirror == Counter({tuple(dp_group): split, tuple(stage_group): replicated}), mirror
    # Megatron's layer holds no all-gather / reduce-scatter without sequence parallelism; MindSpore
    # inserted them (redistributions over the model-parallel group, 4-7 per layer) until rotate_half's
    # split, repeat_kv's copy and the attention's output transpose got strategies of their own
    in_layer = [o["scope"] for o in ops if o["kind"] in ("AllGather", "ReduceScatter") and o["layer"] is not None]
    assert in_layer == [], in_layer
    # pipeline: point to point with the same position in the other stage only
    peer = sorted({rank, rank + DP * MP if stage == 0 else rank - DP * MP})
    p2p = [(o["kind"], o["backward"]) for o in ops if o["kind"] in ("Send", "Receive")]
    assert all(o["group"] == peer for o in ops if o["kind"] in ("Send", "Receive"))
    want = {("Send", False), ("Receive", True)} if stage == 0 else {("Receive", False), ("Send", True)}
    assert set(p2p) == want, p2p


def test_transform_ckpt_reshards_the_same_with_mindspore_files(dryrun, tmp_path):
    import mindspore as ms

    from msllm.config import load_config
    from msllm.models.llama.names import param_shapes

    out, _, _ = dryrun
    seed = 0
    print(f"numpy seed {seed}")
    rng = np.random.default_rng(seed)
    mc = load_config(TINY, LAYOUT[-1:]).model_config
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in param_shapes(mc).items()}
    (tmp_path / "full" / "rank_0").mkdir(parents=True)
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in weights.items()],
                       str(tmp_path / "full" / "rank_0" / "full.ckpt"))
    results = {}
    for which, sub in (("mindspore", "sim"), ("msllm", "offline")):
        strat = tmp_path / f"strategy_{which}"
        strat.mkdir()
        for r in RANKS:  # one file per stage is what a pipelined destination needs
            name = f"ckpt_strategy_rank_{r}.ckpt"
            (strat / name).write_bytes((out / sub / "strategy" / name).read_bytes())
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "transform_ckpt.py"), "--src_ckpt_strategy",
                               "", "--dst_ckpt_strategy", str(strat), "--src_ckpt_dir", str(tmp_path / "full"),
                               "--dst_ckpt_dir", str(tmp_path / f"out_{which}")], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, GLOG_v="3"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[which] = tmp_path / f"out_{which}"
    for r in range(DP * MP * PP):
        a = ms.load_checkpoint(str(results["mindspore"] / f"rank_{r}" / f"checkpoint_{r}.ckpt"))
        b = ms.load_checkpoint(str(results["msllm"] / f"rank_{r}" / f"checkpoint_{r}.ckpt"))
        assert sorted(a) == sorted(b), r
        for n in a:
            np.testing.assert_array_equal(a[n].asnumpy(), b[n].asnumpy(), err_msg=f"rank {r} {n}")
