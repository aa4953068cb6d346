"""Strategy files: produced fast and without weights for the 7B/13B/70B seed layouts, in the
format MindSpore reads, read back equal; the only_save_strategy path of run_msllm.py."""

import json
import os
import subprocess
import sys
import time
import tracemalloc

import pytest

from msllm.config import ParallelLayoutConfig, load_config
from msllm.models.llama.config import preset
from msllm.models.llama.names import param_shapes
from msllm.parallel.param_layout import param_layouts, rank_param_bytes
from msllm.parallel.reshard_inputs import resolve_strategy
from msllm.parallel.strategy import SUMMARY_NAME, save_strategy_for_run, write_strategy_files
from msllm.parallel.strategy_files import list_strategy_files, read_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(name, out):
    return load_config(os.path.join(ROOT, "configs", "llama", f"run_llama_{name}.yaml"), [f"--output_dir={out}"])


@pytest.mark.parametrize("name, ranks, stages", [("7b", 8, 1), ("13b", 16, 1), ("70b", 64, 4)])
def test_seed_layouts_write_fast_without_weights(name, ranks, stages, tmp_path):
    cfg = config(name, tmp_path)
    tracemalloc.start()
    t0 = time.perf_counter()
    out = save_strategy_for_run(cfg, rank=None)  # one process: every rank's file
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    files = list_strategy_files(out)
    assert sorted(files) == list(range(ranks)) and os.path.isfile(os.path.join(out, SUMMARY_NAME))
    assert all(p.endswith(".ckpt") for p in files.values())  # MindSpore's protobuf by default
    assert seconds < 10 and peak < 200 * 2**20, (seconds, peak)
    mc, pc = cfg.model_config, cfg.parallel_config
    lays = param_layouts(mc, pc)
    per_rank = {r: rank_param_bytes(lays, r, pc) for r in range(ranks)}
    print(f"\n{name}: {ranks} strategy files in {seconds:.2f}s, tracemalloc peak {peak / 2**20:.1f} MiB")
    for r in sorted({0, ranks - 1} | {s * ranks // stages for s in range(stages)}):
        b = per_rank[r]
        print(f"  rank {r:2d}: weights {b['weights'] / 2**30:.3f} GiB, AdamW moments "
              f"{b['optimizer_states'] / 2**30:.3f} GiB, total {b['total'] / 2**30:.3f} GiB")
    # read back: a rank's file is exactly its stage's part of param_layouts
    for r in (0, ranks - 1):
        back = read_strategy(files[r])
        stage = r // (pc.data_parallel * pc.model_parallel)
        want = {n: lay for n, lay in lays.items() if lay.stage == stage}
        assert set(back) == set(want)
        for n, rec in back.items():
            lay = want[n]
            assert (rec.dev_matrix, rec.tensor_map, rec.stages) == (lay.dev_matrix, lay.tensor_map, (stage,))
            assert rec.tensor_shape is None  # protobuf (the default) has no full shape
            # -1 = the whole repeat group, as MindSpore writes it (its compiled seed job's files)
            assert (rec.opt_shard_size, rec.opt_shard_step) == (-1 if lay.opt_shard_size else 0, lay.opt_shard_step)
    # independent count: every matrix is split dp*mp ways (optimizer shard x model parallel),
    # the RMSNorm weights (not optimizer-sharded, replicated) are whole
    shapes = param_shapes(mc)
    stage_layers = mc.num_layers // stages
    norms = 2 * stage_layers * mc.hidden_size
    matrices = {n: s for n, s in shapes.items() if len(s) == 2}
    if stages == 1:
        mat = sum(s[0] * s[1] for s in matrices.values())
        norms += mc.hidden_size
    else:  # stage 0 of 70B: embedding + its layers
        mat = sum(s[0] * s[1] for n, s in matrices.items()
                  if n == "model.embed_tokens.embedding_table" or
                  (n.startswith("model.layers.") and int(n.split(".")[2]) < stage_layers))
    expect_weights = (mat // (pc.data_parallel * pc.model_parallel) + norms) * 4
    assert per_rank[0]["weights"] == expect_weights
    assert per_rank[0]["optimizer_states"] == 2 * expect_weights


def test_files_are_what_mindspore_reads(tmp_path):
    import mindspore as ms

    mc = preset("tiny")
    pc = ParallelLayoutConfig(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=2,
                              optimizer_shard=True)
    js = write_strategy_files(mc, pc, str(tmp_path / "json"), fmt="json")
    pb = write_strategy_files(mc, pc, str(tmp_path / "pb"))
    assert js[5].endswith("ckpt_strategy_rank_5.json") and pb[5].endswith("ckpt_strategy_rank_5.ckpt")
    with open(js[5], encoding="utf-8") as fh:
        data = json.load(fh)
    assert data["current_stage"] == 1
    assert {item["stage"] for item in data["parallel_strategy_item"].values()} == {1}
    q = data["parallel_layout_item"]["model.layers.3.self_attn.q_proj.weight"]
    assert q == {"dev_matrix": [2, 2], "tensor_map": [0, -1], "tensor_shape": [128, 128], "field": 0,
                 "opt_weight_shard_step": 2, "opt_weight_shard_size": -1, "param_split_shape": [],
                 "indices_offset": []}
    assert data["parallel_strategy_item"]["model.layers.3.self_attn.q_proj.matmul"]["parallel_strategy"] == \
        [[2, 1], [2, 1]]
    for path in (js[5], pb[5]):       # MindSpore's own parser (JSON by extension, else protobuf)
        layouts = ms.parallel.build_searched_strategy(path)
        lay = layouts["model.layers.3.self_attn.q_proj.weight"]
        assert list(lay.dev_matrix[0].dim) == [2, 2] and list(lay.tensor_map[0].dim) == [0, -1]
        assert lay.opt_weight_shard_size == -1
    assert read_strategy(pb[5]) == {k: v._replace(tensor_shape=None) for k, v in read_strategy(js[5]).items()}
    # pipeline: one merged file through mindspore.merge_pipeline_strategys
    merged = resolve_strategy(str(tmp_path / "json"), str(tmp_path))
    rec = read_strategy(merged)
    assert rec["model.embed_tokens.embedding_table"].stages == (0,) and rec["lm_head.weight"].stages == (1,)
    assert rec["model.layers.3.self_attn.q_proj.weight"].stages == (1,)
    assert set(rec) == set(param_layouts(mc, pc))
    assert sorted(ms.rank_list_for_transform(0, merged, None)) == list(range(8))     # all 8 ranks


def run_cli(args, cwd):
    env = dict(os.environ, GLOG_v="3")
    for k in ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_only_save_strategy_on_cpu_for_a_model_parallel_layout(tmp_path):
    tiny = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
    r = run_cli(["--config", tiny, "--only_save_strategy", "True", "--parallel_config.data_parallel=2",
                 "--parallel_config.model_parallel=2", "--parallel_config.pipeline_stage=2",
                 "--parallel_config.micro_batch_num=2", "--parallel.parallel_mode=1", f"--output_dir={tmp_path}"],
                str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "strategy"
    assert f"strategy files for 8 rank(s) written to {out}" in r.stdout
    assert sorted(list_strategy_files(str(out))) == list(range(8))
    assert not (tmp_path / "checkpoint").exists()          # nothing was trained
    # the 70B layout (Ascend config) on this CPU machine
    r = run_cli(["--config", os.path.join(ROOT, "configs", "llama", "run_llama_70b.yaml"),
                 "--only_save_strategy", "True", f"--output_dir={tmp_path / 'b'}"], str(tmp_path))
    assert r.returncode == 0 and len(list_strategy_files(str(tmp_path / "b" / "strategy"))) == 64
    # an invalid layout is one clear error
    r = run_cli(["--config", tiny, "--only_save_strategy", "True", "--parallel_config.model_parallel=4",
                 "--parallel.parallel_mode=1", f"--output_dir={tmp_path / 'c'}"], str(tmp_path))
    assert r.returncode == 2 and "n_kv_heads=2 is not divisible by parallel_config.model_parallel=4" in r.stderr
    assert not (tmp_path / "c" / "strategy").exists()


def test_rewriting_replaces_the_directory_atomically(tmp_path):
    mc = preset("tiny")
    out = str(tmp_path / "s")
    write_strategy_files(mc, ParallelLayoutConfig(data_parallel=8), out)
    write_strategy_files(mc, ParallelLayoutConfig(data_parallel=2), out)
    assert sorted(list_strategy_files(out)) == [0, 1]                  # no stale ranks 2..7
    assert [p for p in os.listdir(tmp_path) if p != "s"] == []         # no temporary leftovers
