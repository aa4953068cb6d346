"""Prompt templates: how a conversation becomes training text, and the prompt to generate from.

One module for preprocessing (``llama_preprocess.py --template``), predict and chat, so a model
is prompted exactly as it was trained. The template name travels with the data: the MindRecord
sidecar records it (``"template"``), :func:`read_template_name` reads it back.

Templates (:data:`TEMPLATE_NAMES`)
----------------------------------
``vicuna_v1.1`` (default, MindFormers' samples): FastChat's Vicuna v1.1 conversation as
MindFormers renders it (``mindformers/tools/dataset_preprocess/llama/conversation.py``,
``conv_vicuna_v1_1``, ``SeparatorStyle.ADD_COLON_TWO``; mindformers r1.0, commit
6a4076003f0c2461637b477199844cb92774e4d1)::

    <s>SYSTEM USER: {human} ASSISTANT: {gpt}</s>USER: {human} ASSISTANT: {gpt}</s>

with SYSTEM = :data:`VICUNA_SYSTEM`; an empty message renders as ``ROLE:`` with no separator
(FastChat's ``if message`` test). Generation prompt: the history, then
``USER: {human} ASSISTANT:``. One BOS per sample; each answer ends with ``</s>`` = EOS.

``alpaca`` (msllm's earlier layout; the human text already holds the Stanford Alpaca prompt made
by ``alpaca_converter.py``): per (human, gpt) pair ``<s>{human} {gpt}</s>`` -- one BOS per pair;
the human text and the answer tokenise as if encoded apart (``[bos] + encode(human)``,
``encode(gpt) + [eos]``).

``none``: no template text, the turns as given, in the same per-pair layout as ``alpaca`` (so
the two give the same ids; ``alpaca`` says the human text carries the Alpaca prompt). This is
also what msllm's generation does without a template.

Tokenisation (the one rule, :func:`encode_segments`; predict and chat use :func:`encode_prompt`)
--------------------------------------------------------------------------------------------------
``text = "".join(segment texts)``; ``ids = tokenizer.encode_special(text)``: each ``<s>`` /
``</s>`` string is the BOS / EOS id and the text between them is encoded by SentencePiece chunk
by chunk (as MindFormers' tokenizer does; :meth:`msllm.data.tokenizer.LlamaTokenizer.encode_special`).
A token's label is its id if it lies in a target segment, else ``IGNORE_INDEX``; a token that
straddles a segment boundary belongs to the later segment. In every template here each answer
starts with a space (or follows a special token), and SentencePiece (LLaMA:
``split_by_whitespace``) always starts a token there, so no token straddles: the tokens before
the answer are exactly ``encode_prompt(...)`` and every answer token, plus its EOS, is a target.
Example (vicuna_v1.1, one turn "Hi" -> "Hello!")::

    <s> | A chat ... questions. USER: Hi ASSISTANT: | ▁Hello ! | </s>
    -100  -100 ...                             -100    ids ...   2

MindFormers builds the same ids (``llama_preprocess.py``: ``[bos]`` + per round split at
``</s>``: ``tokenizer(round)[1:]`` with ``add_eos_token``) and, on ordinary text, the same
labels; where its length-based masking differs see ``docs/mindformers_compat.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

import numpy as np

from msllm.data.conversation import GPT, HUMAN
from msllm.data.tokenizer import common_prefix_len
from msllm.errors import MsllmError

IGNORE_INDEX = -100
"""Label value excluded from the loss; also the padding value of ``labels``."""
BOS, EOS = "<s>", "</s>"

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

Turns = Sequence[tuple[str, str]]
Segments = list[tuple[str, bool]]


@dataclasses.dataclass(frozen=True)
class Template:
    """A conversation template.

    Attributes:
        name: one of :data:`TEMPLATE_NAMES`.
        description: one line for ``--help`` and logs.
        bos_once_per_sample: ``True``: one BOS starts the sample; ``False``: one per pair.
        stop_strings: the text that ends an answer (``vicuna_v1.1``: ``["</s>"]``, FastChat's
            ``sep2``, which is the EOS token; ``alpaca``/``none``: ``[]``). Generation also stops
            at the EOS id in every template.
    """

    name: str
    description: str
    bos_once_per_sample: bool
    _stop: tuple[str, ...] = dataclasses.field(repr=False)
    # (human, gpt, first pair?) -> [(text, is_target)]; (human, first?) -> prompt text
    _pair: Callable[[str, str, bool], Segments] = dataclasses.field(repr=False)
    _open: Callable[[str, bool], str] = dataclasses.field(repr=False)

    def segments(self, turns: Turns) -> Segments:
        """The training text of a conversation as ordered ``(text, is_target)`` pieces.

        ``turns``: ``(role, text)`` with roles ``human``/``gpt`` alternating, starting with
        ``human`` and ending with ``gpt``. Adjacent pieces with the same flag are merged and empty
        pieces dropped; ``"".join(texts)`` is the whole rendered sample, BOS/EOS strings included.

        Raises:
            MsllmError: the turns do not alternate or do not end with a gpt turn.
        """
        _check_turns(turns, ends_with=GPT)
        out: Segments = []
        for i in range(0, len(turns), 2):
            for text, target in self._pair(turns[i][1], turns[i + 1][1], i == 0):
                if not text:
                    continue
                if out and out[-1][1] == target:
                    out[-1] = (out[-1][0] + text, target)
                else:
                    out.append((text, target))
        return out

    def prompt(self, turns: Turns) -> str:
        """The text to generate the next answer from: the complete pairs rendered as in training,
        then the last human turn opened for the answer. ``turns`` end with a ``human`` turn.

        It is the training text up to the first target token of that answer, so tokenised with
        :func:`encode_prompt` it gives the ids training saw. Raises MsllmError like
        :meth:`segments`."""
        _check_turns(turns, ends_with=HUMAN)
        history = "".join(t for t, _ in self.segments(turns[:-1])) if len(turns) > 1 else ""
        return history + self._open(turns[-1][1], len(turns) == 1)

    @property
    def stop_strings(self) -> list[str]:
        return list(self._stop)


def _check_turns(turns: Turns, ends_with: str) -> None:
    if not turns:
        raise MsllmError("a conversation needs at least one turn")
    for i, turn in enumerate(turns):
        role = turn[0]
        if role != (HUMAN if i % 2 == 0 else GPT):
            raise MsllmError(f"turn {i} has role {role!r}: expected roles human, gpt, human, ... "
                             "alternating from human")
    if turns[-1][0] != ends_with:
        raise MsllmError(f"the last turn must be a {ends_with} turn, got {turns[-1][0]!r}")


# ---- vicuna_v1.1 (FastChat / MindFormers conv_vicuna_v1_1, ADD_COLON_TWO) ------------------------

def _vicuna_user(human: str, first: bool) -> str:
    head = BOS + VICUNA_SYSTEM + " " if first else ""
    # FastChat: `role + ": " + message + sep` if message else `role + ":"`
    return head + ("USER: " + human + " " if human else "USER:") + "ASSISTANT:"


def _vicuna_pair(human: str, gpt: str, first: bool) -> Segments:
    return [(_vicuna_user(human, first), False), ((" " + gpt + EOS) if gpt else "", True)]


# ---- alpaca (msllm's earlier layout: [bos] + human, then answer + [eos], per pair) -------------

def _alpaca_pair(human: str, gpt: str, first: bool) -> Segments:
    # The space makes SentencePiece encode the answer exactly as if alone (dummy prefix).
    return [(BOS + human, False), ((" " + gpt if human and gpt else gpt) + EOS, True)]


def _alpaca_open(human: str, first: bool) -> str:
    return BOS + human


_TEMPLATES = {
    "vicuna_v1.1": Template(
        "vicuna_v1.1", "FastChat Vicuna v1.1 (system prompt, USER:/ASSISTANT:, </s> after answers)"
        "; MindFormers' llama_preprocess.py samples", True, (EOS,), _vicuna_pair, _vicuna_user),
    "alpaca": Template(
        "alpaca", "<s>{human} {gpt}</s> per pair (the human text holds the Stanford Alpaca prompt)",
        False, (), _alpaca_pair, _alpaca_open),
    "none": Template("none", "<s>{human} {gpt}</s> per pair, the turns as given (no template text)",
                     False, (), _alpaca_pair, _alpaca_open),
}
TEMPLATE_NAMES: tuple[str, ...] = tuple(_TEMPLATES)
DEFAULT_TEMPLATE = "vicuna_v1.1"


CHAT_TEMPLATE_NAMES = ("chat_template", "chatml")
"""Templates that need a tokenizer: ``chat_template`` (the model's own Jinja template; recorded as
``chat_template:<digest>``) and ``chatml`` (ChatML without a default system prompt)."""
ALL_TEMPLATE_NAMES: tuple[str, ...] = TEMPLATE_NAMES + CHAT_TEMPLATE_NAMES


def get_template(name: str) -> Template:
    """The named (tokenizer-independent) :class:`Template` called ``name``.

    Raises:
        MsllmError: unknown name (the message lists :data:`TEMPLATE_NAMES`); a chat-template name
            (those need the tokenizer: :func:`resolve_template`).
    """
    if name not in _TEMPLATES:
        if name.split(":")[0] in CHAT_TEMPLATE_NAMES:
            raise MsllmError(f"prompt template {name!r} needs the tokenizer: use resolve_template")
        raise MsllmError(f"unknown prompt template {name!r}; expected one of {', '.join(ALL_TEMPLATE_NAMES)}")
    return _TEMPLATES[name]


def check_template_name(name: str | None) -> None:
    """MsllmError for a name that is neither a named template nor a chat-template name."""
    if name is not None and name not in TEMPLATE_NAMES and name.split(":")[0] not in CHAT_TEMPLATE_NAMES:
        raise MsllmError(f"unknown prompt template {name!r}; expected one of {', '.join(ALL_TEMPLATE_NAMES)}")


def resolve_template(name: str | None, tokenizer, default_to_chat: bool = True):
    """The template to render conversations with, given the ``tokenizer`` they are encoded with.

    Args:
        name: a named template (:data:`TEMPLATE_NAMES`), ``chatml``, ``chat_template`` or a recorded
            ``chat_template:<digest>`` (the digest must be the tokenizer's template's), or None.
        tokenizer: :func:`msllm.data.tokenizer.load_tokenizer`'s result.
        default_to_chat: with ``name`` None, use the tokenizer's own chat template when it has one.

    Returns:
        :class:`Template`, :class:`~msllm.data.chat_template.ChatTemplate`, or None (plain text).

    Raises:
        MsllmError: unknown name; ``chat_template`` for a tokenizer with none; ``chatml`` for a
            tokenizer without ``<|im_start|>`` / ``<|im_end|>`` special tokens (LLaMA's SentencePiece); a recorded digest
            that differs from the tokenizer's template (the data were built with another template);
            a template that does not parse.
    """
    from msllm.data.chat_template import CHATML, NAME_PREFIX, ChatTemplate, template_digest

    check_template_name(name)
    if name is None:
        if default_to_chat and tokenizer.chat_template:
            return ChatTemplate(tokenizer.chat_template, tokenizer)
        return None
    if name == "chatml":
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in tokenizer.special_tokens]
        if missing:  # they would be split into ordinary pieces, and no answer would end at <|im_end|>
            raise MsllmError(f"prompt template 'chatml' writes {' and '.join(missing)}, which tokenizer "
                             f"{tokenizer.model_file} does not have as special tokens: use the model's own "
                             f"chat_template, one of {', '.join(TEMPLATE_NAMES)}, or none")
        return ChatTemplate(CHATML, tokenizer, name="chatml")
    if name.split(":")[0] == NAME_PREFIX:
        if not tokenizer.chat_template:
            raise MsllmError(f"prompt template {name!r}: tokenizer {tokenizer.model_file} has no chat template "
                             f"(expected chat_template.jinja or tokenizer_config.json's chat_template beside it); "
                             f"use one of {', '.join(TEMPLATE_NAMES)} or chatml")
        tmpl = ChatTemplate(tokenizer.chat_template, tokenizer)
        digest = name.split(":", 1)[1] if ":" in name else None
        if digest and digest != template_digest(tokenizer.chat_template):
            raise MsllmError(f"prompt template {name!r} was recorded with the data or checkpoint, but the chat "
                             f"template of {tokenizer.model_file} is {tmpl.name}: a different template")
        return tmpl
    named = get_template(name)
    if getattr(tokenizer, "kind", "sentencepiece") != "sentencepiece" and not {BOS, EOS} <= set(tokenizer.special_tokens):
        raise MsllmError(f"prompt template {name!r} writes LLaMA's {BOS} / {EOS} tokens, which tokenizer "
                         f"{tokenizer.model_file} does not have: use chat_template (the model's own), chatml or none")
    return named


# ---- tokenisation -------------------------------------------------------------------------------

def labels_by_offsets(ids: list[int], starts: list[int], segments: Segments,
                      ignore_index: int = IGNORE_INDEX) -> list[int]:
    """Labels of tokens ``ids`` starting at character offsets ``starts`` of ``"".join(segments)``:
    the id where the segment holding the token's first character is a target, else ``ignore_index``
    (a token past the last segment follows the last one)."""
    if not ids:
        return []
    ends = np.cumsum([len(t) for t, _ in segments], dtype=np.int64)
    flags = np.fromiter((target for _, target in segments), bool, len(segments))
    # the segment of offset s is the first whose end is > s
    seg = np.minimum(np.searchsorted(ends, np.asarray(starts, np.int64), side="right"), len(segments) - 1)
    return np.where(flags[seg], np.asarray(ids, np.int64), ignore_index).tolist()


def encode_segments_batch(tokenizer, samples: Sequence[Segments],
                          ignore_index: int = IGNORE_INDEX) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_segments` of several samples; an HF tokenizer encodes their texts in one batch
    call (its thread pool), a SentencePiece one sample by sample. Results equal the one-by-one ones."""
    if not hasattr(tokenizer, "encode_batch_with_offsets"):
        return [encode_segments(tokenizer, s, ignore_index) for s in samples]
    encoded = tokenizer.encode_batch_with_offsets(["".join(t for t, _ in s) for s in samples])
    return [(ids, labels_by_offsets(ids, starts, s, ignore_index)) for (ids, starts), s in zip(encoded, samples)]


def encode_segments(tokenizer, segments: Segments, ignore_index: int = IGNORE_INDEX) -> tuple[list[int], list[int]]:
    """Token ids and labels of a sample given as ``(text, is_target)`` segments.

    Args:
        tokenizer: a :class:`msllm.data.tokenizer.LlamaTokenizer`, or an
            :class:`~msllm.data.hf_tokenizer.HFTokenizer` (then ``ids`` is its encoding of the whole
            text and a token's label follows the segment its first character is in).
        segments: from :meth:`Template.segments` (or a chat template's).

    Returns:
        ``(ids, labels)``: two lists of int of equal length (unpadded, untruncated); ``ids`` ==
        ``tokenizer.encode_special("".join(texts))``, labels = id on target tokens, else
        ``ignore_index``. Rule in the module doc; a chunk of plain text is encoded once, and its
        prefix up to each segment boundary once more to find where the boundary falls.
    """
    text = "".join(t for t, _ in segments)
    if hasattr(tokenizer, "encode_with_offsets"):   # HF tokenizers: the whole text, labels by offsets
        ids, starts = tokenizer.encode_with_offsets(text)
        return ids, labels_by_offsets(ids, starts, segments, ignore_index)

    bounds: list[tuple[int, bool]] = []  # (end offset, is_target) per segment
    pos = 0
    for t, target in segments:
        pos += len(t)
        bounds.append((pos, target))

    def flag_at(offset: int) -> bool:
        for end, target in bounds:
            if offset < end:
                return target
        return bounds[-1][1]

    ids: list[int] = []
    labels: list[int] = []
    for start, end, special in tokenizer.chunks(text):
        if special is not None:
            ids.append(special)
            labels.append(special if flag_at(start) else ignore_index)
            continue
        chunk_ids = tokenizer.encode(text[start:end])
        # flag changes inside the chunk -> token index where each new flag starts
        cuts = [(0, flag_at(start))]
        for b_end, _ in bounds:
            if start < b_end < end and flag_at(b_end) != cuts[-1][1]:
                k = common_prefix_len(tokenizer.encode(text[start:b_end]), chunk_ids)
                cuts.append((max(k, cuts[-1][0]), flag_at(b_end)))
        cuts.append((len(chunk_ids), False))
        for (k0, target), (k1, _) in zip(cuts, cuts[1:]):
            ids.extend(chunk_ids[k0:k1])
            labels.extend(chunk_ids[k0:k1] if target else [ignore_index] * (k1 - k0))
    return ids, labels


def encode_prompt(tokenizer, template: Template, turns: Turns) -> list[int]:
    """Ids to feed a model to generate the answer to the last (human) turn of ``turns``.

    Exactly the ids a training sample of ``turns + [("gpt", answer)]`` holds before the answer's
    first token (every answer starts a new token: module doc). BOS included.
    Raises MsllmError on malformed turns (see :meth:`Template.prompt`).
    """
    return tokenizer.encode_special(template.prompt(turns))


# ---- the template name beside the data ----------------------------------------------------------

def read_template_name(dataset_dir: str) -> str | None:
    """The template recorded in the MindRecord sidecar(s) of ``dataset_dir`` (a data file, one
    shard of a group, or a directory), or ``None`` (no sidecar, a ``wiki`` dataset, or data not
    written by msllm, e.g. MindFormers' own files).

    Raises:
        MsllmError: the path holds no MindRecord (see
            :func:`msllm.data.mindrecord.resolve_mindrecord_files`), a sidecar is not JSON, or the
            files record different templates.
    """
    from msllm.data.mindrecord import resolve_mindrecord_files, sidecar_path

    found: dict[str | None, str] = {}
    for path in resolve_mindrecord_files(dataset_dir):
        side = sidecar_path(path)
        name = None
        if os.path.isfile(side):
            try:
                with open(side, encoding="utf-8") as fh:
                    meta = json.load(fh)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise MsllmError(f"{side}: invalid metadata sidecar ({exc})") from None
            name = meta.get("template") if isinstance(meta, dict) else None
        found.setdefault(name, path)
    if len(found) > 1:
        detail = ", ".join(f"{p} -> {n!r}" for n, p in found.items())
        raise MsllmError(f"{dataset_dir}: the MindRecord files were built with different prompt "
                         f"templates ({detail}); preprocess them with one --template")
    return next(iter(found))
