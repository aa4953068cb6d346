"""Hugging Face <-> msllm LLaMA weights: the public entry points, gathered from the modules that
do each job (this file holds no logic):

* names and shapes: :mod:`msllm.models.llama.names` (the one table, msllm <-> HF <-> Meta <->
  MindFormers);
* configs: :mod:`msllm.convert.configs` (HF ``config.json`` / Meta ``params.json`` <-> ``LlamaConfig``);
* reading an HF or Meta directory: :mod:`msllm.convert.sources` (``open_hf_source``);
* the conversions in both directions: :mod:`msllm.convert.driver`;
* file formats (MindSpore ``.ckpt``, safetensors, torch, dtypes): :mod:`msllm.formats`.

``open_hf_source(hf_dir)`` returns an :class:`HFSource` whose ``.config`` is the
:class:`LlamaConfig` and whose ``.params`` are ``{msllm name: TensorRef}`` (``.load()`` -> numpy
storage array in HF layout); close it with ``.close()``.
"""

from __future__ import annotations

from msllm.convert.configs import (YAML_KEYS, hf_config_to_msllm, meta_params_to_msllm, model_config_yaml,
                                   msllm_config_to_hf)
from msllm.convert.driver import (ConversionResult, convert_hf_to_msllm, convert_msllm_to_hf, msllm_model_config,
                                  msllm_weights, parse_size, plan_shards, read_hf_tensors, read_msllm_tensors)
from msllm.convert.sources import HFSource, open_hf_source, permute_hf_to_meta, permute_meta_to_hf
from msllm.formats.dtypes import (DTYPE_ALIASES, FLOAT_DTYPES, TensorRef, bf16_bits_to_f32, cast,
                                  f32_to_bf16_bits, normalize_dtype, tensor_nbytes, to_float32)
from msllm.formats.mindspore_ckpt import CKPT_CHUNK, CkptEntry, CkptWriter, scan_checkpoint, scan_ckpt
from msllm.formats.safetensors import SafetensorsWriter, read_safetensors_header
from msllm.models.llama.names import (PARAM_TABLE, TRAINER_ENTRIES, TRAINER_PREFIXES, hf_to_msllm_name,
                                      is_trainer_entry, layer_index, msllm_to_hf_name, param_shapes,
                                      translate_name)

scan_msllm_checkpoint = scan_checkpoint  # the name this module used before msllm.formats

__all__ = ["PARAM_TABLE", "TRAINER_ENTRIES", "TRAINER_PREFIXES", "translate_name", "hf_to_msllm_name",
           "msllm_to_hf_name", "layer_index", "is_trainer_entry", "param_shapes", "permute_meta_to_hf",
           "permute_hf_to_meta", "hf_config_to_msllm", "msllm_config_to_hf", "meta_params_to_msllm",
           "model_config_yaml", "YAML_KEYS", "HFSource", "open_hf_source", "ConversionResult",
           "convert_hf_to_msllm", "convert_msllm_to_hf", "msllm_model_config", "msllm_weights", "parse_size",
           "plan_shards", "read_hf_tensors", "read_msllm_tensors", "CkptWriter", "CkptEntry", "CKPT_CHUNK",
           "scan_ckpt", "scan_checkpoint", "scan_msllm_checkpoint", "SafetensorsWriter",
           "read_safetensors_header", "TensorRef", "DTYPE_ALIASES", "FLOAT_DTYPES", "normalize_dtype", "cast",
           "to_float32", "tensor_nbytes", "f32_to_bf16_bits", "bf16_bits_to_f32"]
