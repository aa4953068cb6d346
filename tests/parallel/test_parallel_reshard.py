"""Checkpoint resharding with mindspore.transform_checkpoints on msllm's strategy files: round
trips are bit-exact, every rank holds the slice its layout predicts, errors are clear."""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from msllm.config import ParallelLayoutConfig, RunConfig
from msllm.errors import MsllmError
from msllm.models.llama.config import preset
from msllm.parallel.param_layout import param_layouts, slice_for_rank, stage_of_rank
from msllm.parallel.reshard import reshard_for_start, transform_checkpoints
from msllm.parallel.reshard_inputs import collect_rank_checkpoints, resolve_strategy
from msllm.parallel.strategy import write_strategy_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# tiny with 4 kv heads (MHA) so that model_parallel=4 is valid; the GQA tiny (2 kv heads) below
MHA = preset("tiny", n_kv_heads=4)
GQA = preset("tiny")
A = ParallelLayoutConfig(data_parallel=2, model_parallel=2, optimizer_shard=True)
B = ParallelLayoutConfig(model_parallel=4)
PP = ParallelLayoutConfig(model_parallel=2, pipeline_stage=2, micro_batch_num=2, vocab_emb_dp=False)


def save_full_train_checkpoint(mc, path, seed):
    """A full checkpoint of the train step (weights, AdamW moments with random values, step, loss
    scale), as the trainer saves it; returns {name: array}."""
    import mindspore as ms

    ms.set_device("CPU")
    from msllm.cluster.context import Runtime
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.setup import build_optimizer, build_train_step

    ms.set_seed(seed)
    cfg = RunConfig()
    cfg.model.model_config = mc
    net = LlamaForCausalLM(mc)
    opt = build_optimizer(net, cfg, np.full(4, 1e-4, np.float32))
    step = build_train_step(net, opt, cfg, Runtime(0, 1, "CPU"))
    rng = np.random.default_rng(seed)
    for p in opt.moments1 + opt.moments2:
        p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ms.save_checkpoint(step, path)
    return {p.name: p.asnumpy() for p in step.get_parameters()}


def load(path):
    import mindspore as ms

    return {k: v.asnumpy() for k, v in ms.load_checkpoint(path).items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    full_mha = save_full_train_checkpoint(MHA, str(d / "full_mha" / "rank_0" / "full.ckpt"), 1)
    full_gqa = save_full_train_checkpoint(GQA, str(d / "full_gqa" / "rank_0" / "full.ckpt"), 2)
    # JSON: it carries full tensor shapes, which the error tests below rely on
    write_strategy_files(MHA, A, str(d / "strategy_A"), fmt="json")
    write_strategy_files(MHA, B, str(d / "strategy_B"), fmt="json")
    write_strategy_files(GQA, PP, str(d / "strategy_PP"), fmt="json")
    write_strategy_files(preset("tiny", n_kv_heads=4, num_layers=6), B, str(d / "strategy_2L"), fmt="json")
    return d, full_mha, full_gqa


def assert_rank_slices(out_dir, full, mc, layout):
    """Every rank's checkpoint holds exactly its stage's parameters, each the predicted slice;
    parameters outside the strategy (step, loss scale ...) are copied unchanged."""
    lays = param_layouts(mc, layout)
    ranks = collect_rank_checkpoints(str(out_dir))
    assert sorted(ranks) == list(range(layout.device_num))
    per_stage = layout.data_parallel * layout.model_parallel
    for rank, path in ranks.items():
        got = load(path)
        stage = stage_of_rank(rank, layout)
        want_names = {n for n in full if n not in lays or lays[n].stage == stage}
        assert set(got) == want_names, rank
        for name, arr in got.items():
            want = slice_for_rank(full[name], lays[name], rank % per_stage) if name in lays else full[name]
            assert arr.shape == want.shape and np.array_equal(arr, want), (rank, name)


def assert_equal_full(path, full):
    got = load(path)
    assert set(got) == set(full)
    for name in full:
        assert np.array_equal(got[name], full[name]), name


def test_full_to_dp2mp2_to_mp4_to_full_is_bit_exact(work):
    d, full, _ = work
    transform_checkpoints(str(d / "full_mha"), str(d / "A"), None, str(d / "strategy_A"))
    assert_rank_slices(d / "A", full, MHA, A)
    # optimizer sharding really split the weights: q_proj is (128,128) -> (32,128) on each rank
    assert load(collect_rank_checkpoints(str(d / "A"))[3])["model.layers.0.self_attn.q_proj.weight"].shape == (32, 128)
    transform_checkpoints(str(d / "A"), str(d / "B"), str(d / "strategy_A"), str(d / "strategy_B"))
    assert_rank_slices(d / "B", full, MHA, B)
    out = transform_checkpoints(str(d / "B"), str(d / "back"), str(d / "strategy_B"), "")
    assert list(out) == [0] and os.path.basename(out[0]) == "checkpoint_0.ckpt"
    assert_equal_full(out[0], full)


def test_full_to_pipeline_mp2_to_full_is_bit_exact(work):
    d, _, full = work
    transform_checkpoints(str(d / "full_gqa"), str(d / "PP"), "", str(d / "strategy_PP"))
    assert_rank_slices(d / "PP", full, GQA, PP)
    # stage 0 ranks have no head, stage 1 ranks no embedding
    r0, r3 = (load(collect_rank_checkpoints(str(d / "PP"))[r]) for r in (0, 3))
    assert "model.embed_tokens.embedding_table" in r0 and "lm_head.weight" not in r0
    assert "lm_head.weight" in r3 and "model.layers.0.mlp.up_proj.weight" not in r3
    out = transform_checkpoints(str(d / "PP"), str(d / "PP_back"), str(d / "strategy_PP"), None)
    assert_equal_full(out[0], full)


def test_errors_are_clear(work):
    d, _, _ = work
    with pytest.raises(MsllmError, match="does not exist"):
        transform_checkpoints(str(d / "nope"), str(d / "x"), None, str(d / "strategy_A"))
    with pytest.raises(MsllmError, match="holds ranks \\[0, 1, 2, 3\\] but no source strategy"):
        transform_checkpoints(str(d / "A"), str(d / "x"), None, None)
    with pytest.raises(MsllmError, match="wrong strategy for this checkpoint"):
        transform_checkpoints(str(d / "A"), str(d / "x"), str(d / "strategy_B"), None)
    with pytest.raises(MsllmError, match="exists and is not empty"):
        transform_checkpoints(str(d / "full_mha"), str(d / "A"), None, str(d / "strategy_A"))
    with pytest.raises(MsllmError, match="strategy_PP.*k_proj.weight has full shape \\[64, 128\\], the checkpoint's "
                       "is \\[128, 128\\]: different model shapes"):
        transform_checkpoints(str(d / "full_mha"), str(d / "x"), None, str(d / "strategy_PP"))  # GQA strategy
    with pytest.raises(MsllmError, match="lists .* parameter\\(s\\) the source checkpoint lacks"):
        transform_checkpoints(str(d / "full_mha"), str(d / "x"), None, str(d / "strategy_2L"))  # 2-layer model
    with pytest.raises(MsllmError, match="src_strategy .* does not exist"):
        transform_checkpoints(str(d / "A"), str(d / "x"), str(d / "missing"), None)
    # a rank missing from a sharded checkpoint
    broken = d / "A_broken"
    for r in (0, 1, 2):
        os.makedirs(broken / f"rank_{r}")
        src = collect_rank_checkpoints(str(d / "A"))[r]
        os.symlink(src, broken / f"rank_{r}" / os.path.basename(src))
    with pytest.raises(MsllmError, match="lacks rank\\(s\\) \\[3\\]"):
        transform_checkpoints(str(broken), str(d / "x"), str(d / "strategy_A"), None)
    # a pipeline strategy directory missing a stage
    half = d / "strategy_half"
    os.makedirs(half)
    for r in (0, 1):
        os.symlink(d / "strategy_PP" / f"ckpt_strategy_rank_{r}.json", half / f"ckpt_strategy_rank_{r}.json")
    os.symlink(d / "strategy_PP" / "ckpt_strategy_rank_2.json", half / "ckpt_strategy_rank_2.json")
    resolve_strategy(str(half), str(d))  # stages 0 and 1 present: fine
    os.unlink(half / "ckpt_strategy_rank_0.json")
    os.unlink(half / "ckpt_strategy_rank_1.json")
    with pytest.raises(MsllmError, match="stages \\[0\\] are missing"):
        resolve_strategy(str(half), str(d))
    assert not os.path.exists(d / "x")


def test_newest_checkpoint_of_a_rank_is_used(work, tmp_path):
    d, full, _ = work
    rank_dir = tmp_path / "run" / "rank_0"
    os.makedirs(rank_dir)
    src = str(d / "full_mha" / "rank_0" / "full.ckpt")
    os.symlink(src, rank_dir / "checkpoint_0-1_1000.ckpt")       # newest by step, not by name
    with open(rank_dir / "checkpoint_0-1_900.ckpt", "wb") as fh:
        fh.write(b"not a checkpoint")
    assert collect_rank_checkpoints(str(tmp_path / "run"))[0].endswith("checkpoint_0-1_1000.ckpt")
    out = transform_checkpoints(str(tmp_path / "run"), str(tmp_path / "out"), None, str(d / "strategy_B"))
    assert len(out) == 4


def test_reshard_for_start_gives_each_rank_its_slice(work, tmp_path):
    d, full_mha, full_gqa = work
    full_file = str(d / "full_gqa" / "rank_0" / "full.ckpt")
    lays = param_layouts(GQA, PP)
    for rank in range(4):      # from a full checkpoint file to the pipelined layout
        path = reshard_for_start(full_file, None, str(d / "strategy_PP"), rank, str(tmp_path / "start"))
        assert path == str(tmp_path / "start" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        got = load(path)
        for name, arr in got.items():
            want = slice_for_rank(full_gqa[name], lays[name], rank % 2) if name in lays else full_gqa[name]
            assert np.array_equal(arr, want), (rank, name)
        # accu_grads.* (MindSpore's pipeline accumulators, in the strategy since issue #30) are not in a checkpoint
        assert {n for n in got if n in lays} == {n for n in lays if lays[n].stage == stage_of_rank(rank, PP)
                                                 and not n.startswith("accu_grads.")}
    # from the sharded (dp2, mp2, optimizer-sharded) checkpoint to a RunConfig layout (mp4)
    cfg = RunConfig()
    cfg.model.model_config = MHA
    cfg.parallel_config = B
    cfg.parallel.parallel_mode = 1
    lays_b = param_layouts(MHA, B)
    path = reshard_for_start(str(d / "A"), str(d / "strategy_A"), cfg, 2, str(tmp_path / "start_b"))
    got = load(path)
    assert set(got) == set(full_mha)
    for name, arr in got.items():
        want = slice_for_rank(full_mha[name], lays_b[name], 2) if name in lays_b else full_mha[name]
        assert np.array_equal(arr, want), name
    assert os.listdir(tmp_path / "start_b") == ["rank_2"]          # private work files removed
    with pytest.raises(MsllmError, match="rank 4 is outside the destination layout of 4 ranks"):
        reshard_for_start(full_file, None, str(d / "strategy_PP"), 4, str(tmp_path / "start"))


def test_transform_ckpt_tool(work, tmp_path, capsys):
    d, full, _ = work
    env = dict(os.environ, GLOG_v="3")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "transform_ckpt.py"), "--src_ckpt_strategy",
           str(d / "strategy_A"), "--dst_ckpt_strategy", "", "--src_ckpt_dir", str(d / "A"),
           "--dst_ckpt_dir", str(tmp_path / "merged"), "--prefix", "llama_"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote 1 rank checkpoint(s)" in r.stdout
    assert_equal_full(str(tmp_path / "merged" / "rank_0" / "llama_0.ckpt"), full)
    # a wrong source strategy: one error line, exit status 2, nothing written (in-process: same main())
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import transform_ckpt

    with pytest.raises(SystemExit) as exc:
        transform_ckpt.main(["--src_ckpt_strategy", str(d / "strategy_B"), "--src_ckpt_dir", str(d / "A"),
                             "--dst_ckpt_dir", str(tmp_path / "m2")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and "wrong strategy" in err
    assert not glob.glob(str(tmp_path / "m2*"))


def test_protobuf_strategy_files_work_too(tmp_path):
    import mindspore as ms

    ms.set_device("CPU")
    from msllm.models.llama.model import LlamaForCausalLM

    mc = preset("tiny", num_layers=2)
    net = LlamaForCausalLM(mc)
    ms.save_checkpoint(net, str(tmp_path / "full.ckpt"))
    full = {p.name: p.asnumpy() for p in net.get_parameters()}
    write_strategy_files(mc, PP, str(tmp_path / "pb"), fmt="ckpt")         # ckpt_strategy_rank_{i}.ckpt
    transform_checkpoints(str(tmp_path / "full.ckpt"), str(tmp_path / "o"), None, str(tmp_path / "pb"))
    assert_rank_slices(tmp_path / "o", full, mc, PP)
    out = transform_checkpoints(str(tmp_path / "o"), str(tmp_path / "b"), str(tmp_path / "pb"), None)
    assert_equal_full(out[0], full)


def test_family_switches_reshard_bit_exactly(tmp_path):
    """Biases (split like their weight's output on column-parallel q/k/v, whole on o), Qwen3's q/k
    norms and Gemma's offset norms (replicated): full -> dp 2 x mp 2 (optimizer shard) -> full and
    -> dp 2 x mp 2 x pp 2 -> full through MindSpore's transform_checkpoints, every rank's slice as
    param_layouts predicts."""
    mc = preset("tiny", num_layers=2, n_kv_heads=4, qkv_has_bias=True, attention_bias=True, qk_norm=True,
                rms_norm_offset=1.0, hidden_act="gelu_pytorch_tanh", embedding_multiplier=2.0, sliding_window=8)
    full = save_full_train_checkpoint(mc, str(tmp_path / "full" / "rank_0" / "full.ckpt"), 4)
    assert "model.layers.1.self_attn.o_proj.bias" in full and "model.layers.1.self_attn.k_norm.weight" in full
    lays = param_layouts(mc, A)
    assert lays["model.layers.0.self_attn.q_proj.bias"].tensor_map == (0,)       # split like q's output
    assert lays["model.layers.0.self_attn.o_proj.bias"].tensor_map == (-1,)      # after the partial sums
    assert lays["model.layers.0.self_attn.q_norm.weight"].tensor_map == (-1,)
    write_strategy_files(mc, A, str(tmp_path / "strategy"), fmt="json")
    transform_checkpoints(str(tmp_path / "full"), str(tmp_path / "A"), None, str(tmp_path / "strategy"))
    assert_rank_slices(tmp_path / "A", full, mc, A)
    out = transform_checkpoints(str(tmp_path / "A"), str(tmp_path / "back"), str(tmp_path / "strategy"), None)
    assert_equal_full(out[0], full)
    # dp 2 x mp 2 x pp 2 (8 ranks, one decoder layer per stage, vocab-parallel head), from the dp x mp
    # slices straight to the pipeline layout and back to one file
    dmp = ParallelLayoutConfig(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=2,
                               vocab_emb_dp=False)
    write_strategy_files(mc, dmp, str(tmp_path / "strategy_pp"), fmt="json")
    transform_checkpoints(str(tmp_path / "A"), str(tmp_path / "PP"), str(tmp_path / "strategy"),
                          str(tmp_path / "strategy_pp"))
    assert_rank_slices(tmp_path / "PP", full, mc, dmp)
    out = transform_checkpoints(str(tmp_path / "PP"), str(tmp_path / "PP_back"), str(tmp_path / "strategy_pp"), None)
    assert_equal_full(out[0], full)


def test_expert_parallel_layout_reshards_bit_exactly(tmp_path):
    """Mixture of experts with expert_parallel 2 inside data_parallel 2, and model_parallel 2 (4
    ranks, MindFormers' convention: ep divides dp): the fused experts split on E by ep (each expert
    group holds half of them) and inside by mp (the C columns of gate_up and down: both row parallel,
    msllm/parallel/layout_rules.py _moe), the router replicated,
    Qwen2-MoE's shared expert column / row parallel. full -> dp 2 x ep 2 x mp 2 (optimizer shard)
    -> dp 2 x mp 2 (every expert on every rank) -> full through MindSpore's transform_checkpoints,
    every rank's slice as param_layouts predicts."""
    from msllm.models.llama.config import MoeConfig

    mc = preset("tiny", num_layers=2, n_kv_heads=4, model_type="qwen2_moe", qkv_has_bias=True,
                moe_config=MoeConfig(expert_num=4, num_experts_chosen=2, moe_intermediate_size=64,
                                     shared_expert_intermediate_size=96, norm_topk_prob=False))
    ep = ParallelLayoutConfig(data_parallel=2, model_parallel=2, expert_parallel=2, optimizer_shard=True)
    full = save_full_train_checkpoint(mc, str(tmp_path / "full" / "rank_0" / "full.ckpt"), 5)
    lays = param_layouts(mc, ep)
    gu, down = lays["model.layers.0.mlp.experts.gate_up_proj"], lays["model.layers.0.mlp.experts.down_proj"]
    # device matrix (ep, dp/ep, mp) = (2, 1, 2) written as MindSpore writes it, without the 1
    assert gu.dev_matrix == (2, 2) and gu.tensor_map == (1, -1, 0) and down.tensor_map == (1, -1, 0)
    assert gu.slice_shape == (2, 128, 64) and gu.opt_shard_size == 0   # E / ep experts, C / mp columns (no replica)
    # ranks 0, 1 (data-parallel index 0) hold experts 0-1, ranks 2, 3 experts 2-3; mp splits the columns
    w = full["model.layers.0.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(slice_for_rank(w, gu._replace(opt_shard_size=0), 3), w[2:4, :, 64:128])
    assert lays["model.layers.0.mlp.gate.weight"].tensor_map == (-1, -1)
    assert lays["model.layers.0.mlp.shared_expert.gate_proj.weight"].tensor_map == (0, -1)
    write_strategy_files(mc, ep, str(tmp_path / "s_ep"), fmt="json")
    transform_checkpoints(str(tmp_path / "full"), str(tmp_path / "EP"), None, str(tmp_path / "s_ep"))
    assert_rank_slices(tmp_path / "EP", full, mc, ep)
    dm = ParallelLayoutConfig(data_parallel=2, model_parallel=2)
    write_strategy_files(mc, dm, str(tmp_path / "s_dm"), fmt="json")
    transform_checkpoints(str(tmp_path / "EP"), str(tmp_path / "DM"), str(tmp_path / "s_ep"), str(tmp_path / "s_dm"))
    assert_rank_slices(tmp_path / "DM", full, mc, dm)
    out = transform_checkpoints(str(tmp_path / "DM"), str(tmp_path / "back"), str(tmp_path / "s_dm"), None)
    assert_equal_full(out[0], full)
