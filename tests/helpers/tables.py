"""References for the batch layout: the visibility rule in float64 numpy (written from its
statement in msllm.models.llama.batch_layout's docstring, not from its code), and the training
graph's rotary tables and causal mask for T positions as constant tensors, for tests that call
one layer on its own."""

import numpy as np


def reference_mask(kpos, qpos, window=None) -> np.ndarray:
    """(B, 1, T, S) float64 additive mask: query t of row b (position qpos[b, t]) sees slot s iff
    the slot holds a token (kpos[b, s] >= 0) at or before the query's position and, with a window
    W, fewer than W positions before it (transformers' sliding_window_overlay: q - W < k <= q);
    0 where seen, -1e9 elsewhere."""
    kpos, qpos = np.asarray(kpos, np.float64), np.asarray(qpos, np.float64)
    b = max(kpos.shape[0], qpos.shape[0])
    out = np.full((b, 1, qpos.shape[1], kpos.shape[1]), -1e9)
    for r in range(b):
        kr, qr = kpos[min(r, len(kpos) - 1)], qpos[min(r, len(qpos) - 1)]
        for t, q in enumerate(qr):
            for s, k in enumerate(kr):
                if 0 <= k <= q and (window is None or k > q - window):
                    out[r, 0, t, s] = 0.0
    return out


def training_tables(config, t: int):
    """(cos (T, D), sin (T, D), additive mask (T, T)) MindSpore tensors of ``config`` for
    positions 0..T-1 (compute dtype; mask in the softmax dtype)."""
    from mindspore import Tensor

    from msllm.models.llama.model import ms_dtype
    from msllm.models.llama.rotary import rotary_tables

    cos, sin = rotary_tables(config, np.arange(t))
    pos = np.arange(t)[None]
    mask = reference_mask(pos, pos, config.sliding_window)[0, 0]
    dtype = ms_dtype(config.compute_dtype)
    return Tensor(cos, dtype), Tensor(sin, dtype), Tensor(mask.astype(np.float32), ms_dtype(config.softmax_compute_type))
