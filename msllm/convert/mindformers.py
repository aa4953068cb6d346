"""Old import path of MindFormers LLaMA names (kept for callers outside msllm.convert). The table
is :data:`msllm.models.llama.names.PARAM_TABLE` (MindFormers column); the ``qkv_concat`` row
layout and the renaming of whole checkpoints are in :mod:`msllm.formats.mindformers`."""

from msllm.formats.mindformers import (fuse_gate_up, fuse_qkv, split_gate_up, split_qkv,
                                       to_mindformers_params)
from msllm.models.llama.names import (GATE_HIDDEN_CONCAT, OPTIMIZER_STATE_PREFIXES, QKV_CONCAT, is_mindformers_name,
                                      mindformers_to_msllm_name, msllm_to_mindformers_name)

STATE_PREFIXES = OPTIMIZER_STATE_PREFIXES

__all__ = ["QKV_CONCAT", "GATE_HIDDEN_CONCAT", "STATE_PREFIXES", "mindformers_to_msllm_name",
           "msllm_to_mindformers_name", "is_mindformers_name", "fuse_qkv", "split_qkv", "fuse_gate_up",
           "split_gate_up", "to_mindformers_params"]
