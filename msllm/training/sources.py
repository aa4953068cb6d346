"""Where a training run's starting weights come from, when that is a Hugging Face directory, and
whether its data were tokenized for it.

``load_checkpoint: HF_DIR`` (``train`` / ``finetune``, full or LoRA): the model is the one the
directory's ``config.json`` describes (:func:`msllm.models.llama.config.merge_run_config`: its shape
and numerics; the YAML's ``model.model_config`` supplies only what ``config.json`` lacks:
``seq_length``, dtypes, kernels (LoRA's ``pet_config`` is a section of its own); a YAML value that
``config.json`` overrides is named in one start-up line), and its tensors are mapped to msllm's
names by the one conversion table (:func:`msllm.convert.starting.load_base_into`, tied embeddings included).

The data check (:func:`check_data_tokenizer`): a MindRecord's sidecar records the MD5 of the
tokenizer file that built it; a run whose starting weights bring a tokenizer of their own (an HF
directory's ``tokenizer.json`` / ``tokenizer.model``) refuses data built with another one, before
any step: the ids would mean other tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from msllm.errors import MsllmError

log = logging.getLogger("msllm")


def hf_start_dir(cfg) -> Optional[str]:
    """``cfg.load_checkpoint`` when it is a Hugging Face model directory (``config.json``), else None."""
    from msllm.convert.starting import is_hf_dir

    path = cfg.load_checkpoint
    return path if path and is_hf_dir(path) and os.path.isfile(os.path.join(path, "config.json")) else None


def adopt_hf_model_config(cfg):
    """``cfg`` with ``model.model_config`` taken from ``load_checkpoint``'s ``config.json`` (module
    doc) when that is an HF directory, else ``cfg`` unchanged.

    Raises MsllmError: a malformed or unsupported ``config.json`` (naming the key)."""
    hf_dir = hf_start_dir(cfg)
    if hf_dir is None:
        return cfg
    from msllm.convert.starting import open_base
    from msllm.models.llama.config import merge_run_config

    path = os.path.join(hf_dir, "config.json")
    src = open_base(hf_dir)   # config.json read and checked by the conversion code; tensors stay on disk
    src.close()
    merged, conflicts = merge_run_config(src.config, cfg.model_config)
    log.info("model: from %s (%d layers, hidden %d, heads %d/%d kv, vocab %d); seq_length %d from the run YAML",
             path, merged.num_layers, merged.hidden_size, merged.num_heads, merged.kv_heads, merged.vocab_size,
             merged.seq_length)
    if conflicts:
        log.info("model.model_config: these YAML values have no effect (%s decides the model): %s", path,
                 "; ".join(conflicts))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model_config=merged))


def start_tokenizer_md5(cfg) -> Optional[tuple[str, str]]:
    """``(file, md5)`` of the tokenizer the starting weights bring (an HF directory's), else None."""
    from msllm.fileio import file_digest

    hf_dir = hf_start_dir(cfg)
    if hf_dir is None:
        return None
    for name in ("tokenizer.json", "tokenizer.model"):   # the one load_tokenizer would pick
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            return path, file_digest(path, "md5")
    return None


def check_data_tokenizer(cfg, meta: dict, data_file: str) -> None:
    """MsllmError when the MindRecord ``data_file`` (sidecar ``meta``) was tokenized with another
    tokenizer than the starting weights' own (module doc), or holds ids beyond the model's
    vocabulary per its sidecar's ``vocab_size``."""
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and vocab > cfg.model_config.vocab_size:
        raise MsllmError(f"{data_file} was tokenized with a {vocab}-id tokenizer ({meta.get('tokenizer_file')}), "
                         f"but the model has vocab_size {cfg.model_config.vocab_size}: preprocess the data with "
                         "the model's tokenizer (--model_file)")
    own = start_tokenizer_md5(cfg)
    recorded = meta.get("tokenizer_md5")
    if own is None or not recorded:
        return
    if recorded != own[1]:
        raise MsllmError(f"{data_file} was tokenized with {meta.get('tokenizer_file')} (MD5 {recorded}), not with "
                         f"the tokenizer of {cfg.load_checkpoint} ({own[0]}, MD5 {own[1]}): preprocess the data "
                         f"with --model_file {cfg.load_checkpoint}")
