"""Hugging Face ``tokenizer.json`` tokenizers (byte-level BPE, Unigram, WordPiece), through the
``tokenizers`` library: the tokenizer of Llama 3.x, Qwen2/3, SmolLM2, Mistral-Nemo and most
models released since 2024.

:class:`HFTokenizer` has the interface of :class:`msllm.data.tokenizer.LlamaTokenizer` (ids,
``encode`` / ``encode_special`` / ``decode``, ``special_tokens``, ``md5``) plus what a model
directory declares beside ``tokenizer.json``, read as transformers reads it
(``transformers/tokenization_utils_base.py`` ``from_pretrained``, v5.x):

* ``tokenizer_config.json``: ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``
  (a string, or an ``AddedToken`` dict with ``"content"``), ``add_bos_token`` /
  ``add_eos_token`` (when present they decide whether BOS / EOS are added, as transformers'
  Llama-style tokenizers do; otherwise ``tokenizer.json``'s post-processor decides), and
  ``chat_template`` (a string, or a list of ``{"name", "template"}`` whose ``"default"`` is used);
* ``special_tokens_map.json``: the same token names, used where ``tokenizer_config.json`` has none;
* ``chat_template.jinja`` (transformers >= 4.43 writes the template there): preferred over the
  config's ``chat_template`` key, as transformers does;
* ``generation_config.json`` then ``config.json``: ``eos_token_id`` (an int or a list: every id
  that ends a turn, e.g. Llama 3.1's ``<|eot_id|>`` and ``<|end_of_text|>``), used by
  :attr:`HFTokenizer.eos_ids`.

Encoding: :meth:`HFTokenizer.encode` is ``Tokenizer.encode(text, add_special_tokens=False)``:
added special tokens written in the text (``<|im_start|>``) are single tokens, as
``AutoTokenizer(text, add_special_tokens=False)`` gives; :meth:`HFTokenizer.encode_with_special`
adds BOS / EOS per the settings above, as ``AutoTokenizer(text)`` does.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from msllm.errors import MsllmError
from msllm.fileio import file_digest

TOKENIZER_JSON = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
TEMPLATE_FILE = "chat_template.jinja"
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: str) -> dict:
    """The JSON object in ``path`` ({} when the file is absent). MsllmError if it is not one."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MsllmError(f"{path}: not valid JSON ({exc}); expected the model's {os.path.basename(path)}") from None
    if not isinstance(data, dict):
        raise MsllmError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value) -> Optional[str]:
    """A special token's text from a config value: a string or ``{"content": str, ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _id_list(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(directory: str, config: dict) -> Optional[str]:
    """The model's Jinja chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or the entry named ``default`` of a list of named templates)."""
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) with its model directory's settings.

    Args:
        path: a ``tokenizer.json`` file, or the directory holding it (the settings files are read
            from the same directory).
        pad_id: id for padding; None = the declared ``pad_token``'s id, else 0 (padded positions
            are never trained on or attended to, so any valid row works).

    Attributes: ``model_file`` (the ``tokenizer.json`` path), ``vocab_size`` (ids with added
    tokens: the largest id + 1), ``bos_id`` / ``eos_id`` / ``unk_id`` / ``pad_id`` (-1 / None
    where the model declares none), ``add_bos`` / ``add_eos``, ``eos_ids`` (every end-of-turn id),
    ``chat_template`` (Jinja source or None), ``token_strings`` (``{"bos_token": "<|im_start|>", ...}``:
    the names a chat template is rendered with), ``special_tokens`` (``{text: id}`` of the special
    added tokens).

    Raises:
        MsllmError: no ``tokenizer.json`` at ``path``, a malformed one, a malformed settings file,
            a declared special token that is not in the vocabulary.
    """

    kind = "tokenizer.json"

    def __init__(self, path: str, pad_id: Optional[int] = None):
        from tokenizers import Tokenizer

        file = os.path.join(path, TOKENIZER_JSON) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise MsllmError(f"{path}: no {TOKENIZER_JSON} (expected a Hugging Face tokenizer.json or a model "
                             "directory holding one)")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
            raise MsllmError(f"{file}: not a Hugging Face tokenizer.json ({str(exc).strip()[:200]})") from None
        self.model_file = file
        self.directory = os.path.dirname(os.path.abspath(file))
        config: dict = {}
        for name in reversed(CONFIG_FILES):   # tokenizer_config.json wins over special_tokens_map.json
            config.update({k: v for k, v in _read_json(os.path.join(self.directory, name)).items() if v is not None})
        self.token_strings = {k: t for k in TOKEN_NAMES if (t := _token_content(config.get(k))) is not None}
        ids = {k: self._id_of(t, k) for k, t in self.token_strings.items()}
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = ids.get("bos_token", -1)
        self.eos_id = ids.get("eos_token", -1)
        self.unk_id = ids.get("unk_token", -1)
        self.pad_id = int(pad_id if pad_id is not None else ids.get("pad_token", 0))
        if not 0 <= self.pad_id < self.vocab_size:
            raise MsllmError(f"pad token id {self.pad_id} is outside the vocabulary of {file} "
                             f"(expected 0 <= pad_id < {self.vocab_size})")
        prefix, suffix = self._post_processor_tokens()
        self.add_bos = bool(config["add_bos_token"]) if isinstance(config.get("add_bos_token"), bool) \
            else (self.bos_id >= 0 and self.bos_id in prefix)
        self.add_eos = bool(config["add_eos_token"]) if isinstance(config.get("add_eos_token"), bool) \
            else (self.eos_id >= 0 and self.eos_id in suffix)
        self.chat_template = _chat_template(self.directory, config)
        self.special_tokens = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        gen = _read_json(os.path.join(self.directory, "generation_config.json"))
        model = _read_json(os.path.join(self.directory, "config.json"))
        declared = _id_list(gen.get("eos_token_id")) or _id_list(model.get("eos_token_id"))
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(declared + ([self.eos_id] if self.eos_id >= 0 else [])))

    def _id_of(self, text: str, key: str) -> int:
        i = self._tok.token_to_id(text)
        if i is None:
            raise MsllmError(f"{self.directory}: {key} {text!r} is not in the vocabulary of {TOKENIZER_JSON}")
        return int(i)

    def _post_processor_tokens(self) -> tuple[list[int], list[int]]:
        """Ids the post-processor puts before and after a text (e.g. Llama 3's BOS)."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return full[:k], full[k + len(plain):]
        return [], []

    # ---- the LlamaTokenizer interface --------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (list of int), no BOS/EOS added; special-token strings in the
        text are one token each (``tokenizers`` splits on added tokens first)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    encode_special = encode

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """``(ids, starts)``: :meth:`encode` and each token's first character offset in ``text``."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [s for s, _ in enc.offsets]

    def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """:meth:`encode_with_offsets` of several texts at once (the library's batch encoder, which
        spreads the texts over its thread pool: ``TOKENIZERS_PARALLELISM``, as transformers' batch
        calls do)."""
        return [(e.ids, [s for s, _ in e.offsets]) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_special(self, text: str) -> list[int]:
        """Ids as ``AutoTokenizer(text)["input_ids"]``: BOS / EOS added per ``add_bos`` / ``add_eos``."""
        return ([self.bos_id] if self.add_bos else []) + self.encode(text) + ([self.eos_id] if self.add_eos else [])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of several texts (the library's parallel batch encoder)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens left out (``skip_special_tokens=True``)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_token(self, i: int) -> Optional[str]:
        """The token string of id ``i`` (None outside the vocabulary)."""
        return self._tok.id_to_token(int(i))

    def md5(self) -> str:
        """Hex MD5 of ``tokenizer.json`` (what datasets and checkpoints record)."""
        return file_digest(self.model_file, "md5")

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.model_file!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id}, add_bos={self.add_bos}, eos_ids={list(self.eos_ids)})")
