"""One table of names and shapes (msllm/models/llama/names.py): every naming maps back, the shapes
are the real network's and sum to LlamaConfig.num_params, and training and conversion do not
import each other (they share msllm.formats)."""

import math
import subprocess
import sys

import pytest

from msllm.models.llama.config import LlamaConfig, preset
from msllm.models.llama.names import (NAMINGS, PARAM_TABLE, is_optimizer_state, is_trainer_entry,
                                      param_shapes, split_state_prefix, translate_name)

CONFIGS = [LlamaConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=6, n_kv_heads=2, intermediate_size=40),
           LlamaConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, tie_word_embeddings=True),
           preset("7b"), preset("70b")]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["gqa", "tied", "7b", "70b"])
def test_num_params_is_the_sum_of_the_shapes_table(cfg):
    assert cfg.num_params() == sum(math.prod(s) for s in param_shapes(cfg).values())


def test_shapes_are_the_real_networks():
    import mindspore as ms

    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_device("CPU")
    for cfg in CONFIGS[:2]:
        real = {p.name: tuple(p.shape) for p in LlamaForCausalLM(cfg).get_parameters()}
        assert real == param_shapes(cfg)


def test_every_naming_maps_to_every_other_and_back():
    for cfg in CONFIGS[:2]:
        for name in param_shapes(cfg):
            for naming in NAMINGS:
                other = translate_name(name, "msllm", naming)
                assert other is not None and translate_name(other, naming, "msllm") == name
    assert len({row[0] for row in PARAM_TABLE}) == len(PARAM_TABLE)
    assert translate_name("adam_v.model.norm.weight", "msllm", "mindformers", states=True) == \
        "adam_v.model.norm_out.weight"
    assert translate_name("adam_v.model.norm.weight", "msllm", "hf") is None  # weights only
    assert split_state_prefix("adam_m.lm_head.weight") == ("adam_m.", "lm_head.weight")
    assert is_optimizer_state("adam_v.x") and not is_optimizer_state("accu_grads.x")
    assert is_trainer_entry("accu_grads.x") and is_trainer_entry("global_step") and not is_trainer_entry("lm_head.weight")


def test_training_and_conversion_do_not_import_each_other():
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith(sys.argv[2])))")
    for module, forbidden in (("msllm.training.checkpoint", "msllm.convert"),
                              ("msllm.convert.hf", "msllm.training"),
                              ("msllm.parallel.reshard", "msllm.training")):
        out = subprocess.run([sys.executable, "-c", code, module, forbidden], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == "[]", (module, out)
