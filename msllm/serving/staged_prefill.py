"""One request's prompt computed in pieces into a one-row cache of its own: after a cached prefix
(the prefix cache's keys and values copied in first) and/or in chunks between the batch's decode
steps (chunked prefill), on a few fixed graph shapes.

Layout. The row's place in the batch is the ordinary left-padded one
(:mod:`msllm.models.llama.batch_layout`): its n prompt tokens in slots ``pad .. P - 1``,
P = n rounded up to 32, ``pad = P - n``. Here the same block sits ``shift`` slots further on
in the request's own cache (own slot o = batch slot o - ``shift``), so that it ends at slot
L = ``shift`` + P, and the pieces, E tokens each, end there too: piece j covers own slots
``L - q E + j E .. L - q E + (j + 1) E - 1``. The first uncached token is at own slot
``shift + pad + p`` (p cached tokens), and q = ceil((n - p) / E) pieces reach back at least that
far: a piece that starts earlier computes a few cached tokens again (the same keys and values,
rewritten) or padding (hidden: key position -1), so that E takes few values.

Shapes. E = the smallest power of two >= 32 holding the n - p tokens, at most ``chunk`` (the
``--prefill_chunk_size``; 0: no cap); ``shift`` = max(0, q E - P); the own cache has
S = max(512, the next power of two >= L) slots. Each piece runs the model's cached forward
(``LlamaForCausalLM.forward_cached``, not ``fresh``: its queries attend over every visible
slot, the cached prefix and the earlier pieces; on CPU through msllm's ``decode_attention``
kernel with one mask row per query, ``Attention.extend_kernel``) as a graph of shape
(1 row, E tokens, S slots):
for prompts up to 512 tokens E is one of 32, 64, ..., 512 with S = 512; a long prompt's chunks
are (1, chunk, S) for S = 1024, 2048, ... -- the shapes the server warms up
(:meth:`msllm.serving.engine.Engine.warmup`).

The logits of the last piece's last token (the prompt's last) give the row's first token; then
:meth:`copy_into` writes slots ``shift .. shift + P - 1`` into the batch row's slots 0 .. P - 1.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from msllm.generation.passes import pow2_at_least, round_up

MIN_PIECE = 32      # tokens of the smallest piece (the prompt slot multiple)
MIN_SLOTS = 512     # own cache slots at least (msllm.serving.batch.MIN_BUFFER)


def piece_layout(n: int, p: int, chunk: int) -> tuple[int, int, int, int, int]:
    """(E piece tokens, q pieces, shift, L end slot, S own cache slots) for a prompt of ``n``
    tokens whose first ``p`` (0 <= p < n) are cached, pieces of at most ``chunk`` tokens (0: no
    cap); the rule in the module docstring.

    Raises ValueError if p is not in 0 .. n - 1 or ``chunk`` is not 0 or a multiple of 32."""
    if not 0 <= p < n:
        raise ValueError(f"piece_layout: {p} cached tokens of a {n}-token prompt (0 <= p < n)")
    if chunk < 0 or chunk % MIN_PIECE:
        raise ValueError(f"piece_layout: chunk {chunk} must be 0 or a positive multiple of {MIN_PIECE}")
    m = n - p
    e = pow2_at_least(m, MIN_PIECE)
    if chunk:
        e = min(e, chunk)
    q = -(-m // e)
    big_p = round_up(n)
    shift = max(0, q * e - big_p)
    end = shift + big_p
    return e, q, shift, end, pow2_at_least(end, MIN_SLOTS)


def tokens_computed(n: int, p: int, chunk: int) -> int:
    """Slots a prompt of ``n`` tokens with ``p`` cached costs to prefill: a whole prefill's
    ``round_up(n, 32)`` when nothing is cached and no chunking applies, else the pieces' q E
    (:func:`piece_layout`). A cached prefix is used only when it makes this smaller (a short one
    can round the remaining tokens up to a longer piece than the whole prompt)."""
    if p == 0 and not (chunk and n > chunk):
        return round_up(n)
    e, q = piece_layout(n, p, chunk)[:2]
    return q * e


class StagedPrefill:
    """A prompt prefilled piece by piece (module docstring).

    Args:
        gen: the model's :class:`~msllm.generation.decode.Generator`.
        prompt: the n token ids.
        p, kv: cached prefix length and its keys and values (2 * layers, p, K, D) float32 (p = 0: None).
        chunk: most tokens per piece (0: no cap).
        pad_id: fed to padding slots.
        caches: a one-row cache of S slots (:meth:`Generator.empty_cache`), written here; any
            earlier contents are harmless (every slot a query sees is written first).
    """

    def __init__(self, gen, prompt, p: int, kv: Optional[np.ndarray], chunk: int, pad_id: int, caches):
        self.gen, self.prompt, self.p = gen, list(prompt), int(p)
        self.n = len(self.prompt)
        self.e, self.q, self.shift, self.end, self.slots = piece_layout(self.n, self.p, chunk)
        self.big_p = round_up(self.n)
        self.pad = self.big_p - self.n
        self.first = self.shift + self.pad        # own slot of prompt token 0
        self.pad_id = int(pad_id)
        self.caches = caches
        self.done_pieces = 0
        self.logits: Optional[np.ndarray] = None
        if self.p:
            self._write_prefix(kv)

    @property
    def done(self) -> bool:
        return self.done_pieces == self.q

    def _write_prefix(self, kv: np.ndarray) -> None:
        """The cached keys and values into own slots ``first .. first + p - 1`` (in place)."""
        import mindspore as ms
        from mindspore import ops

        from msllm.models.llama.kv_cache import cache_index

        if kv.shape[0] != len(self.caches) or kv.shape[1] != self.p:
            raise ValueError(f"StagedPrefill: cached keys/values of shape {kv.shape} for {len(self.caches)} "
                             f"caches and {self.p} tokens")
        index = ms.Tensor(cache_index(np.arange(self.first, self.first + self.p), 1))       # (p, 1)
        scatter = ops.ScatterUpdate()
        for dst, src in zip(self.caches, kv):
            scatter(dst, index, ms.Tensor(src[:, None], dst.dtype))

    def step(self) -> int:
        """Run the next piece; returns its tokens (E). After the last, :attr:`logits` (V,) holds
        the prompt's last token's logits."""
        from msllm.models.llama.batch_layout import key_positions, positions_for

        start = self.end - (self.q - self.done_pieces) * self.e
        slots = np.arange(start, start + self.e)
        pos = slots - self.first                                   # prompt index, negative on padding
        ids = np.where(pos >= 0, np.asarray(self.prompt, np.int32)[np.clip(pos, 0, self.n - 1)], self.pad_id)
        pads = np.array([self.first])
        logits, _ = self.gen.run("extend", ids.astype(np.int32)[None], positions_for(pads, slots),
                                 key_positions(pads, self.slots), slots, self.caches)
        self.done_pieces += 1
        if self.done:
            self.logits = logits[0]
        return self.e

    def prompt_kv(self, first_token: int, last_token: int) -> np.ndarray:
        """Keys and values (2 * layers, last - first, K, D) float32 of prompt tokens
        ``first_token .. last_token - 1`` (after the last piece)."""
        return read_slots(self.caches, 1, 0, self.first + first_token, self.first + last_token)


def read_slots(caches, width: int, row: int, a: int, b: int) -> np.ndarray:
    """Slots ``a .. b - 1`` of batch row ``row`` of flat caches (S * ``width``, K, D) (one per layer
    and kind) -> (len(caches), b - a, K, D) float32 numpy (a copy)."""
    out = []
    for c in caches:
        rows, k, d = c.shape
        out.append(c.asnumpy().reshape(rows // width, width, k, d)[a:b, row])
    return np.stack(out).astype(np.float32, copy=False)


__all__ = ["StagedPrefill", "piece_layout", "tokens_computed", "read_slots", "MIN_PIECE"]
