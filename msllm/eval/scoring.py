"""Batched log-likelihood scoring of :class:`~msllm.eval.requests.Row` s over the msllm network.

What one forward pass computes: the decoder over a batch of rows, then the output head and the
log-softmax only at the queried positions (an MMLU question needs one position for its four
answers; lm-evaluation-harness's ``HFLM`` runs the head over every position of the input). Each
query returns ``log p(target)`` and whether the target is the arg-max (the harness's ``is_greedy``).
``dense_head=True`` runs the head and log-softmax over every position first, as ``HFLM`` does, then
picks the queried rows: the same numbers (row-wise log-softmax), the harness's work; it exists for
like-for-like benchmark rows (``tools/evaluate.py --dense_head``), not for use.

Two paths:

* plain: rows of a batch right-padded to the longest (padding after a causal row changes nothing
  before it), ``LlamaModel.construct``;
* shared prefix (opt-in, ``min_prefix > 0``; ``tools/evaluate.py --reuse_prefix``): rows that start
  with the same tokens (one MMLU subject's questions behind the
  same 5-shot examples: ~85% of the tokens) are split at the common prefix; the prefix runs once
  (batch 1) through ``LlamaModel.forward_cached`` into a key/value cache, the cache is repeated
  over the batch and only the suffixes run, attending to the cached prefix. Same numbers up to
  float rounding (different matmul shapes), checked against lm-eval in ``tests/eval``.

In GRAPH mode a cell compiles once per input shape, so shapes are bucketed: batches are padded to
``batch_size`` rows, lengths rounded up to multiples of :data:`LENGTH_MULTIPLE` (plain rows) and
:data:`PREFIX_MULTIPLE` (prefixes), suffixes to powers of two, cache buffers to
:data:`SLOT_MULTIPLE` (5-shot MMLU on 4 subjects compiles 8 graphs). Padding
is placed where no real position attends to it (after a causal row; masked cache slots).

Plan and batches depend only on the rows (:meth:`Scorer.plan`), so data-parallel ranks can split
the work items and still produce bit-identical numbers per request (:mod:`msllm.eval.dist`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from msllm.eval.requests import Row, plan_units
from msllm.generation.passes import pow2_at_least

LENGTH_MULTIPLE = 64     # plain rows
PREFIX_MULTIPLE = 128    # shared prefixes
SUFFIX_MIN = 32          # suffixes: powers of two from this
SLOT_MULTIPLE = 512      # cache buffers (extra slots are masked; coarse, so few graphs compile)


def query_bucket(n: int, cap: int) -> int:
    """The number of queried positions a batch's graph is compiled for: ``n`` rounded up to 16, 24, 32, 48,
    64, 96, ... (two sizes per octave, so at most half the head's rows are padding, about a fifth on
    average), at most ``cap`` and at least ``n``. Every distinct count is a graph shape: unrounded, a
    perplexity evaluation compiled one graph per batch (each batch has its own number of label tokens;
    37 batches of 16 took 62 s at the first evaluation of tests/training's tiny run, 2.3 s once compiled)."""
    r = 16
    while r < n:
        r = r * 3 // 2 if r & (r - 1) == 0 else r * 4 // 3
    return max(n, min(r, cap))


def round_up(n: int, multiple: int, cap: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (at most ``cap`` when given, and at least n)."""
    r = -(-n // multiple) * multiple
    return max(n, min(r, cap)) if cap else r


def _score_cell_class():
    from mindspore import nn, ops

    class QueryScores(nn.Cell):
        """Log-probabilities and greedy ids at queried positions.

        ``construct(self, tokens (B, T) int32, rows (N,) int32 flat indices into B*T, targets (N,)
        int32)`` -> (logp (N,) float32, argmax (N,) int32). ``dense``: head and log-softmax over all
        B*T positions (a (B*T, V) float32 buffer), then the N rows picked.
        """

        def __init__(self, net, dense=False):
            super().__init__(auto_prefix=False)  # keep the network's parameter names (training saves them after)
            self.net = net
            self.dense = bool(dense)
            self.gather = ops.Gather()
            self.log_softmax = ops.LogSoftmax(-1)
            self.gather_d = ops.GatherD()
            self.argmax = ops.Argmax(-1, output_type=ms_int32())

        def pick(self, hidden, rows, targets):
            c = hidden.shape[-1]
            if self.dense:   # HFLM's work: every position through the head, then the queried rows
                every = self.log_softmax(self.net.head(hidden.reshape((-1, c)), True))   # (B*T, V) float32
                logp = self.gather(every, rows, 0)                                    # (N, V)
            else:
                h = self.gather(hidden.reshape((-1, c)), rows, 0)                 # (N, C)
                logp = self.log_softmax(self.net.head(h, True))                    # (N, V) float32
            return self.gather_d(logp, 1, targets.reshape((-1, 1))).reshape((-1,)), self.argmax(logp)

        def construct(self, tokens, rows, targets):
            return self.pick(self.net.model(tokens), rows, targets)

    class CachedQueryScores(QueryScores):
        """As :class:`QueryScores` for suffixes over a cached prefix: ``construct(self, tokens (B, T),
        positions (B, T), key_positions (1, S), index (T, B) cache rows, caches, rows, targets)``."""

        def construct(self, tokens, positions, key_positions, index, caches, rows, targets):
            hidden = self.net.model.forward_cached(tokens, positions, key_positions, index, caches)
            return self.pick(hidden, rows, targets)

    class Prefill(nn.Cell):
        """``construct(self, tokens (1, P), positions, key_positions, index (P, 1), caches)``: writes the
        prefix's keys and values into the caches (in place); returns the last hidden row (1, C)."""

        def __init__(self, net):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, tokens, positions, key_positions, index, caches):
            return self.net.model.forward_cached(tokens, positions, key_positions, index, caches)[:, -1]

    return QueryScores, CachedQueryScores, Prefill


def ms_int32():
    import mindspore as ms

    return ms.int32


@dataclass(frozen=True)
class WorkItem:
    """A unit of work: ``rows`` (indices) scored together; ``prefix`` > 0: through a cached prefix
    of that many tokens. ``cost`` is the number of tokens run (for balancing ranks)."""

    rows: tuple
    prefix: int
    cost: int


class Scorer:
    """Scores rows with an msllm ``LlamaForCausalLM``.

    Args:
        net: the network (weights loaded); used in inference only.
        batch_size: rows per forward pass.
        pad_id: id used to pad rows (never attended to by a real position).
        max_batch_tokens: cap on batch rows x padded length (and on queried positions), which bounds
            the (N, vocab) log-softmax buffer.
        min_prefix: shortest common prefix (tokens) worth caching; 0 disables prefix reuse.
        set_eval: put ``net`` in inference mode (``set_train(False)``); False leaves a network that
            is being trained as it is (the model has no dropout: the mode changes no number).
        dense_head: the output head at every position, as lm-eval's ``HFLM`` (module docstring).
    """

    def __init__(self, net, batch_size: int = 8, pad_id: int = 0, max_batch_tokens: int = 8192,
                 min_prefix: int = 32, set_eval: bool = True, dense_head: bool = False):
        plain, cached, prefill = _score_cell_class()
        self.net = net
        self.cfg = net.config
        self.batch_size = max(1, int(batch_size))
        self.pad_id = int(pad_id)
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.min_prefix = int(min_prefix)
        self.max_positions = self.cfg.max_positions
        if set_eval:
            net.set_train(False)
        self.dense_head = bool(dense_head)
        self.plain, self.cached, self.prefill = plain(net, dense_head), cached(net, dense_head), prefill(net)

    # ---- planning -------------------------------------------------------------------------
    def _batches(self, order: Sequence[int], lengths: Sequence[int], queries: Sequence[int]) -> list[list[int]]:
        """Consecutive chunks of ``order`` (longest first) within batch_size and max_batch_tokens."""
        out, cur, width, nq = [], [], 0, 0
        for i in order:
            w = max(width, lengths[i])
            if cur and (len(cur) >= self.batch_size or w * (len(cur) + 1) > self.max_batch_tokens
                        or nq + queries[i] > self.max_batch_tokens):
                out.append(cur)
                cur, w, nq = [], lengths[i], 0
            cur.append(i)
            width, nq = w, nq + queries[i]
        if cur:
            out.append(cur)
        return out

    def plan(self, rows: Sequence[Row]) -> list[WorkItem]:
        """Work items covering every row once: one per shared-prefix group, one per plain batch
        (rows sorted longest first, as the harness batches)."""
        items, plain = [], []
        units = plan_units(rows, self.min_prefix, 4 * self.batch_size) if self.min_prefix > 0 else \
            [(0, [i]) for i in range(len(rows))]
        for prefix, idx in units:
            if prefix > 0:
                cost = prefix + sum(len(rows[i].tokens) - prefix for i in idx)
                items.append(WorkItem(tuple(idx), prefix, cost))
            else:
                plain.extend(idx)
        lengths = [len(r.tokens) for r in rows]
        nq = [sum(len(p) for _, p, _ in r.queries) for r in rows]
        plain.sort(key=lambda i: (-lengths[i], rows[i].tokens))
        for batch in self._batches(plain, lengths, nq):
            items.append(WorkItem(tuple(batch), 0, max(lengths[i] for i in batch) * len(batch)))
        return items

    # ---- running --------------------------------------------------------------------------
    def run(self, rows: Sequence[Row], items: Sequence[WorkItem],
            progress: Callable[[int], None] | None = None) -> dict:
        """Score the rows of ``items``: ``{query index: (logp per target float32 array, greedy bool
        array)}``. ``progress(n)`` is called with the number of queries finished."""
        out: dict = {}
        for item in items:
            if item.prefix > 0:
                self._run_prefixed(rows, item, out)
            else:
                self._run_plain(rows, list(item.rows), out)
            if progress is not None:
                progress(sum(len(rows[i].queries) for i in item.rows))
        return out

    @staticmethod
    def _collect(rows, batch, out, logp, greedy):
        """Split the flat (N,) outputs of a batch back into its queries, in query order."""
        k = 0
        for i in batch:
            for qi, pos, tgt in rows[i].queries:
                n = len(pos)
                out[qi] = (logp[k:k + n].copy(), greedy[k:k + n] == np.asarray(tgt))
                k += n

    def _flat_queries(self, rows, batch, width, shift):
        """(flat positions (M,) int32, targets (M,) int32) of the batch's queries, padded with position 0 and
        target 0 to M = :func:`query_bucket` of their number (the padded entries' outputs are never read:
        :meth:`_collect` takes the first ones in query order)."""
        flat, tgts = [], []
        for b, i in enumerate(batch):
            for _, pos, tgt in rows[i].queries:
                flat.extend(b * width + p - shift for p in pos)
                tgts.extend(tgt)
        m = query_bucket(len(flat), max(len(flat), self.max_batch_tokens))
        return (np.asarray(flat + [0] * (m - len(flat)), np.int32),
                np.asarray(tgts + [0] * (m - len(tgts)), np.int32))

    def _run_plain(self, rows, batch, out) -> None:
        from mindspore import Tensor

        width = round_up(max(len(rows[i].tokens) for i in batch), LENGTH_MULTIPLE, self.max_positions)
        n_rows = self.batch_size
        tokens = np.full((n_rows, width), self.pad_id, np.int32)
        for b, i in enumerate(batch):
            tokens[b, :len(rows[i].tokens)] = rows[i].tokens
        flat, tgts = self._flat_queries(rows, batch, width, 0)
        logp, greedy = self.plain(Tensor(tokens), Tensor(flat), Tensor(tgts))
        self._collect(rows, batch, out, logp.asnumpy(), greedy.asnumpy())

    def _run_prefixed(self, rows, item: WorkItem, out) -> None:
        import mindspore as ms
        from mindspore import Tensor, ops

        from msllm.models.llama.kv_cache import as_cache, cache_index, empty_cache

        p = item.prefix
        idx = sorted(item.rows, key=lambda i: (-len(rows[i].tokens), rows[i].tokens))
        lengths = {i: len(rows[i].tokens) - p for i in idx}
        nq = {i: sum(len(q) for _, q, _ in rows[i].queries) for i in idx}
        batches = self._batches(idx, lengths, nq)
        # prefix padded to pb tokens (pad slots p..pb-1 are overwritten by suffixes or masked);
        # suffixes of a batch padded to t tokens; s cache slots hold both
        pb = round_up(p, PREFIX_MULTIPLE, self.max_positions)
        longest = pow2_at_least(max(lengths.values()), SUFFIX_MIN)
        s = round_up(max(pb, p + longest), SLOT_MULTIPLE)
        c = self.cfg
        caches = empty_cache(1, c.kv_heads, s, c.head_dim, c.num_layers)
        prefix = np.full((1, pb), self.pad_id, np.int32)                 # (1, Pb)
        prefix[0, :p] = rows[idx[0]].tokens[:p]
        # slot = position here: prefix token j in slot j, suffix token j in slot p + j (pad slots
        # p..pb-1 of the prefix are overwritten by the suffixes, or after every query: unseen)
        kpos = np.arange(s, dtype=np.int32)[None]                              # (1, S)
        self.prefill(Tensor(prefix), Tensor(np.arange(pb, dtype=np.int32)[None]), Tensor(kpos),
                     Tensor(cache_index(np.arange(pb), 1)), ms.mutable(caches))          # token j -> slot j
        for batch in batches:
            t = min(pow2_at_least(max(lengths[i] for i in batch), SUFFIX_MIN), self.max_positions - p)
            n_rows = self.batch_size
            tokens = np.full((n_rows, t), self.pad_id, np.int32)
            for b, i in enumerate(batch):
                tokens[b, :lengths[i]] = rows[i].tokens[p:]
            positions = np.broadcast_to(np.arange(p, p + t, dtype=np.int32), (n_rows, t)).copy()
            # the prefix's cache repeated over the batch: the suffixes write their own copy
            kd = caches[0].shape[1:]
            tiled = as_cache(ops.tile(x.reshape((s, 1) + kd), (1, n_rows, 1, 1)).reshape((s * n_rows,) + kd)
                             for x in caches)                                     # (S * B, K, D)
            index = cache_index(p + np.arange(t), n_rows)
            flat, tgts = self._flat_queries(rows, batch, t, p)
            logp, greedy = self.cached(Tensor(tokens), Tensor(positions), Tensor(kpos), Tensor(index),
                                       ms.mutable(tiled), Tensor(flat), Tensor(tgts))
            self._collect(rows, batch, out, logp.asnumpy(), greedy.asnumpy())


def scorer_for(net, batch_size: int = 8, pad_id: int = 0, min_prefix: int = 32, set_eval: bool = True,
               dense_head: bool = False) -> Scorer:
    """The :class:`Scorer` of ``net`` for these settings, made once and kept on the network, so
    repeated evaluations (several tasks, evaluation during training) reuse its compiled graphs."""
    cache = getattr(net, "_msllm_scorers", None)
    if cache is None:
        cache = {}
        object.__setattr__(net, "_msllm_scorers", cache)
    key = (int(batch_size), int(pad_id), int(min_prefix), bool(dense_head))
    if key not in cache:
        cache[key] = Scorer(net, batch_size=batch_size, pad_id=pad_id, min_prefix=min_prefix, set_eval=set_eval,
                            dense_head=dense_head)
    return cache[key]


def score_rows(scorer: Scorer, rows: Sequence[Row], rank: int = 0, world_size: int = 1,
               progress: Callable[[int], None] | None = None) -> dict:
    """Score ``rows`` over ``world_size`` data-parallel ranks (this is rank ``rank``).

    Returns, identical on every rank, ``{query index: float64 array [sum of log-probabilities,
    1.0 if every target is the arg-max else 0.0, number of targets]}``; the sums run in float64
    over the float32 log-probabilities in target order, so they do not depend on the rank split.
    """
    from msllm.eval.dist import all_gather_records, assign

    items = scorer.plan(rows)
    owner = assign([it.cost for it in items], world_size)
    mine = [it for it, r in zip(items, owner) if r == rank]
    raw = scorer.run(rows, mine, progress)
    local = {qi: [float(np.sum(lp.astype(np.float64))), float(bool(np.all(g))), float(lp.size)]
             for qi, (lp, g) in raw.items()}
    return all_gather_records(local, world_size)
