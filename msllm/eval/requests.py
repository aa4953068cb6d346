"""Log-likelihood requests: (context, continuation) strings -> the token rows the model scores.

Follows lm-evaluation-harness v0.4.13 exactly (``lm_eval/api/model.py`` ``TemplateLM._encode_pair``
and ``loglikelihood``; ``lm_eval/models/huggingface.py`` ``HFLM._loglikelihood_tokens``):

* trailing whitespace of the context moves to the front of the continuation;
* the context and context + continuation are tokenised separately (each with BOS for LLaMA's
  SentencePiece tokenizer, as ``HFLM(add_bos_token=True)`` does: LLaMA models are trained with
  BOS; with a ``tokenizer.json``, BOS only when the tokenizer adds it, HFLM's default); the continuation's
  tokens are the whole string's tokens after the first ``len(context tokens)``; the model input is
  the separately tokenised context followed by those continuation tokens;
* an empty context becomes ``[BOS]`` (``prefix_token_id``) unless the continuation starts with it;
* sequences longer than ``max_length + 1`` tokens are truncated from the left, and the last token is
  dropped: ``input = (context + continuation)[-(max_length + 1):][:-1]``; the continuation's
  log-probabilities are read at the input's last ``len(continuation)`` positions.

Requests whose model inputs are identical (the harness's one-token-continuation cache,
``Collator(group_by="contexts")``: e.g. the four single-token answers " A".." D" of an MMLU
question) become one :class:`Row` scored by one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from msllm.data.tokenizer import common_prefix_len
from msllm.errors import MsllmError


@dataclass(frozen=True)
class Request:
    """One log-likelihood request: log P(continuation | context).

    doc: index of the document (question) in its task; choice: which answer it scores.
    """

    context: str
    continuation: str
    doc: int = 0
    choice: int = 0


def encode_pair(encode: Callable[[str], list], bos_id: int | None, context: str,
                continuation: str, prefix_id: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids (context_enc, continuation_enc) of one request, as the harness makes them.

    ``encode(text)`` returns ids without BOS; ``bos_id`` (None: nothing) is prepended to the context
    and to context + continuation, as the tokenizer's own ``add_special_tokens`` does in HFLM's
    ``tok_encode``. An empty context is ``[prefix_id]`` (default ``bos_id``: HFLM's
    ``prefix_token_id``, BOS else EOS).
    Raises MsllmError if the continuation has no tokens (the harness asserts the same).
    """
    head = [] if bos_id is None else [bos_id]
    if context == "":
        prefix_id = bos_id if prefix_id is None else prefix_id
        cont = head + list(encode(continuation))
        ctx, cont = ([prefix_id], cont) if not cont or cont[0] != prefix_id else (cont[:1], cont[1:])
    else:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = head + list(encode(context + continuation))
        ctx = head + list(encode(context))
        cont = whole[len(ctx):]
    if not cont:
        raise MsllmError(f"continuation {continuation!r} of context ...{context[-40:]!r} has no tokens "
                         "after tokenisation; every answer must add at least one token")
    return ctx, cont


def bos_rule(tok) -> tuple:
    """``(bos_id or None, prefix_id)`` of a task's encoding: LLaMA's SentencePiece tokenizer
    always prepends BOS (msllm's rule: LLaMA is trained with it); a ``tokenizer.json`` as its
    settings say (lm-eval HFLM's default, ``add_special_tokens`` of the tokenizer). ``prefix_id``
    stands for an empty context: BOS, else EOS (HFLM ``prefix_token_id``)."""
    bos = tok.bos_id if (tok.kind == "sentencepiece" or tok.add_bos) and tok.bos_id >= 0 else None
    return bos, (tok.bos_id if tok.bos_id >= 0 else tok.eos_id)


def model_input(ctx: Sequence[int], cont: Sequence[int], max_length: int) -> tuple[int, ...]:
    """The token row the model reads for one request: ``(ctx + cont)[-(max_length + 1):][:-1]``."""
    if len(cont) > max_length:
        raise MsllmError(f"a continuation of {len(cont)} tokens does not fit the model's "
                         f"seq_length {max_length}")
    return tuple((list(ctx) + list(cont))[-(max_length + 1):][:-1])


@dataclass
class Row:
    """One model input shared by queries.

    tokens: the input ids; queries: ``(index, positions, targets)`` triples: the log-probability
    of query ``index`` is ``sum_k log p(targets[k] | tokens[:positions[k] + 1])`` (the logits at
    position p predict token p + 1).
    """

    tokens: tuple
    queries: list = field(default_factory=list)

    @property
    def first_query(self) -> int:
        """The smallest queried position (a shared prefix must end at or before it)."""
        return min(min(p) for _, p, _ in self.queries)


def continuation_query(n_tokens: int, index: int, cont: Sequence[int]) -> tuple[int, list, list]:
    """The query of a continuation scored at the last ``len(cont)`` positions of an input of
    ``n_tokens`` tokens."""
    return index, list(range(n_tokens - len(cont), n_tokens)), list(cont)


def build_rows(encoded: Sequence[tuple[list[int], list[int]]], max_length: int) -> list[Row]:
    """Group encoded requests ``[(ctx, cont), ...]`` into rows with identical model inputs.

    Rows keep the order of their first request; within a row, requests keep their order.
    """
    rows: dict[tuple, Row] = {}
    for i, (ctx, cont) in enumerate(encoded):
        key = model_input(ctx, cont, max_length)
        rows.setdefault(key, Row(key)).queries.append(continuation_query(len(key), i, cont))
    return list(rows.values())


def plan_units(rows: Sequence[Row], min_prefix: int, max_group: int) -> list[tuple[int, list[int]]]:
    """Split rows into scoring units that share a token prefix.

    Rows are sorted by their tokens (so rows with a long common prefix, such as one subject's
    questions behind the same few-shot examples, are adjacent) and grouped greedily while the
    group's common prefix stays at least ``min_prefix`` tokens (and at most ``max_group`` rows).
    Returns ``[(prefix_len, row indices)]``; ``prefix_len`` 0 means "no shared prefix worth
    caching". A prefix never reaches a row's first queried position (whose hidden state the
    suffix pass must compute). The plan depends only on the rows, so every rank of a
    data-parallel run computes the same one.
    """
    order = sorted(range(len(rows)), key=lambda i: rows[i].tokens)
    units: list[tuple[int, list[int]]] = []
    group: list[int] = []
    prefix = 0
    for i in order:
        if group:
            p = min(prefix, common_prefix_len(rows[group[0]].tokens, rows[i].tokens), rows[i].first_query)
            if p >= min_prefix and len(group) < max_group:
                group.append(i)
                prefix = p
                continue
            units.append((prefix if len(group) > 1 else 0, group))
        group, prefix = [i], rows[i].first_query
    if group:
        units.append((prefix if len(group) > 1 else 0, group))
    return units
