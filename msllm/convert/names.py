"""Old import path of the MindFormers renaming (kept for callers outside msllm.convert); the code
is in :mod:`msllm.formats.mindformers`, the name table in :mod:`msllm.models.llama.names`."""

from msllm.formats.mindformers import msllm_name_map, to_msllm_names

__all__ = ["to_msllm_names", "msllm_name_map"]
