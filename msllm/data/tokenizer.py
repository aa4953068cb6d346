"""Tokenizers: the one interface and its two kinds, and where a tokenizer comes from.

Kinds: :class:`LlamaTokenizer` (a SentencePiece ``.model``, this module) and
:class:`msllm.data.hf_tokenizer.HFTokenizer` (a Hugging Face ``tokenizer.json`` through the
``tokenizers`` library). Both give ``vocab_size``, ``bos_id``, ``eos_id``, ``unk_id``,
``pad_id``, ``add_bos``, ``eos_ids``, ``chat_template``, ``token_strings``, ``encode`` /
``encode_special`` / ``encode_with_special`` / ``encode_batch`` / ``decode``, ``md5``.
:func:`load_tokenizer` opens either from a file or an HF model directory;
:func:`check_vocab` refuses a tokenizer whose ids do not fit a model.

LLaMA's SentencePiece tokenizer: a thin wrapper over sentencepiece ``SentencePieceProcessor``.

The original LLaMA ``tokenizer.model`` (32000 pieces, BPE with byte fallback) has
``unk=0, bos=1, eos=2`` and **no pad piece** (``SentencePieceProcessor.pad_id() == -1``).
:class:`LlamaTokenizer` therefore uses ``pad_id = 0`` (the ``<unk>`` id) unless told otherwise:
padded positions are never trained on (their labels are ``IGNORE_INDEX``), so any valid
embedding row works; 0 is what MindFormers' LLaMA configs use (``pad_token_id: 0``).
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from msllm.errors import MsllmError
from msllm.fileio import file_digest

DEFAULT_PAD_ID = 0


def file_md5(path: str) -> str:
    """Hex MD5 of the file at ``path`` (used to record which tokenizer built a dataset)."""
    return file_digest(path, "md5")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class LlamaTokenizer:
    """A SentencePiece LLaMA tokenizer (one of the two :data:`Tokenizer` kinds).

    Args:
        model_file: path to a SentencePiece ``.model`` file (e.g. LLaMA ``tokenizer.model``).
        pad_id: id used to pad ``input_ids``; default 0 (= ``<unk>`` for LLaMA, which has no
            pad piece). If the model has its own pad piece, that id is used when ``pad_id`` is
            ``None``.

    Raises:
        MsllmError: ``model_file`` is missing, a directory, or not a SentencePiece model; the
            model has no BOS or EOS piece; ``pad_id`` is outside ``[0, vocab_size)``.
    """

    kind = "sentencepiece"

    def __init__(self, model_file: str, pad_id: int | None = DEFAULT_PAD_ID):
        import sentencepiece as spm

        self.model_file = model_file
        if not os.path.exists(model_file):
            raise MsllmError(f"{model_file}: tokenizer model file not found (expected a SentencePiece .model file)")
        if os.path.isdir(model_file):
            raise MsllmError(f"{model_file}: is a directory (expected a SentencePiece .model file)")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as exc:
            raise MsllmError(
                f"{model_file}: not a SentencePiece model ({str(exc).strip()}); "
                "expected a tokenizer.model file such as LLaMA's"
            ) from None
        self.bos_id: int = int(self._sp.bos_id())
        self.eos_id: int = int(self._sp.eos_id())
        self.unk_id: int = int(self._sp.unk_id())
        self.vocab_size: int = int(self._sp.vocab_size())
        if self.bos_id < 0 or self.eos_id < 0:
            raise MsllmError(
                f"{model_file}: SentencePiece model has no BOS/EOS piece (bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}); expected a LLaMA-style tokenizer with both"
            )
        if pad_id is None:
            own = int(self._sp.pad_id())
            pad_id = own if own >= 0 else DEFAULT_PAD_ID
        if not 0 <= pad_id < self.vocab_size:
            raise MsllmError(
                f"pad token id {pad_id} is outside the vocabulary of {model_file} "
                f"(expected 0 <= pad_id < {self.vocab_size})"
            )
        self.pad_id: int = int(pad_id)
        # The literal strings that are one special token each (MindFormers / HF "added tokens"):
        # the model's own control pieces plus the LLaMA names the templates write.
        self.special_tokens: dict[str, int] = {"<s>": self.bos_id, "</s>": self.eos_id}
        if self.unk_id >= 0:
            self.special_tokens["<unk>"] = self.unk_id
        for i in (self.bos_id, self.eos_id, self.unk_id):
            if i >= 0:
                self.special_tokens.setdefault(self._sp.id_to_piece(i), i)
        # the settings HFTokenizer reads from a model directory: LLaMA's are fixed
        self.add_bos, self.add_eos = True, False
        self.eos_ids: tuple[int, ...] = (self.eos_id,)
        self.chat_template: str | None = None
        self.token_strings = {"bos_token": self._sp.id_to_piece(self.bos_id),
                              "eos_token": self._sp.id_to_piece(self.eos_id)}
        if self.unk_id >= 0:
            self.token_strings["unk_token"] = self._sp.id_to_piece(self.unk_id)
        names = sorted(self.special_tokens, key=len, reverse=True)  # longest match first
        self._special_re = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (list of int in ``[0, vocab_size)``), without BOS/EOS.

        Plain SentencePiece: a literal ``"</s>"`` in ``text`` is encoded as the characters
        ``<``, ``/s``, ``>``. See :meth:`encode_special` for the tokenisation of training samples.
        """
        return self._sp.encode(text)

    def encode_special(self, text: str) -> list[int]:
        """Token ids of ``text`` where each literal special-token string (``<s>``, ``</s>``,
        ``<unk>``; :attr:`special_tokens`) is that one token and the text between them is encoded
        by SentencePiece chunk by chunk (each chunk gets SentencePiece's dummy-prefix space).

        This is what MindFormers' ``LlamaTokenizer`` (legacy mode, the default) does when called
        on text: ``PreTrainedTokenizer.tokenize`` splits on the added special tokens with no
        whitespace stripping (``AddedToken(lstrip=False, rstrip=False)``) and encodes each piece
        with ``sp_model.encode`` (mindformers r1.0 ``mindformers/models/base_tokenizer.py``
        ``tokenize`` / ``tokenize_atom``, ``mindformers/models/llama/llama_tokenizer.py``
        ``_tokenize``; commit 6a4076003f0c2461637b477199844cb92774e4d1). No BOS/EOS is added.
        Returns a list of int.
        """
        out: list[int] = []
        for start, end, special in self.chunks(text):
            if special is not None:
                out.append(special)
            else:
                out.extend(self._sp.encode(text[start:end]))
        return out

    def chunks(self, text: str) -> list[tuple[int, int, int | None]]:
        """The pieces :meth:`encode_special` encodes one by one, as ``(start, end, special_id)``
        character spans of ``text`` in order: ``special_id`` is the id of a special-token string,
        ``None`` for plain text. Empty pieces are left out."""
        out: list[tuple[int, int, int | None]] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                out.append((pos, m.start(), None))
            out.append((m.start(), m.end(), self.special_tokens[m.group(0)]))
            pos = m.end()
        if pos < len(text):
            out.append((pos, len(text), None))
        return out

    def encode_with_special(self, text: str) -> list[int]:
        """``[bos] + encode(text)``: what transformers' ``LlamaTokenizer(text)`` gives."""
        return [self.bos_id] + self.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for several texts at once (one list of ids per text)."""
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the token ids ``ids`` (control pieces such as BOS/EOS decode to "")."""
        return self._sp.decode([int(i) for i in ids])

    def id_to_token(self, i: int) -> str | None:
        """The piece of id ``i`` (None outside the vocabulary)."""
        return self._sp.id_to_piece(int(i)) if 0 <= int(i) < self.vocab_size else None

    def md5(self) -> str:
        """Hex MD5 of the model file (see :func:`file_md5`)."""
        return file_md5(self.model_file)

    def __repr__(self) -> str:
        return (
            f"LlamaTokenizer({self.model_file!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, unk={self.unk_id}, pad={self.pad_id})"
        )


def load_tokenizer(path: str, pad_id: int | None = None):
    """The tokenizer at ``path``: a SentencePiece ``.model`` file, a ``tokenizer.json``, or a
    Hugging Face model directory (its ``tokenizer.json`` when it has one, as transformers'
    ``AutoTokenizer`` prefers the fast tokenizer; else its ``tokenizer.model``, with the
    directory's chat template).

    Args:
        path: file or directory.
        pad_id: padding id; None = the tokenizer's own pad token, else 0.

    Returns:
        :class:`LlamaTokenizer` or :class:`~msllm.data.hf_tokenizer.HFTokenizer`.

    Raises:
        MsllmError: ``path`` missing; a directory with neither file; a file that is neither
            kind (a malformed ``tokenizer.json`` or ``.model``).
    """
    from msllm.data.hf_tokenizer import TOKENIZER_JSON, HFTokenizer, _chat_template, _read_json

    if not os.path.exists(path):
        raise MsllmError(f"tokenizer {path}: not found (expected a SentencePiece .model, a tokenizer.json or a "
                         "Hugging Face model directory)")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
            return HFTokenizer(path, pad_id)
        sp = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(sp):
            raise MsllmError(f"{path}: the directory has no tokenizer (expected {TOKENIZER_JSON} or tokenizer.model)")
        tok = LlamaTokenizer(sp, pad_id)
        tok.chat_template = _chat_template(path, _read_json(os.path.join(path, "tokenizer_config.json")))
        return tok
    if path.endswith(".json"):
        return HFTokenizer(path, pad_id)
    return LlamaTokenizer(path, pad_id)


def tokenizer_source(path: str) -> str | None:
    """The tokenizer an HF model directory brings (the directory itself, for
    :func:`load_tokenizer`), or None when it has neither ``tokenizer.json`` nor ``tokenizer.model``."""
    has = any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer.model"))
    return path if has else None


def check_vocab(tokenizer, vocab_size: int, model_name: str) -> None:
    """MsllmError unless every id of ``tokenizer`` is a row of the model's embedding
    (``tokenizer.vocab_size <= vocab_size``; a model may have more rows than its tokenizer has
    ids, as Qwen's padded embeddings do)."""
    if tokenizer.vocab_size > vocab_size:
        raise MsllmError(
            f"tokenizer {tokenizer.model_file} has {tokenizer.vocab_size} ids but the model ({model_name}) has "
            f"vocab_size {vocab_size}: it is not this model's tokenizer. Pass the model's own tokenizer "
            "(--tokenizer: a tokenizer.model, a tokenizer.json or the model's Hugging Face directory)")
