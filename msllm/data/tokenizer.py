"""LLaMA tokenizer: a thin wrapper over sentencepiece ``SentencePieceProcessor``.

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
    """A SentencePiece LLaMA tokenizer.

    Args:
        model_file: path to a SentencePiece ``.model`` file (e.g. LLaMA ``tokenizer.model``).
        pad_id: id used to pad ``input_ids``; default 0 (= ``<unk>`` for LLaMA, which has no
            pad piece). If the model has its own pad piece, that id is used when ``pad_id`` is
            ``None``.

    Raises:
        MsllmError: ``model_file`` is missing, a directory, or not a SentencePiece model; the
            model has no BOS or EOS piece; ``pad_id`` is outside ``[0, vocab_size)``.
    """

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

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for several texts at once (one list of ids per text)."""
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the token ids ``ids`` (control pieces such as BOS/EOS decode to "")."""
        return self._sp.decode([int(i) for i in ids])

    def md5(self) -> str:
        """Hex MD5 of the model file (see :func:`file_md5`)."""
        return file_md5(self.model_file)

    def __repr__(self) -> str:
        return (
            f"LlamaTokenizer({self.model_file!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, unk={self.unk_id}, pad={self.pad_id})"
        )
