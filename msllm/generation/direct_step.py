"""The CPU decode step launched by msllm itself: msllm's four kernels called on the model's own buffers,
without MindSpore's graph launch around them.

Why: on msllm's CPU kernels a decode step is four operators (embedding, ``msllm_decode_stack``, the final
RMSNorm, the output head) plus about twenty small MindSpore ones (the rotary angles, the mask). Launching
that compiled graph costs MindSpore 2.10 and its Python front about 2 ms per step on SmolLM2-135M (AMD EPYC
Zen 5, ``benchmarks/decode_profile.py``: 19.4 ms per float32 step, 17.2 ms of it in msllm's kernels),
against 0.8 ms for the same graph at hidden size 64: the launch code runs 3-4x slower after each step has
streamed the weights (hundreds of MB) through the caches (``perf`` samples per step of the same
MindSpore and Python code, real model against the hidden-64 one). Here the host computes the small
inputs (the rotary tables, the mask: a few hundred numbers) with numpy and calls the same four kernels
through ctypes on the Parameters' memory (on CPU a Parameter's data is the buffer the graph's kernels
read and write, as ``csrc/decode_fused.cc`` states for the caches).

The compiled graph stays the definition of the step. Each prepared call (rows, slots, cache set) is
checked once against it: its first step runs both, here first, then the graph (which writes the same
key / value rows), and the logits must be equal bit for bit; otherwise the graph serves every later step
of this generator and the log says why. The host's inputs are made as the graph makes them: the rotary
tables by :func:`~msllm.models.llama.rotary.rotary_cos_sin`, the additive mask by
:func:`~msllm.models.llama.batch_layout.host_additive_mask` (the graph's
:func:`~msllm.models.llama.batch_layout.additive_mask` rule, on the host).

Only the graph shape the stacked decode serves is taken (:meth:`DirectDecode.build` says which):
stacked weights with ``msllm_decode_stack``, one attention window for every layer, no embedding
multiplier, a plain final norm, an output head that is the tied table or a bias-free linear (float32,
bfloat16 or weight-only int8). ``MSLLM_DIRECT_DECODE=0`` turns it off (every step through the graph).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

import numpy as np

from msllm.errors import MsllmError

log = logging.getLogger("msllm")
ENV = "MSLLM_DIRECT_DECODE"


def enabled() -> bool:
    """Whether a generator built now may use the direct step: yes unless ``MSLLM_DIRECT_DECODE=0``."""
    return os.environ.get(ENV, "1") != "0"


class _Call:
    """One kernel call on fixed numpy arrays (inputs, then outputs; :func:`msllm.kernels.aot_args`), refilled in
    place between calls."""

    def __init__(self, fn, arrays):
        from msllm.kernels import aot_args

        self.fn, self.arrays = fn, list(arrays)
        self.args, self.keep = aot_args(self.arrays)

    def __call__(self):
        code = self.fn(*self.args)
        if code != 0:
            raise MsllmError(f"direct decode step: kernel {self.fn.__name__} refused its inputs (code {code})")


class _Prepared:
    """The buffers and the four calls of one (rows B, slots S, cache set) step."""

    def __init__(self, owner: "DirectDecode", b: int, s: int, caches):
        o = owner
        c, d = o.hidden, o.head_dim
        self.ids = np.zeros((b, 1), np.int32)
        self.x = np.zeros((b, 1, c), np.float32)
        self.cos = np.zeros((b, 1, 1, d), np.float32)
        self.sin = np.zeros((b, 1, 1, d), np.float32)
        self.mask = np.zeros((b, 1, 1, s), np.float32)
        self.index = np.zeros((1, b), np.int32)
        self.h = np.zeros((b, 1, c), np.float32)
        self.y = np.zeros((b, c), np.float32)
        self.rstd = np.zeros((b,), np.float32)
        w = o.norm_param.asnumpy()              # the final norm's weight (C,): float32 as it lies, or widened
        self.norm_view = w                      # bfloat16 -> float32 at every step, as the graph's cast
        self.norm_w = w if w.dtype == np.float32 else np.zeros(w.shape, np.float32)
        self.logits = np.zeros((b, o.vocab), np.float32)
        self.cache_views = [p.asnumpy() for p in caches]
        self.cache_ptrs = [p.data_ptr() for p in caches]
        self.verified = False
        self.calls = [
            _Call(o.lib.msllm_embedding, [o.view(o.table), self.ids, self.x]),
            _Call(o.lib.msllm_decode_stack, [self.x, self.cos, self.sin, o.attn_scale, self.mask, self.index,
                                             *[o.view(w) for w in o.stack_weights], *self.cache_views, self.h]),
            _Call(o.lib.msllm_rms_norm, [self.h, self.norm_w, o.norm_eps, self.y, self.rstd]),
            _Call(getattr(o.lib, o.head_kernel), [self.y, *[o.view(w) for w in o.head_weights], self.logits]),
        ]


class DirectDecode:
    """The direct decode step of one network (module doc); made by :meth:`build`."""

    def __init__(self, net, lib):
        model = net.model
        self.net, self.lib = net, lib
        self.table = model.embed_tokens.embedding_table
        self.hidden = int(self.table.shape[1])
        self.head_dim = int(net.config.head_dim)
        self.inv_freq = model.inv_freq.asnumpy()[0].astype(np.float32)                  # (D/2,)
        self.rope_factor = float(model.rope_factor)
        self.window = model.windows[0]
        self.attn_scale = model.attn_scale.asnumpy()
        self.stack_weights = model.stacked_decode_weights()        # the graph's own input list
        self.norm_param = model.norm.weight
        self.norm_eps = model.norm.eps_tensor.asnumpy()
        if net.lm_head is None:
            self.head_weights = (self.table,)
            self.head_kernel = "msllm_linear" + ("_bf16math" if net.kernels.bf16_gemms else "")
        elif net.lm_head.int8:
            self.head_weights = net.lm_head.decode_weights()
            self.head_kernel = "msllm_linear_int8"
        else:
            self.head_weights = (net.lm_head.weight,)
            self.head_kernel = "msllm_linear" + ("_bf16math" if net.kernels.bf16_gemms else "")
        self.vocab = int(self.head_weights[0].shape[0])                                   # head (V, C)
        self.params = [self.table, self.norm_param, *self.stack_weights, *self.head_weights]
        self.prepared: dict = {}
        self.failed: Optional[str] = None
        self.steps = 0                 # steps this object served (after each call's checked first)
        self._snapshot()

    # -- eligibility -----------------------------------------------------------------------------
    @staticmethod
    def unsupported(net) -> Optional[str]:
        """Why ``net``'s decode graph is not the shape this step reproduces, or None when it is."""
        import mindspore as ms

        from msllm.models.llama.model import Linear

        if getattr(net, "kernels", None) is None or net.kernels.cpu is None:
            return "not on msllm's CPU kernels"
        model = net.model
        if model.stacked_norms is None or not model.decode_layers_ok():
            return "the decoder layers' weights are not stacked for msllm_decode_stack"
        if len(model.windows) != 1:
            return "layers with different attention windows"
        if model.scale_embed or model.embed_rows is None and model.embed_tokens.embedding_table.dtype != ms.float32:
            return "an embedding multiplier or table dtype the graph treats otherwise"
        if model.norm.fused is None or model.norm.offset != 0.0 or model.norm.weight.dtype not in (ms.float32,
                                                                                                  ms.bfloat16):
            return "the final norm is not msllm's plain RMSNorm"
        if model.mask_dtype != ms.float32 or model.compute_dtype != ms.float32:
            return "a mask or compute dtype other than float32"
        head = net.lm_head
        if head is None:
            if not net.table_as_stored:
                return "the head casts the embedding table"
        elif type(head) is not Linear or head.bias is not None or head.layer_index is not None:
            return "the output head is not a plain bias-free Linear"
        elif not head.int8 and not head.weight_as_stored:
            return "the output head casts its weight"
        return None

    @classmethod
    def build(cls, net) -> Optional["DirectDecode"]:
        """The direct step of ``net`` (a loaded :class:`~msllm.models.llama.model.LlamaForCausalLM`), or
        None (logged once) when ``MSLLM_DIRECT_DECODE=0`` or its decode graph is of another shape."""
        if not enabled():
            log.info("decode steps through MindSpore's graph launch (%s=0)", ENV)
            return None
        why = cls.unsupported(net)
        if why is not None:
            log.info("decode steps through MindSpore's graph launch (the direct step does not apply: %s)", why)
            return None
        from msllm.kernels import library_path

        log.info("decode steps: msllm's kernels called directly on the model's buffers (each shape's first step "
                 "checked against MindSpore's graph; %s=0 turns this off)", ENV)
        return cls(net, ctypes.CDLL(library_path()))

    # -- buffers ---------------------------------------------------------------------------------
    @staticmethod
    def view(p) -> np.ndarray:
        """The numpy view of a Parameter's or Tensor's memory (MindSpore's CPU asnumpy shares it)."""
        return p.asnumpy()

    def _snapshot(self):
        self.ptrs = [p.data_ptr() for p in self.params]

    def _moved(self) -> bool:
        """True when a weight's memory moved since the calls were prepared (``set_data``: a reload)."""
        return [p.data_ptr() for p in self.params] != self.ptrs

    # -- the step --------------------------------------------------------------------------------
    def fill(self, pre: _Prepared, ids, positions, kpos, index):
        """The step's small inputs into ``pre``'s buffers, as the graph computes them (module doc)."""
        from msllm.models.llama.batch_layout import host_additive_mask
        from msllm.models.llama.rotary import rotary_cos_sin

        pre.ids[:] = ids
        if pre.norm_w is not pre.norm_view:
            pre.norm_w[:] = pre.norm_view.astype(np.float32)     # exact: bfloat16 is float32's upper half
        pre.index[:] = index
        pre.cos[:, 0], pre.sin[:, 0] = rotary_cos_sin(positions, self.inv_freq, self.rope_factor)   # (B, 1, D)
        pre.mask[:] = host_additive_mask(kpos, positions[:, :1], self.window)                   # (B, 1, 1, S)

    def step(self, ids, positions, kpos, index, caches, graph_step):
        """Logits (B, V) float32 (a new array) of one decode step: ids / positions (B, 1) int32, kpos (B, S)
        int32, index (1, B) int32 as :meth:`Generator.run` makes them, over ``caches`` (a kept set);
        ``graph_step()`` runs the same step through the compiled graph (the check of a call's first
        step, and every step once a check failed)."""
        if self.failed is not None:
            return graph_step()
        if self._moved():
            self.prepared.clear()
            self._snapshot()
        b, s = kpos.shape
        key = (b, s, id(caches))
        pre = self.prepared.get(key)
        if pre is None or pre.cache_ptrs != [p.data_ptr() for p in caches]:
            why = self.unsupported(self.net)      # the model may have changed since (e.g. adapters wrapped in)
            if why is not None:
                self.failed = why
                log.info("direct decode step off for this model: %s", why)
                return graph_step()
            pre = self.prepared[key] = _Prepared(self, b, s, caches)
        self.fill(pre, ids, positions, kpos, index)
        for call in pre.calls:
            call()
        if pre.verified:
            self.steps += 1
            return pre.logits.copy()
        mine = pre.logits.copy()
        ref = graph_step()
        if ref.shape == mine.shape and np.array_equal(ref, mine):
            pre.verified = True
        else:
            diff = float(np.max(np.abs(ref - mine))) if ref.shape == mine.shape else float("nan")
            self.failed = f"its logits differ from the graph's (max |diff| {diff:.3g}, rows {b}, slots {s})"
            log.warning("direct decode step off for this model: %s; every step goes through the graph", self.failed)
        return ref


__all__ = ["DirectDecode", "enabled", "ENV"]
