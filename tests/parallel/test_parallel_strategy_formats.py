"""Strategy files in both of MindSpore's encodings: the protobuf default and JSON reshard
identically through MindSpore's own ``transform_checkpoints``; a MindFormers-named protobuf
strategy with its sharded MindFormers checkpoint is accepted by transform_ckpt and
auto_trans_ckpt; the blog's ``--dst_ckpt_strategy output/strategy/ckpt_strategy_rank_0.ckpt``
works on the files 8 ranks wrote."""

import os
import subprocess
import sys

import numpy as np
import pytest

import mindspore as ms

from msllm.config import ParallelLayoutConfig, load_config
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.names import msllm_to_mindformers_name
from msllm.parallel.param_layout import param_layouts, slice_for_rank
from msllm.parallel.reshard import reshard_for_start, transform_checkpoints
from msllm.parallel.reshard_inputs import collect_rank_checkpoints
from msllm.parallel.strategy import save_strategy_for_run, write_strategy_files
from msllm.parallel.strategy_files import list_strategy_files
from msllm.training import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MC = LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=96,
                 seq_length=16)
MP2 = ParallelLayoutConfig(data_parallel=4, model_parallel=2)
SEED = 31


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A full checkpoint of random weights ({name: array}) saved as rank_0/full.ckpt."""
    ms.set_device("CPU")
    print(f"seed {SEED}")
    rng = np.random.default_rng(SEED)
    from msllm.models.llama.names import param_shapes

    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in param_shapes(MC).items()}
    d = tmp_path_factory.mktemp("full")
    os.makedirs(d / "rank_0")
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in weights.items()], str(d / "rank_0" / "full.ckpt"))
    return d, weights


def load(path):
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path)).items()}


def test_both_encodings_reshard_identically_through_mindspore(full, tmp_path):
    src, weights = full
    outs = {}
    for fmt in ("json", "ckpt"):
        files = write_strategy_files(MC, MP2, str(tmp_path / f"s_{fmt}"), fmt=fmt)
        assert files[0].endswith(f"ckpt_strategy_rank_0.{fmt}")
        ms.transform_checkpoints(str(src), str(tmp_path / f"mp2_{fmt}"), "checkpoint_", None, files[0])
        ms.transform_checkpoints(str(tmp_path / f"mp2_{fmt}"), str(tmp_path / f"back_{fmt}"), "checkpoint_",
                                 files[0], None)
        back = load(collect_rank_checkpoints(str(tmp_path / f"back_{fmt}"))[0])
        for n, w in weights.items():
            np.testing.assert_array_equal(back[n], w, err_msg=n)
        outs[fmt] = {r: load(p) for r, p in collect_rank_checkpoints(str(tmp_path / f"mp2_{fmt}")).items()}
    assert sorted(outs["json"]) == list(range(8))
    lays = param_layouts(MC, MP2, include_optimizer_states=False)
    for r in range(8):
        assert outs["json"][r].keys() == outs["ckpt"][r].keys()
        for n in weights:
            np.testing.assert_array_equal(outs["ckpt"][r][n], outs["json"][r][n])
            np.testing.assert_array_equal(outs["ckpt"][r][n], slice_for_rank(weights[n], lays[n], r))


def mindformers_strategy(msllm_file, out_file):
    """A strategy as MindSpore writes it for a MindFormers run: protobuf, MindFormers' names
    (the rename is done here on the protobuf message, not by msllm)."""
    from mindspore.train import node_strategy_pb2 as pb

    msg = pb.ParallelStrategyMap()
    with open(msllm_file, "rb") as fh:
        msg.ParseFromString(fh.read())
    for item in msg.parallel_layout_item:
        item.param_name = msllm_to_mindformers_name(item.param_name) or item.param_name
    with open(out_file, "wb") as fh:
        fh.write(msg.SerializeToString())
    return out_file


def test_mindformers_protobuf_strategy_is_accepted_by_transform_and_auto_trans(full, tmp_path):
    src, weights = full
    msllm_pb = write_strategy_files(MC, MP2, str(tmp_path / "msllm_strategy"))  # protobuf by default
    os.makedirs(tmp_path / "mf_strategy")
    mf_pb = mindformers_strategy(msllm_pb[0], str(tmp_path / "mf_strategy" / "ckpt_strategy_rank_0.ckpt"))
    # a MindFormers user's sharded checkpoint: MindFormers names, sharded by MindSpore itself
    os.makedirs(tmp_path / "mf_full" / "rank_0")
    mf_weights = {msllm_to_mindformers_name(n): w for n, w in weights.items()}
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in mf_weights.items()],
                       str(tmp_path / "mf_full" / "rank_0" / "mf.ckpt"))
    ms.transform_checkpoints(str(tmp_path / "mf_full"), str(tmp_path / "mf_mp2"), "checkpoint_", None, mf_pb)
    # transform_ckpt: MindFormers strategy (file or directory) -> full, and -> msllm's layout
    out = transform_checkpoints(str(tmp_path / "mf_mp2"), str(tmp_path / "to_full"), mf_pb, None)
    merged = ckpt.load_params(out[0])  # MindFormers names are renamed on load
    for n, w in weights.items():
        np.testing.assert_array_equal(merged[n].asnumpy(), w, err_msg=n)
    out = transform_checkpoints(str(tmp_path / "mf_mp2"), str(tmp_path / "to_msllm"), str(tmp_path / "mf_strategy"),
                                str(tmp_path / "msllm_strategy"))
    lays = param_layouts(MC, MP2, include_optimizer_states=False)
    for r in (0, 5):
        part = ckpt.load_params(out[r])
        for n in weights:
            np.testing.assert_array_equal(part[n].asnumpy(), slice_for_rank(weights[n], lays[n], r), err_msg=n)
    # auto_trans_ckpt (src_strategy_path_or_dir = the MindFormers file) into a 1-rank run
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                      ["--parallel_config.data_parallel=1"])
    cfg.model.model_config = MC
    path = reshard_for_start(str(tmp_path / "mf_mp2"), mf_pb, cfg, 0, str(tmp_path / "auto"))
    got = ckpt.load_params(path)
    for n, w in weights.items():
        np.testing.assert_array_equal(got[n].asnumpy(), w, err_msg=n)


def test_blog_transform_command_on_the_files_eight_ranks_wrote(full, tmp_path):
    """Each of 8 ranks writes only its own file (as under run_distribute.sh); then, as written
    in the blog: ``transform_ckpt.py --dst_ckpt_strategy output/strategy/ckpt_strategy_rank_0.ckpt``."""
    src, weights = full
    cfg = load_config(os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml"),
                      ["--parallel_config.data_parallel=4", "--parallel_config.model_parallel=2",
                       "--parallel.parallel_mode=1", "--parallel.full_batch=True", "--output_dir=output"])
    cfg.model.model_config = MC
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for rank in range(8):
            save_strategy_for_run(cfg, rank=rank)
    finally:
        os.chdir(cwd)
    strategy = tmp_path / "output" / "strategy"
    assert sorted(list_strategy_files(str(strategy))) == list(range(8))
    assert sorted(os.listdir(strategy)) == sorted([f"ckpt_strategy_rank_{i}.ckpt" for i in range(8)] +
                                                  ["layout_summary.yaml"])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "transform_ckpt.py"), "--src_ckpt_strategy", "",
                        "--dst_ckpt_strategy", "output/strategy/ckpt_strategy_rank_0.ckpt", "--src_ckpt_dir", str(src),
                        "--dst_ckpt_dir", "sharded"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-2000:]
    lays = param_layouts(MC, MP2, include_optimizer_states=False)
    out = collect_rank_checkpoints(str(tmp_path / "sharded"))
    assert sorted(out) == list(range(8))
    for rank in (0, 3, 7):
        part = load(out[rank])
        for n in weights:
            np.testing.assert_array_equal(part[n], slice_for_rank(weights[n], lays[n], rank), err_msg=n)
