"""Batched decoding with a key/value cache: one prefill over the prompts, then one token per step.

The batch layout (left padding, each row's positions, which slots a query sees) is
:mod:`msllm.models.llama.batch_layout`'s: row b's prompt of n_b tokens sits in slots
``pad_b .. P-1`` of the P-slot prompt block, new token k of every row goes to slot ``P + k``,
and the cache has ``S = P + max_new`` slots (rounded up to a multiple of :data:`SLOT_MULTIPLE`).
A row's tokens do not depend on the others'.

Static shapes: the prefill graph has shape (B, P, S) and the decode graph (B, 1, S), so in
GRAPH_MODE the decode step compiles once per (batch size, buffer length) and runs for every
token; caches are Parameters written in place (:mod:`msllm.models.llama.kv_cache`), passed as
``ms.mutable`` tuples (otherwise MindSpore treats them as constants and recompiles each step), or,
for the decode step over a kept cache set, held by the step's cell
(:mod:`msllm.generation.bound_caches`: 60 cache inputs cost MindSpore ~25 us each per call).
:attr:`Generator.shapes` records the shapes called (tests check it).

Without the cache (``use_past: False``) each step runs the whole sequence again, right-aligned
in a buffer of W = P + max_new slots (shape (B, W, W), one graph): the reference path
MindFormers calls ``use_past=False``.

Token choice per step: :mod:`msllm.generation.stepping` (the per-row decision the serving batch
uses too: greedy argmax, or sampling after temperature / top-k / top-p, with the repetition
penalty for both; EOS, length). A row stops at any EOS id (its EOS is kept in its output, as HF
does; later steps feed it ``pad_token_id``); the batch stops when every row has stopped or after
``max_new`` tokens. Beam search: :mod:`msllm.generation.beam`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from msllm.errors import MsllmError
from msllm.generation.beam import beam_search
from msllm.generation.bound_caches import BoundCaches, budget_bytes
from msllm.generation.direct_step import DirectDecode
from msllm.config_generation import DecodeSettings
from msllm.generation.passes import SLOT_MULTIPLE, GenerationResult, Passes, round_up  # noqa: F401 (re-exported)
from msllm.generation.stepping import RowStep, choose_rows
from msllm.models.llama.batch_layout import key_positions, left_pad, positions_for

# stream(step, tokens (B,) int64, finished (B,) bool) -> None / False (go on), True (stop every row) or
# a (B,) bool array (stop those rows); stopped rows get finish reason "stop"
StreamFn = Callable[[int, np.ndarray, np.ndarray], Optional[bool]]


def _cells():
    """The graph cells, defined on first use so that importing this module needs no MindSpore."""
    from mindspore import ParameterTuple, nn, ops

    from msllm.generation.replay import replay_cell

    class CachedStep(nn.Cell):
        """``(ids, positions, key_positions, index, caches) -> last-position logits (B, V)`` (the caches
        written in place at the cache rows ``index`` (T, B): :func:`~msllm.models.llama.kv_cache.cache_index`);
        ``fresh``: the prefill's cell (rows attending over their own new tokens only, a
        compile-time constant of the model's ``forward_cached``)."""

        def __init__(self, net, fresh: bool = False):
            super().__init__(auto_prefix=False)  # keep the network's parameter names
            self.net = net
            self.fresh = fresh

        def construct(self, input_ids, positions, key_positions, index, caches):
            return self.net.forward_cached(input_ids, positions, key_positions, index, caches, True, self.fresh)

    class ReorderCaches(nn.Cell):
        """Reorders the cache rows in place to ``beam_idx`` (B,) int32 (beam search: row b
        continues beam ``beam_idx[b]``); returns beam_idx. A graph of its own, run before the step:
        the fused decode front writes the caches itself, and after an ``assign`` in the same graph
        MindSpore may hand later readers the assigned value instead of the Parameter's buffer, so
        the front's writes would miss the cache (tests/generation/test_generation_beam.py)."""

        def __init__(self):
            super().__init__()
            self.gather = ops.Gather()

        def construct(self, beam_idx, caches):
            b = beam_idx.shape[0]
            for c in caches:                                   # (S * B, K, D): rows on axis 1 of (S, B, K, D)
                rows, k, d = c.shape
                ops.assign(c, self.gather(c.reshape((rows // b, b, k, d)), beam_idx, 1).reshape((rows, k, d)))
            return beam_idx

    class BoundStep(nn.Cell):
        """``(ids, positions, key_positions, index) -> last-position logits (B, V)``: the decode
        step of :class:`CachedStep` over the caches this cell holds as its own Parameters (a kept
        set, :mod:`msllm.generation.bound_caches` says why), written in place as there."""

        def __init__(self, net, caches):
            super().__init__(auto_prefix=False)  # keep the network's parameter names
            self.net = net
            self.caches = ParameterTuple(caches)

        def construct(self, input_ids, positions, key_positions, index):
            return self.net.forward_cached(input_ids, positions, key_positions, index, self.caches, True, False)

    # a compiled step runs again without MindSpore's per-call compile work (msllm/generation/replay.py)
    return replay_cell(CachedStep), replay_cell(ReorderCaches), replay_cell(BoundStep)


class Generator:
    """Generation for one network: keeps the compiled step cells, so each shape compiles once
    over any number of :meth:`generate` calls (GRAPH_MODE; in PYNATIVE_MODE nothing compiles).

    Args:
        net: :class:`~msllm.models.llama.model.LlamaForCausalLM` with its weights loaded.
        config: its :class:`~msllm.models.llama.config.LlamaConfig`.
    """

    def __init__(self, net, config):
        CachedStep, ReorderCaches, BoundStep = _cells()
        net.set_train(False)
        self.net, self.config = net, config
        self.context = config.max_positions
        self.step = CachedStep(net)
        self.prefill_step = CachedStep(net, fresh=True)
        self.reorder_caches = ReorderCaches()
        self.direct = DirectDecode.build(net)   # None: every decode step through the graph
        self.kept = BoundCaches(self.empty_cache, lambda caches: BoundStep(net, caches), self.cache_bytes,
                                budget_bytes())
        self.shapes: list = []   # (kind, B, T, S) in first-call order
        self.first_call_s: dict = {}

    # -- low level ------------------------------------------------------------------------
    def empty_cache(self, batch: int, buffer: int, name: str = "kv_cache_"):
        """A private zero cache of ``batch`` rows and ``buffer`` slots
        (:func:`~msllm.models.llama.kv_cache.empty_cache`; Parameter names start with ``name``)."""
        from msllm.models.llama.kv_cache import empty_cache
        from msllm.models.llama.model import ms_dtype

        c = self.config
        return empty_cache(batch, c.kv_heads, buffer, c.head_dim, c.num_layers, ms_dtype(self.cache_dtype()), name)

    def cache_dtype(self) -> str:
        """The caches' dtype name: the one the layers compute in, their model's config (float32
        under compute_dtype bfloat16 on msllm's CPU kernels: their GEMMs round the inputs, and
        LlamaForCausalLM builds its layers with float32 compute then)."""
        return self.net.model.config.compute_dtype

    def cache_bytes(self, batch: int, buffer: int) -> int:
        """Bytes of one model's caches of ``batch`` rows and ``buffer`` slots."""
        from msllm.parallel.param_layout import DTYPE_BYTES

        c = self.config
        return 2 * c.num_layers * buffer * batch * c.kv_heads * c.head_dim * DTYPE_BYTES[self.cache_dtype()]

    def lease_cache(self, batch: int, buffer: int):
        """A cache for a run of decode steps: the kept set of this shape, whose decode step holds it
        in the graph (:mod:`msllm.generation.bound_caches`), or a private zero cache when that set
        is in use or past the budget. Give it back with :meth:`release_cache`."""
        return self.kept.lease(batch, buffer) or self.empty_cache(batch, buffer)

    def release_cache(self, caches) -> None:
        """Give back a cache from :meth:`lease_cache` (a private one: nothing happens)."""
        self.kept.release(caches)

    def run(self, kind: str, ids, positions, kpos, slots, caches, beam_idx=None):
        """One call of the compiled step, writing the T new tokens of the B rows of ``ids`` to
        cache ``slots``: (T,) the same in every row, or (B, T) each row its own (the serving
        engine's continuous batch); ``positions`` (B, T) and ``kpos`` (B, S) as
        :mod:`~msllm.models.llama.batch_layout` makes them; numpy in, (logits (B, V) float32
        numpy, caches) out (the same caches, written in place)."""
        import mindspore as ms

        from msllm.models.llama.kv_cache import cache_index

        key = (kind, ids.shape[0], ids.shape[1], kpos.shape[-1])
        new = key not in self.first_call_s
        t0 = time.perf_counter()
        index = cache_index(slots, ids.shape[0])

        def tensors():
            return ms.Tensor(ids), ms.Tensor(positions), ms.Tensor(kpos), ms.Tensor(index)

        if kind in ("prefill", "full"):        # rows attending over their own new tokens only
            logits = self.prefill_step(*tensors(), ms.mutable(caches)).asnumpy()
        else:
            if beam_idx is not None:             # a graph of its own, then the step
                self.reorder_caches(ms.Tensor(beam_idx.astype(np.int32)), ms.mutable(caches)).asnumpy()
            bound = self.kept.cell_for(caches)   # a kept set: the step that holds it, no cache inputs
            if bound is None:
                logits = self.step(*tensors(), ms.mutable(caches)).asnumpy()
            elif self.direct is not None and kind == "decode" and ids.shape[1] == 1 and beam_idx is None:
                # msllm's kernels called on the model's buffers (direct_step.py), checked against the graph
                logits = self.direct.step(ids, positions, kpos, index, caches, lambda: bound(*tensors()).asnumpy())
            else:
                logits = bound(*tensors()).asnumpy()
        if new:
            self.shapes.append(key)
            self.first_call_s[key] = time.perf_counter() - t0
        return logits, caches

    def prefill(self, prompts: Sequence[Sequence[int]], length: int, buffer: int, pad_id: int):
        """Prompts into a fresh cache of ``buffer`` slots, left-padded to ``length``.
        The cache is leased (:meth:`lease_cache`): give it back with :meth:`release_cache`.
        Returns (last-prompt-token logits (B, V), caches, pads (B,))."""
        ids, pads = left_pad(prompts, length, pad_id)
        slots = np.arange(length)
        caches = self.lease_cache(len(prompts), buffer)
        try:
            logits, caches = self.run("prefill", ids, positions_for(pads, slots), key_positions(pads, buffer),
                                      slots, caches)
        except BaseException:
            self.release_cache(caches)
            raise
        return logits, caches, pads

    def decode_step(self, tokens: np.ndarray, slot: int, pads: np.ndarray, buffer: int, caches, beam_idx=None):
        """Feed one token per row (B,) at cache slot ``slot``; returns (logits (B, V), caches)."""
        q = np.array([slot])
        return self.run("decode", tokens.astype(np.int32)[:, None], positions_for(pads, q),
                        key_positions(pads, buffer), q, caches, beam_idx)

    def full_forward(self, sequences: Sequence[Sequence[int]], width: int, pad_id: int) -> np.ndarray:
        """No cache: the whole of each sequence, right-aligned in ``width`` slots, through the
        model; logits (B, V) of each sequence's last token."""
        ids, pads = left_pad(sequences, width, pad_id)
        slots = np.arange(width)
        logits, _ = self.run("full", ids, positions_for(pads, slots), key_positions(pads, width),
                             slots, self.empty_cache(len(sequences), width))
        return logits

    # -- the loop ---------------------------------------------------------------------------
    def layout(self, prompts: Sequence[Sequence[int]], s: DecodeSettings, pad_to: Optional[int] = None,
               buffer: Optional[int] = None):
        """(P padded prompt length, new tokens, S buffer length) for ``prompts``; ``pad_to`` asks
        for a longer P (e.g. the longest prompt of a whole file, so every batch shares graphs),
        ``buffer`` for a longer S (e.g. the whole context window in chat: one decode graph).

        Raises MsllmError for an empty prompt or one that does not fit the context window."""
        if not prompts:
            raise MsllmError("generate: no prompts")
        if any(len(p) == 0 for p in prompts):
            raise MsllmError("generate: a prompt has no tokens (a text prompt starts with BOS; "
                             "token-id prompts need at least one id)")
        longest = max(len(p) for p in prompts)
        max_new = s.new_tokens(longest, self.context)     # HF: max_length counts the padded prompt
        length = max(round_up(longest), pad_to or 0)
        return length, max_new, max(round_up(length + max_new), buffer or 0)

    def generate(self, prompts: Sequence[Sequence[int]], s: DecodeSettings, stream: Optional[StreamFn] = None,
                 pad_to: Optional[int] = None, keep_logits: bool = False,
                 buffer: Optional[int] = None) -> GenerationResult:
        """Continue each prompt (a list of token ids) per ``s``; see the module doc.

        Beam search (``s.num_beams > 1``) goes to :func:`msllm.generation.beam.beam_search`.
        ``stream`` is called after every step with the tokens chosen (finished rows get
        ``pad_token_id``); it may stop every row (True) or some rows (a (B,) bool array), whose
        finish reason is then ``"stop"`` (e.g. a template's stop string appeared).
        """
        if s.num_beams > 1:
            return beam_search(self, prompts, s, pad_to=pad_to, keep_logits=keep_logits, buffer=buffer)
        prompts = [list(map(int, p)) for p in prompts]
        length, max_new, buffer = self.layout(prompts, s, pad_to, buffer)
        b = len(prompts)
        rng = np.random.default_rng(s.seed) if s.do_sample else None
        rows = [RowStep(s, max_new, rng, p) for p in prompts]
        t0 = time.perf_counter()
        passes = Passes(self, prompts, s, length, max_new, buffer)
        try:
            logits = passes.logits
            t_first = None
            steps = 0
            kept = [] if keep_logits else None
            for k in range(max_new):
                if kept is not None:
                    kept.append(logits.copy())
                finished = np.array([r.finished for r in rows])
                tokens = np.where(finished, s.pad_token_id, choose_rows(logits, rows, s, rng))
                for r, tok in zip(rows, tokens):
                    if not r.finished:
                        r.accept(tok)
                if t_first is None:
                    t_first = time.perf_counter()
                finished = np.array([r.finished for r in rows])
                verdict = stream(k, tokens, finished) if stream is not None else None
                if verdict is not None and verdict is not False:
                    stop = np.ones(b, bool) if verdict is True else np.asarray(verdict, bool)
                    for r in np.flatnonzero(stop):
                        rows[r].stop()
                if all(r.finished for r in rows) or k == max_new - 1:
                    break
                steps += 1
                logits = passes.next(k, tokens, lambda: [p + r.tokens for p, r in zip(prompts, rows)])
        finally:
            passes.release()
        t_end = time.perf_counter()
        return GenerationResult([r.tokens for r in rows], [r.reason or "length" for r in rows], None,
                                t_first - t0, t_end - t_first, steps,
                                compiled=list(self.shapes), logits=kept)


def generator_for(net, config=None) -> Generator:
    """The :class:`Generator` of ``net``, made on first use and kept on the network (attribute
    ``_msllm_generator``), so repeated calls reuse the compiled graphs; ``config`` defaults to
    ``net.config``. A ``config`` other than the cached generator's (another context length or
    model settings) makes a new generator instead of being ignored."""
    config = config or net.config
    gen = getattr(net, "_msllm_generator", None)
    if gen is None or gen.config != config:
        gen = Generator(net, config)
        object.__setattr__(net, "_msllm_generator", gen)
    return gen
