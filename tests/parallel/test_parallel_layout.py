"""Layout rules: validation errors, stage splits, and that the strategies set on the network
(apply_layout) are the layouts computed without it (param_layouts)."""

import math

import numpy as np
import pytest

from msllm.config import ParallelLayoutConfig, RecomputeConfig, RunConfig, load_config
from msllm.errors import MsllmError
from msllm.models.llama.config import preset
from msllm.models.llama.names import param_shapes
from msllm.parallel.apply import SELECT_RECOMPUTE, _resolve, apply_layout
from msllm.parallel.context import parallel_context_kwargs
from msllm.parallel.layout_checks import (global_batch_size, layer_stages, stage_layer_counts, validate_layout,
                                          validate_run_layout)
from msllm.parallel.layout_rules import cell_stages, concrete
from msllm.parallel.param_layout import DEFAULT_OPT_THRESHOLD_KB, param_layouts, slice_for_rank


def pc(**kw):
    return ParallelLayoutConfig(**kw)


@pytest.mark.parametrize("kw, model_kw, key", [
    (dict(model_parallel=3), {}, "num_heads=4"),                                   # heads
    (dict(model_parallel=4), {}, "n_kv_heads=2"),                                  # GQA kv heads
    (dict(model_parallel=2), dict(intermediate_size=351), "intermediate_size"),    # ffn
    (dict(model_parallel=2, vocab_emb_dp=False), dict(vocab_size=31999), "vocab_size=31999"),
    (dict(pipeline_stage=5, micro_batch_num=8), {}, "pipeline_stage=5 exceeds"),
    (dict(pipeline_stage=2, micro_batch_num=1), {}, "micro_batch_num=1"),
    (dict(pipeline_stage=2, micro_batch_num=2), dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(model_parallel=2, use_seq_parallel=True), dict(seq_length=255), "use_seq_parallel"),
    (dict(data_parallel=0), {}, "parallel_config.data_parallel must be >= 1"),
])
def test_invalid_layouts_raise_one_error_naming_the_key(kw, model_kw, key):
    mc = preset("tiny", **model_kw)
    with pytest.raises(MsllmError, match=key.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(mc, pc(**kw))


def test_device_count_and_global_batch_are_checked():
    mc = preset("tiny")
    with pytest.raises(MsllmError, match=r"2 x 2 x 1 = 4, but the device count is 8"):
        validate_layout(mc, pc(data_parallel=2, model_parallel=2), device_num=8)
    with pytest.raises(MsllmError, match=r"global batch size 6 is not divisible by .* 2 x 2"):
        validate_layout(mc, pc(data_parallel=2, pipeline_stage=2, micro_batch_num=2), global_batch_size=6)
    assert validate_layout(mc, pc(data_parallel=2, model_parallel=2), device_num=4, global_batch_size=8) == [4]


def test_run_level_rules():
    cfg = load_config("configs/llama/run_llama_tiny.yaml", ["--parallel_config.model_parallel=2"])
    with pytest.raises(MsllmError, match="need parallel.parallel_mode: 1"):
        validate_run_layout(cfg)
    cfg = load_config("configs/llama/run_llama_7b.yaml", ["--parallel.enable_parallel_optimizer=False"])
    with pytest.raises(MsllmError, match="optimizer_shard=True disagrees with parallel.enable_parallel_optimizer"):
        validate_run_layout(cfg)
    # MoE's capacity dispatch under operator sharding: MindSpore's dry-run rejects it (docs/dryrun.md)
    sharded_moe = ["--parallel.parallel_mode=1", "--parallel.full_batch=True", "--parallel_config.data_parallel=2",
                   "--parallel_config.expert_parallel=2"]
    moe = "--model.model_config.moe_config={expert_num: 4, num_experts_chosen: 2%s}"
    with pytest.raises(MsllmError, match=r"moe_config.capacity_factor=1.0 with parallel.parallel_mode semi_auto"):
        validate_run_layout(load_config("configs/llama/run_llama_tiny.yaml", [*sharded_moe, moe % ", capacity_factor: 1.0"]))
    assert validate_run_layout(load_config("configs/llama/run_llama_tiny.yaml", [*sharded_moe, moe % ""])) == [4]
    cfg70 = load_config("configs/llama/run_llama_70b.yaml")
    assert validate_run_layout(cfg70, device_num=64) == [20, 20, 20, 20]
    assert global_batch_size(cfg70) == 1 * 2 * 16 * 1     # MindFormers: bs x dp x micro x accum


def test_stage_splits_even_uneven_and_explicit():
    assert stage_layer_counts(80, 4) == [20, 20, 20, 20]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]       # extra layers to the middle stages
    assert stage_layer_counts(5, 2) == [2, 3]
    assert stage_layer_counts(10, 4, [1, 4, 4, 1]) == [1, 4, 4, 1]
    assert layer_stages(4, 2, [1, 3]) == [0, 1, 1, 1]
    with pytest.raises(MsllmError, match="sums to 9"):
        stage_layer_counts(10, 4, [1, 4, 3, 1])
    with pytest.raises(MsllmError, match="has 3 entries"):
        stage_layer_counts(10, 4, [4, 4, 2])
    with pytest.raises(MsllmError, match="at least one layer"):
        stage_layer_counts(10, 2, [10, 0])


def test_param_shapes_match_the_real_network():
    import mindspore as ms

    ms.set_device("CPU")
    from msllm.models.llama.model import LlamaForCausalLM

    for mc in (preset("tiny"), preset("tiny", tie_word_embeddings=True, num_layers=2)):
        net = LlamaForCausalLM(mc)
        real = {p.name: tuple(p.shape) for p in net.get_parameters()}
        assert real == param_shapes(mc)


def test_megatron_pattern_of_param_layouts():
    mc = preset("tiny")
    lay = param_layouts(mc, pc(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=2,
                                 vocab_emb_dp=False))
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert q.dev_matrix == (2, 2) and q.tensor_map == (0, -1) and q.stage == 0      # column: split out
    assert lay["model.layers.3.mlp.down_proj.weight"].tensor_map == (-1, 0)          # row: split in
    assert lay["model.layers.3.mlp.down_proj.weight"].stage == 1
    assert lay["model.layers.1.input_layernorm.weight"].tensor_map == (-1,)          # replicated
    assert lay["model.embed_tokens.embedding_table"].tensor_map == (0, -1)           # vocab-parallel
    assert lay["lm_head.weight"].tensor_map == (0, -1) and lay["lm_head.weight"].stage == 1
    assert lay["model.norm.weight"].stage == 1
    assert lay["adam_m.lm_head.weight"] == lay["lm_head.weight"] == lay["adam_v.lm_head.weight"]
    dp_only = param_layouts(mc, pc(data_parallel=2, model_parallel=2))
    assert dp_only["model.embed_tokens.embedding_table"].tensor_map == (-1, -1)      # vocab_emb_dp


def test_optimizer_shard_follows_mindspore_rules():
    mc = preset("tiny")  # q (128,128) fp32 = 64 KB: at the threshold; k (64,128) = 32 KB: below
    lay = param_layouts(mc, pc(data_parallel=2, model_parallel=2, optimizer_shard=True))
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert (q.opt_shard_size, q.opt_shard_step) == (2, 2)            # group: ranks {m, m + mp}
    assert q.slice_shape == (32, 128)                                 # 128 / mp 2 / dp 2
    assert lay["model.layers.0.self_attn.k_proj.weight"].opt_shard_size == 0
    assert lay["model.layers.0.input_layernorm.weight"].opt_shard_size == 0
    emb = lay["model.embed_tokens.embedding_table"]                   # replicated on all 4 ranks
    assert (emb.opt_shard_size, emb.opt_shard_step, emb.slice_shape) == (4, 1, (8000, 128))
    none = param_layouts(mc, pc(data_parallel=1, model_parallel=2, optimizer_shard=True))
    assert none["model.layers.0.self_attn.q_proj.weight"].opt_shard_size == 0    # nothing repeated


def test_slice_for_rank_tiles_the_tensor():
    mc = preset("tiny")
    lay = param_layouts(mc, pc(data_parallel=2, model_parallel=2, optimizer_shard=True))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.embed_tokens.embedding_table"):
        full = np.arange(math.prod(lay[name].full_shape), dtype=np.float32).reshape(lay[name].full_shape)
        parts = [slice_for_rank(full, lay[name], r) for r in range(4)]
        assert all(p.shape == lay[name].slice_shape for p in parts)
        seen = np.concatenate([p.ravel() for p in parts])
        assert np.array_equal(np.sort(seen), full.ravel())            # disjoint and complete


@pytest.fixture(scope="module")
def sharded_net():
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    from msllm.models.llama.model import LlamaForCausalLM

    mc = preset("tiny", num_layers=4)
    ms.set_seed(3)
    net = LlamaForCausalLM(mc)
    ids = ms.Tensor(np.random.default_rng(0).integers(0, mc.vocab_size, (2, 16)), ms.int32)
    before = net(ids).asnumpy()
    layout = pc(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=2, vocab_emb_dp=False,
                optimizer_shard=True)
    rules = apply_layout(net, layout, RecomputeConfig(recompute=True), stage_layers=[1, 3])
    return net, mc, layout, rules, ids, before


def assert_strategies_imply_param_layouts(net, rules, lays):
    """Every rule's strategy is set on its primitive (dp 2, mp 2), each parameter input's strategy
    is the one its layout implies, and every parameter of the network is covered."""
    checked = set()
    for rule in rules:
        prim = getattr(_resolve(net, rule.path), rule.prim)
        assert prim.in_strategy == concrete(rule.in_strategy, 2, 2), rule.name
        for idx, name in rule.params:
            lay = lays[name]
            implied = tuple(1 if m == -1 else lay.dev_matrix[len(lay.dev_matrix) - 1 - m] for m in lay.tensor_map)
            assert prim.in_strategy[idx] == implied, name
            checked.add(name)
    assert checked == {p.name for p in net.get_parameters()}


def test_apply_layout_sets_exactly_the_param_layouts(sharded_net):
    net, mc, layout, rules, _, _ = sharded_net
    assert_strategies_imply_param_layouts(net, rules, param_layouts(mc, layout, stage_layers=[1, 3]))
    # the Megatron pattern in MindSpore numbers (dp 2, mp 2)
    assert net.model.layers[0].self_attn.q_proj.matmul.in_strategy == ((2, 1), (2, 1))
    assert net.model.layers[0].self_attn.o_proj.matmul.in_strategy == ((2, 2), (1, 2))
    assert net.model.layers[0].self_attn.softmax.in_strategy == ((2, 2, 1, 1),)
    assert net.model.embed_tokens.gather.in_strategy == ((2, 1), (2,))
    assert net.lm_head.matmul.in_strategy == ((2, 1), (2, 1))


def test_apply_layout_sets_stages_recompute_and_norm_flags(sharded_net):
    net, mc, layout, _, _, _ = sharded_net
    assert net.model.embed_tokens.pipeline_stage == 0
    assert [net.model.layers[i].pipeline_stage for i in range(4)] == [0, 1, 1, 1]
    assert net.model.norm.pipeline_stage == 1 and net.lm_head.pipeline_stage == 1 and net.loss.pipeline_stage == 1
    lays = param_layouts(mc, layout, stage_layers=[1, 3])
    for path, stage in cell_stages(mc, layout, [1, 3]).items():
        for p in _resolve(net, path).get_parameters():
            assert lays[p.name].stage == stage
    norms = [p for p in net.get_parameters() if "norm" in p.name]
    assert norms and all(p.parallel_optimizer is False for p in norms)
    assert net.model.layers[0].self_attn.q_proj.weight.parallel_optimizer is True


def test_stand_alone_network_still_runs_the_same(sharded_net):
    net, _, _, _, ids, before = sharded_net
    after = net(ids).asnumpy()        # strategies are ignored outside (semi-)auto parallel
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_select_recompute_marks_the_attention_core_and_swiglu_ops():
    import mindspore as ms

    ms.set_device("CPU")
    from msllm.models.llama.model import LlamaForCausalLM

    net = LlamaForCausalLM(preset("tiny", num_layers=1))
    apply_layout(net, pc(), RecomputeConfig(select_recompute=True))
    attn, mlp = net.model.layers[0].self_attn, net.model.layers[0].mlp
    assert all(getattr(attn, p).attrs.get("recompute") for p in SELECT_RECOMPUTE["self_attn"])
    assert all(getattr(mlp, p).attrs.get("recompute") for p in SELECT_RECOMPUTE["mlp"])
    assert not attn.q_proj.matmul.attrs.get("recompute")


def test_parallel_context_kwargs_are_accepted_by_mindspore():
    import mindspore as ms

    for name in ("7b", "13b", "70b", "tiny"):
        cfg = load_config(f"configs/llama/run_llama_{name}.yaml", ["--output_dir=/tmp/msllm_out"])
        kw = parallel_context_kwargs(cfg, rank=5)
        assert kw["device_num"] == cfg.parallel_config.device_num
        try:
            ms.set_auto_parallel_context(**kw)
            for key, value in kw.items():
                if key not in ("parallel_optimizer_config", "pipeline_config"):   # not readable back in 2.10
                    got = ms.get_auto_parallel_context(key)
                    assert got == value or (isinstance(value, dict) and value.items() <= got.items()), key
        finally:
            ms.reset_auto_parallel_context()
    kw = parallel_context_kwargs(load_config("configs/llama/run_llama_70b.yaml"), rank=63)
    assert kw["parallel_mode"] == "semi_auto_parallel" and kw["pipeline_stages"] == 4
    assert kw["strategy_ckpt_config"]["save_file"].endswith("strategy/ckpt_strategy_rank_63.ckpt")
    assert kw["strategy_ckpt_config"]["only_trainable_params"] is False
    assert kw["parallel_optimizer_config"]["parallel_optimizer_threshold"] == DEFAULT_OPT_THRESHOLD_KB
    assert parallel_context_kwargs(load_config("configs/llama/run_llama_tiny.yaml")) == {
        "parallel_mode": "data_parallel", "device_num": 2, "gradients_mean": True}


def test_run_config_default_is_valid():
    assert validate_run_layout(RunConfig()) == [32]


FAMILY = dict(num_layers=2, qkv_has_bias=True, attention_bias=True, qk_norm=True, rms_norm_offset=1.0,
              hidden_act="gelu_pytorch_tanh", embedding_multiplier=2.0, sliding_window=8, head_dim=48)


def test_family_switches_param_shapes_and_layouts():
    """Every switch of the family at once: the one table of shapes is the network's, and
    apply_layout's strategies imply exactly param_layouts' layouts for every parameter (biases,
    q/k norms, Gemma's offset norms included)."""
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    from msllm.models.llama.model import LlamaForCausalLM

    mc = preset("tiny", **FAMILY)
    net = LlamaForCausalLM(mc)
    assert {p.name: tuple(p.shape) for p in net.get_parameters()} == param_shapes(mc)
    assert param_shapes(mc)["model.layers.0.self_attn.q_proj.weight"] == (4 * 48, 128)   # H * D != C
    layout = pc(data_parallel=2, model_parallel=2)
    rules = apply_layout(net, layout, RecomputeConfig())
    assert_strategies_imply_param_layouts(net, rules, param_layouts(mc, layout))
    attn = net.model.layers[0].self_attn
    assert attn.q_proj.add_bias.in_strategy == ((2, 2), (2,))       # column-parallel: bias split by mp
    assert attn.o_proj.add_bias.in_strategy == ((2, 1), (1,))       # row-parallel: whole bias once
    assert attn.q_norm.mul_weight.in_strategy == ((2, 1, 2, 1), (1,))
    assert net.model.layers[0].mlp.gelu.in_strategy == ((2, 2),)


def test_packed_rows_are_refused_only_with_flash_attention_under_a_layout():
    """Packed rows under operator sharding: the composed attention takes them (compiled by the dry-run,
    tests/cluster/test_dryrun.py); MindSpore's FlashAttentionScore in its TND form is refused."""
    from msllm.parallel.layout_checks import check_packed_layout

    sharded = ["--parallel.parallel_mode=1", "--parallel.full_batch=True", "--parallel_config.model_parallel=2"]
    check_packed_layout(load_config("configs/llama/run_llama_tiny.yaml", sharded), "packed.mindrecord")
    flash = load_config("configs/llama/run_llama_tiny.yaml", [*sharded, "--model.model_config.use_flash_attention=True",
                                                              "--model.model_config.compute_dtype=float16"])
    with pytest.raises(MsllmError, match=r"'packed.mindrecord' holds packed rows \(actual_seq_len\) and "
                                         r"model.model_config.use_flash_attention is True"):
        check_packed_layout(flash, "packed.mindrecord")
    # data parallel: each rank's rows and their ends are its own (msllm rebases them), so flash takes them
    check_packed_layout(load_config("configs/llama/run_llama_tiny.yaml", ["--model.model_config.use_flash_attention=True",
                                                                          "--model.model_config.compute_dtype=float16"]),
                        "packed.mindrecord")
