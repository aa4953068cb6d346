"""The evaluation context (issue #31): for a Hugging Face directory, the same max_length as
lm-evaluation-harness's HFLM takes from it (lm_eval.models.utils.resolve_max_length itself is
the reference), --max_length wins, an msllm checkpoint keeps its seq_length, and a context beyond
the model's positions is refused."""

from __future__ import annotations

import json

import pytest

from msllm.errors import MsllmError
from msllm.eval.runner import context_length
from msllm.models.llama.config import LlamaConfig

MC = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=48,
                 seq_length=256, max_position_embeddings=32768)


def hf_dir(tmp_path, config: dict, tokenizer_config: dict | None = None):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(d)


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "max_position_embeddings": 32768},
    {"model_type": "llama", "max_position_embeddings": 4096},
    {"model_type": "gpt2", "n_positions": 1024, "n_ctx": 2048},
    {"model_type": "llama"},
], ids=["32k", "4k", "n_positions_first", "none_default"])
def test_hf_directory_context_equals_lm_eval(tmp_path, config):
    from lm_eval.models.utils import resolve_max_length
    from transformers import PretrainedConfig

    expected = resolve_max_length(PretrainedConfig(**config), None)
    got, origin = context_length(hf_dir(tmp_path, config), MC)
    assert got == expected and ("HFLM" in origin)


def test_tokenizer_limit_then_default(tmp_path):
    assert context_length(hf_dir(tmp_path, {"model_type": "llama"}, {"model_max_length": 3000}), MC)[0] == 3000
    unset = {"model_max_length": 1000000000000000019884624838656}       # transformers' "unset"
    (tmp_path / "x").mkdir()
    assert context_length(hf_dir(tmp_path / "x", {"model_type": "llama"}, unset), MC)[0] == 2048


def test_flag_wins_and_checkpoints_keep_seq_length(tmp_path):
    d = hf_dir(tmp_path, {"model_type": "llama", "max_position_embeddings": 32768})
    assert context_length(d, MC, 512) == (512, "--max_length")
    assert context_length(str(tmp_path / "model.ckpt"), MC)[0] == 256
    with pytest.raises(MsllmError, match="max_length 40000 .*expected 2..32768"):
        context_length(d, MC, 40000)
