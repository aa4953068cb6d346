"""Parallel layouts of the adapters (checked offline, as for the base): A and B follow their base
layer's Megatron split (column-parallel base: B split by rows; row-parallel base: A split by
columns); strategy files carry them; MindSpore's transform_checkpoints reshards an adapter
checkpoint with them; and the tensor-parallel LoRA update computed from each rank's shards
(concatenated / summed as the collectives would) equals the unsharded update."""

import os
import dataclasses

import numpy as np
import pytest

from lora_helpers import SEED, tiny_config
from msllm.config import ParallelLayoutConfig
from msllm.errors import MsllmError
from msllm.lora.layout import lora_op_rules, lora_param_layouts
from msllm.lora.targets import adapter_names, linear_modules
from msllm.config_lora import PetConfig
from msllm.parallel.param_layout import param_layouts

PET = PetConfig(lora_rank=4, lora_alpha=8, target_modules=".*")  # every linear layer and the head
LAYOUT = ParallelLayoutConfig(data_parallel=2, model_parallel=2, optimizer_shard=False, vocab_emb_dp=False)


def test_adapters_follow_the_megatron_split_of_their_base():
    cfg = tiny_config()
    lays = lora_param_layouts(cfg, PET, LAYOUT)
    base = param_layouts(cfg, LAYOUT)
    for module in linear_modules(cfg):
        a, b = adapter_names(module)
        w = base[f"{module}.weight"].tensor_map
        assert lays[a].tensor_map == (-1, w[1]) and lays[b].tensor_map == (w[0], -1), module
        assert lays[f"adam_m.{a}"] == lays[a] and lays[f"adam_v.{b}"] == lays[b]
        assert lays[a].dtype == "float32" and lays[a].stage == base[f"{module}.weight"].stage
    # column-parallel: B split by rows (mp = tensor-map axis 0), A replicated
    assert lays["model.layers.0.self_attn.q_proj.lora_B.weight"].tensor_map == (0, -1)
    assert lays["model.layers.0.self_attn.q_proj.lora_A.weight"].tensor_map == (-1, -1)
    assert lays["model.layers.1.mlp.up_proj.lora_B.weight"].slice_shape == (48, 4)
    # row-parallel: A split by columns, B replicated
    assert lays["model.layers.0.self_attn.o_proj.lora_A.weight"].tensor_map == (-1, 0)
    assert lays["model.layers.1.mlp.down_proj.lora_A.weight"].slice_shape == (4, 48)
    assert lays["model.layers.1.mlp.down_proj.lora_B.weight"].tensor_map == (-1, -1)
    # vocab-parallel head: column-parallel over the vocabulary
    assert lays["lm_head.lora_B.weight"].slice_shape == (16000, 4)
    # the primitive strategies: x (dp, in split) x A; (N, r) x B (out split)
    rules = {r.name: r for r in lora_op_rules(cfg, PET, LAYOUT)}
    assert rules["model.layers.0.self_attn.o_proj.lora_a_matmul"].in_strategy == (("dp", "mp"), (None, "mp"))
    assert rules["model.layers.0.self_attn.q_proj.lora_b_matmul"].in_strategy == (("dp", None), ("mp", None))
    assert "model.layers.0.self_attn.q_proj.lora_dropout.dropout" not in rules  # lora_dropout 0: no op
    drop = dataclasses.replace(PET, lora_dropout=0.1)
    assert "model.layers.0.self_attn.q_proj.lora_dropout.dropout" in {r.name for r in lora_op_rules(cfg, drop, LAYOUT)}
    assert lora_param_layouts(cfg, None, LAYOUT) == {}


def test_optimizer_shard_applies_to_adapters_like_to_base_weights():
    shard = dataclasses.replace(LAYOUT, optimizer_shard=True)
    lays = lora_param_layouts(tiny_config(), PetConfig(lora_rank=64, target_modules="lm_head"), shard,
                              opt_threshold_kb=64)
    # B (32000, 64) fp32 = 8 MB, split on rows by mp then over the 2 data-parallel ranks
    assert lays["lm_head.lora_B.weight"].opt_shard_size == 2
    assert lays["lm_head.lora_B.weight"].slice_shape == (8000, 64)
    assert lays["lm_head.lora_A.weight"].opt_shard_size == 0  # 32 KB: below the 64 KB threshold


def test_apply_lora_layout_shards_the_lora_primitives():
    import mindspore as ms

    from msllm.lora.apply import apply_lora
    from msllm.lora.layout import apply_lora_layout
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.parallel.apply import apply_layout

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = LlamaForCausalLM(tiny_config())  # the model config holds no LoRA settings; apply_lora takes them
    with pytest.raises(MsllmError, match="no LoRA adapters"):
        apply_lora_layout(net, LAYOUT)
    apply_lora(net, dataclasses.replace(PET, lora_dropout=0.1))  # and records them as net.lora_info
    apply_layout(net, LAYOUT)  # the base rules still find their weights in the LoRA cells
    rules = apply_lora_layout(net, LAYOUT)
    assert len(rules) == 15 * 5
    o = net.model.layers[0].self_attn.o_proj
    assert o.lora_a_matmul.in_strategy == ((2, 2), (1, 2)) and o.lora_b_matmul.in_strategy == ((2, 1), (1, 1))
    q = net.model.layers[0].self_attn.q_proj
    assert q.matmul.in_strategy == ((2, 1), (2, 1)) and q.lora_b_matmul.in_strategy == ((2, 1), (2, 1))
    assert q.lora_dropout.dropout.in_strategy == ((2, 1),)


def test_resharded_adapters_compute_the_unsharded_update(tmp_path):
    import mindspore as ms

    from msllm.parallel.reshard import transform_checkpoints
    from msllm.parallel.reshard_inputs import collect_rank_checkpoints
    from msllm.parallel.strategy import write_strategy_files

    print("seed", SEED)
    cfg = tiny_config(vocab_size=512)
    rng = np.random.default_rng(SEED)
    lin = linear_modules(cfg)
    full = {}
    for module, (out_f, in_f) in lin.items():
        a, b = adapter_names(module)
        full[a] = rng.standard_normal((4, in_f)).astype(np.float32)
        full[b] = rng.standard_normal((out_f, 4)).astype(np.float32)
    # the full state of a LoRA model: base weights and adapters
    from msllm.lora.apply import apply_lora
    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = LlamaForCausalLM(cfg)
    apply_lora(net, PET)
    for p in net.get_parameters():
        if p.name in full:
            p.set_data(ms.Tensor(full[p.name]))
    (tmp_path / "full" / "rank_0").mkdir(parents=True)
    ms.save_checkpoint(net, str(tmp_path / "full" / "rank_0" / "lora.ckpt"))
    layouts = {**param_layouts(cfg, LAYOUT), **lora_param_layouts(cfg, PET, LAYOUT)}
    write_strategy_files(cfg, LAYOUT, str(tmp_path / "strategy"), layouts=layouts)
    transform_checkpoints(str(tmp_path / "full"), str(tmp_path / "sharded"), None, str(tmp_path / "strategy"))
    shards = {r: {k: v.asnumpy().astype(np.float64) for k, v in ms.load_checkpoint(p).items()}
              for r, p in collect_rank_checkpoints(str(tmp_path / "sharded")).items()}
    assert sorted(shards) == [0, 1, 2, 3]
    mp = LAYOUT.model_parallel
    for module, (out_f, in_f) in lin.items():
        a, b = adapter_names(module)
        x = rng.standard_normal((6, in_f))
        want = (x @ full[a].T.astype(np.float64)) @ full[b].T.astype(np.float64)
        row_parallel = layouts[a].tensor_map[1] == 0
        parts = []
        for m in range(mp):  # data-parallel rank 0's model-parallel group: ranks 0, 1
            s = shards[m]
            if row_parallel:  # x split by columns like A; (N, r) partial sums all-reduced, then B
                cols = slice(m * in_f // mp, (m + 1) * in_f // mp)
                parts.append(x[:, cols] @ s[a].T)
            else:  # A replicated, B's rows: rank m's slice of the output
                parts.append((x @ s[a].T) @ s[b].T)
        got = (sum(parts) @ shards[0][b].T) if row_parallel else np.concatenate(parts, axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=module)
        # data-parallel peers hold the same slices
        for k in (a, b):
            np.testing.assert_array_equal(shards[0][k], shards[2][k])


def test_only_save_strategy_writes_the_adapters_layouts(tmp_path):
    """``run_msllm.py --only_save_strategy True`` with a pet_config: the strategy files carry the
    adapters, split like their base layers (column-parallel q: B by rows; row-parallel o: A by
    columns), as the issue's Megatron rule says."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, os.path.join(root, "run_msllm.py"), "--config",
                        os.path.join(root, "configs", "llama", "run_llama_13b.yaml"), "--only_save_strategy", "True",
                        f"--output_dir={tmp_path}", "--model.model_config.pet_config={lora_rank: 8}",
                        "--parallel_config.data_parallel=1", "--parallel_config.model_parallel=2",
                        "--parallel.strategy_ckpt_save_file=x.json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "strategy" / "ckpt_strategy_rank_1.json") as fh:
        items = json.load(fh)["parallel_layout_item"]
    q, o = "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.o_proj"
    assert items[f"{q}.lora_B.weight"]["tensor_map"] == [0, -1] and items[f"{q}.lora_A.weight"]["tensor_map"] == [-1, -1]
    assert items[f"{o}.lora_A.weight"]["tensor_map"] == [-1, 0] and items[f"{o}.lora_B.weight"]["tensor_map"] == [-1, -1]
    assert f"adam_m.{q}.lora_B.weight" in items and f"{q}.weight" in items  # moments, and the base beside
