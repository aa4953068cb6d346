"""The tokenizer written beside the weights when an msllm checkpoint becomes an HF directory
(``tools/convert_weight.py --reversed``), so the result loads with ``AutoTokenizer`` as well as
``AutoModelForCausalLM`` and its ``config.json`` / ``generation_config.json`` carry the
tokenizer's BOS / EOS / pad ids rather than the run YAML's defaults.

Which tokenizer: ``--tokenizer`` (a ``tokenizer.model``, a ``tokenizer.json`` or an HF model
directory), else the one the checkpoint's manifest records (``"tokenizer": {"file", "md5"}``,
written by the trainer from the MindRecord sidecar) when that file still exists with the same
MD5. Files copied as they are (the names transformers reads, ``PreTrainedTokenizerBase.from_pretrained``
in transformers 5.x): ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``added_tokens.json``, ``chat_template.jinja``, ``tokenizer.model``; a bare SentencePiece model gets
the ``tokenizer_config.json`` of a LLaMA-2 HF directory (``LlamaTokenizer``, ``add_bos_token``), without
which ``AutoTokenizer`` would add no BOS.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Optional

from msllm.fileio import write_json_atomic

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "tokenizer.model")


def recorded_tokenizer(manifest: Optional[dict]) -> Optional[str]:
    """The tokenizer file a checkpoint manifest records, if it still exists with the recorded MD5."""
    rec = (manifest or {}).get("tokenizer")
    path, md5 = (rec.get("file"), rec.get("md5")) if isinstance(rec, dict) else (rec, None)
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    from msllm.data.tokenizer import file_md5

    # the recorded file is the tokenizer's own (``tokenizer.model_file``), whose MD5 ``md5()`` gives:
    # hash it without loading it, which export_tokenizer does once
    return path if md5 is None or file_md5(path) == md5 else None


def tokenizer_files(source: str) -> list[str]:
    """Paths of the tokenizer files to copy for ``source`` (a ``.model`` file: that file alone)."""
    if os.path.isfile(source) and not source.endswith(".json"):
        return [source]
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    return [os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]


def export_tokenizer(source: str, out_dir: str, cfg):
    """Copy the tokenizer ``source`` into ``out_dir`` and return ``(cfg, note)``: ``cfg`` with its
    ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` replaced by the tokenizer's (where it
    defines them), and a one-line note of what was written and changed.

    Raises:
        MsllmError: ``source`` is not a tokenizer (:func:`msllm.data.tokenizer.load_tokenizer`), or has
            more ids than the model's vocab_size (:func:`msllm.data.tokenizer.check_vocab`).
    """
    from msllm.data.tokenizer import check_vocab, load_tokenizer

    tok = load_tokenizer(source)
    check_vocab(tok, cfg.vocab_size, "the checkpoint being converted")
    copied = []
    for path in tokenizer_files(source):
        name = "tokenizer.model" if path.endswith(".model") else os.path.basename(path)
        shutil.copyfile(path, os.path.join(out_dir, name))
        copied.append(name)
    if "tokenizer_config.json" not in copied and tok.kind == "sentencepiece":
        # a bare SentencePiece model: without this file AutoTokenizer adds no BOS; the keys of
        # meta-llama/Llama-2-7b-hf's tokenizer_config.json
        write_json_atomic(os.path.join(out_dir, "tokenizer_config.json"), {
            "tokenizer_class": "LlamaTokenizer", "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos),
            "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None, "legacy": False,
            "clean_up_tokenization_spaces": False})
        copied.append("tokenizer_config.json (written: LlamaTokenizer)")
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    ids = {k: int(v) for k, v in ids.items() if v is not None and int(v) >= 0}
    changed = {k: v for k, v in ids.items() if getattr(cfg, k) != v}
    note = (f"tokenizer {tok.model_file}: wrote {', '.join(copied)}"
            + ("; token ids from it: " + ", ".join(f"{k} {getattr(cfg, k)} -> {v}" for k, v in changed.items())
               if changed else ""))
    return dataclasses.replace(cfg, **changed), note
