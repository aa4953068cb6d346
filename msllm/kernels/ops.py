"""MindSpore operators over msllm's CPU kernels: ``ops.Custom(func_type="aot")`` primitives with
their gradients (``bprop``), built once per process from the compiled library.

MindSpore's AOT custom operators on CPU (``mindspore/ops/operations/custom_ops.py``, class
``Custom``; tutorial "Custom Operators", aot type) call an ``extern "C"`` function of a shared
library with the input and output buffers; ``out_shape`` / ``out_dtype`` infer the outputs and
``bprop(*inputs, out, dout)`` gives the gradient, itself written with other custom operators.
Every operator takes and returns float32 tensors; shapes are in :class:`CpuKernels`.
"""

from __future__ import annotations

import functools
import os

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops
from mindspore.ops import CustomRegOp, DataType


def _same(*dtypes):
    return dtypes[0]


class CpuKernels:
    """The operators of one compiled library (``lib``: path of libmsllm_kernels.so).

    linear(x (..., in), w (out, in) float32 or bfloat16 (inference)) -> x w^T (..., out)          [torch.nn.Linear layout]
    linear_dynamic_rows: the same for x whose leading dimension is known only at run time
    flash_attention(q (B,T,H,D), k (B,T,K,D), v (B,T,K,D), window (1,)) -> (o (B,T,H,D), lse (B,H,T))
        causal softmax(q k^T / sqrt(D)) v, H/K query heads per key/value head, no (B,H,T,T) tensor;
        ``window`` W > 0: query t sees keys t-W+1..t (sliding window), 0: all keys 0..t
    rms_norm(x (..., C), w (C,), eps (1,)) -> (y (..., C), rstd (N,))
    add_rms_norm(a, b (..., C), w (C,), eps (1,)) -> (h = a + b, rmsnorm(h), rstd (N,))
    cross_entropy(logits (N, V), targets (N,) int32) -> (N, 2): per row (nll, logsumexp), nll 0 where
        the target is negative (ignored)
    swiglu(g (..., F), u (..., F)) -> silu(g) * u
    rope(x (B,T,N,D), cos (P,D), sin (P,D)) -> x cos + rotate_half(x) sin over rows 0..T-1 of the tables
    decode_attention(q (B,H,T,D), k (S*B,K,D), v (S*B,K,D), mask (B,1,T,S)) -> softmax(q k^T + mask) v
        (B,H,T,D), H/K query heads per key/value head, each query its own mask row (T = 1: a decode
        step; T > 1: new tokens over a cache); inference only (no gradient)
    flash_attention_docs(q, k, v, window, start (B,T) float32) -> (o, lse): packed rows, query t sees
        keys max(start[b,t], t-W+1)..t (its own document; keys of earlier documents are skipped)
    flash_attention_padded(q, k, v, window, start (B,) float32) -> o (B,T,H,D): causal attention of
        left-padded rows, row b's keys from slot start[b] (a prefill; no gradient)
    embedding(table (V,C) float32 or bfloat16, ids (...) int32) -> (..., C) float32 (inference)
    decode_front(H, K, D)(...) / decode_back(...): one decoder layer's decode step (T = 1) in two
        operators, the cache writes between them (csrc/decode_fused.cc; :meth:`decode_front`,
        ``DecoderLayer.decode_fused`` in msllm/models/llama/model.py); inference only
    decode_stack(x (B,1,C), cos, sin (B,1,1,D), scale (1,), mask (B or 1,1,1,S), index (1,B) int32, then
        per layer its front's and back's weights with its k / v caches, or each kind of weight stacked over
        the L layers followed by the 2L caches) -> (B,1,C): every layer's decode step in one operator, the
        caches written in place (``LlamaModel.decode_layers``; csrc/decode_fused.cc has the two layouts)
    linear_int8(x (..., in) float32, q (out, in) int8, scale (out, G) float32, group (1,) float32)
        -> x (q * scale)^T (..., out) float32: weight-only int8 (inference, no gradient); scale[o, g]
        covers inputs g*group .. (g+1)*group - 1 (csrc/linear_int8.cc)
    linear_layer(x (..., in), w (L, out, in) float32 or bfloat16, layer (1,) int32) -> x w[layer]^T (..., out),
        and linear_int8_layer(x, q (L, out, in) int8, scale (L, out, G), group (1,), layer (1,) int32): the two
        products on one layer's slice of weights stacked over the decoder layers (inference, no gradient;
        with ``gemm_dtype`` bfloat16 ``linear_layer`` rounds x as ``linear`` does)
    grouped_linear(x (M, in), w (E, out, in), offsets (E+1,) float32) -> (M, out): rows
        offsets[g] .. offsets[g+1]-1 times expert g's w[g]^T (the experts' dropless dispatch)
    adamw(p, m, v, g (any shape, N elements), hyper (8,)) -> (1,) 0: MindSpore's AdamWeightDecay rule on
        g * coef, p / m / v written in place; hyper = [lr, beta1, beta2, eps, weight_decay, coef, skip, 0],
        skip != 0 writes nothing (csrc/optim.cc; :class:`msllm.training.adamw.AdamW`); no gradient
    sum_squares(x (...)) -> (1,): sum of x^2 (float32 per chunk, chunks summed in order); no gradient

    ``gemm_dtype``: ``"float32"``, or ``"bfloat16"`` for ``compute_dtype: bfloat16`` in training:
    ``linear`` / ``linear_dynamic_rows`` and their gradients then round each GEMM's two inputs to
    bfloat16 and sum in float32, float32 tensors in and out (``csrc/gemm_bf16.cc``); every other
    operator is the same.
    """

    def __init__(self, lib: str, gemm_dtype: str = "float32"):
        if gemm_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"gemm_dtype {gemm_dtype!r}: expected float32 or bfloat16")
        self.lib = lib
        self.gemm_dtype = gemm_dtype
        lin = "" if gemm_dtype == "float32" else "_bf16math"   # csrc/gemm_bf16.cc's entry points

        def prim(name, out_shape, out_dtype=_same, bprop=None):
            return ops.Custom(f"{lib}:msllm_{name}", out_shape, out_dtype, "aot", bprop=bprop)

        def prim_cpp_infer(name, inputs=(DataType.F32_Default, DataType.F32_Default), bprop=None):
            # output shape from the library's ``msllm_<name>InferShape`` (MindSpore asks it again
            # when an input shape is known only at run time); this path needs the operator's
            # registration info and a fixed output dtype (float32)
            reg = CustomRegOp(f"msllm_{name}_cpu")
            for i in range(len(inputs)):
                reg = reg.input(i, f"x{i}")
            reg = reg.output(0, "y").dtype_format(*inputs, DataType.F32_Default).target("CPU").get_op_info()
            return ops.Custom(f"{lib}:msllm_{name}", None, ms.float32, "aot", bprop=bprop, reg_info=reg)

        # ---- linear: y = x w^T; dx = dy w, dw = dy^T x -----------------------------------------
        linear_dx = prim(f"linear_dx{lin}", lambda dy, w: list(dy[:-1]) + [w[1]])
        linear_dw = prim(f"linear_dw{lin}", lambda dy, x: [dy[-1], x[-1]])

        def linear_bprop(x, w, out, dout):
            return linear_dx(dout, w), linear_dw(dout, x)

        self.linear = prim(f"linear{lin}", lambda x, w: list(x[:-1]) + [w[0]], bprop=linear_bprop)
        # the same with C++ shape inference (csrc/linear.cc) for inputs whose row count is known
        # only at run time (the output head under the compact loss), which a Python infer
        # function cannot serve; kept apart because MindSpore re-infers such operators at every
        # launch
        linear_dx_dyn = prim_cpp_infer(f"linear_dx{lin}")
        linear_dw_dyn = prim_cpp_infer(f"linear_dw{lin}")

        def linear_dyn_bprop(x, w, out, dout):
            return linear_dx_dyn(dout, w), linear_dw_dyn(dout, x)

        self.linear_dynamic_rows = prim_cpp_infer(f"linear{lin}", bprop=linear_dyn_bprop)

        # ---- cross-entropy rows: (nll, lse) per position (csrc/loss.cc) ------------------------
        f32, i32 = DataType.F32_Default, DataType.I32_Default
        ce_grad = prim_cpp_infer("cross_entropy_grad", (f32, f32, i32, f32))

        def ce_bprop(logits, targets, out, dout):
            return ce_grad(dout, logits, targets, out), ops.zeros_like(targets)

        self.cross_entropy = prim_cpp_infer("cross_entropy", (f32, i32), bprop=ce_bprop)

        # ---- causal flash attention ------------------------------------------------------------
        attn_grad = prim("flash_attention_grad", lambda do, q, k, v, w, o, lse: (q, k, v),
                         lambda *d: (d[1], d[2], d[3]))

        def attn_bprop(q, k, v, window, out, dout):
            dq, dk, dv = attn_grad(dout[0], q, k, v, window, out[0], out[1])
            return dq, dk, dv, ops.zeros_like(window)

        self.flash_attention = prim("flash_attention", lambda q, k, v, w: (q, [q[0], q[2], q[1]]),
                                    lambda q, k, v, w: (q, q), bprop=attn_bprop)
        # packed rows: the same with each slot's document start (B, T) float32 (csrc/attention.cc)
        docs_grad = prim("flash_attention_docs_grad", lambda do, q, k, v, w, st, o, lse: (q, k, v),
                         lambda *d: (d[1], d[2], d[3]))

        def docs_bprop(q, k, v, window, start, out, dout):
            dq, dk, dv = docs_grad(dout[0], q, k, v, window, start, out[0], out[1])
            return dq, dk, dv, ops.zeros_like(window), ops.zeros_like(start)

        self.flash_attention_docs = prim("flash_attention_docs", lambda q, k, v, w, st: (q, [q[0], q[2], q[1]]),
                                         lambda q, k, v, w, st: (q, q), bprop=docs_bprop)

        # ---- RMSNorm and residual add + RMSNorm -------------------------------------------------
        norm_grad = prim("rms_norm_grad", lambda dy, x, w, rstd: (x, w), lambda *d: (d[1], d[2]))

        def norm_bprop(x, w, eps, out, dout):
            dx, dw = norm_grad(dout[0], x, w, out[1])
            return dx, dw, ops.zeros_like(eps)

        self.rms_norm = prim("rms_norm", lambda x, w, eps: (x, [_rows(x)]), lambda x, w, eps: (x, x),
                             bprop=norm_bprop)
        add_norm_grad = prim("add_rms_norm_grad", lambda dh, dy, h, w, rstd: (h, w), lambda *d: (d[2], d[3]))

        def add_norm_bprop(a, b, w, eps, out, dout):
            dx, dw = add_norm_grad(dout[0], dout[1], out[0], w, out[2])
            return dx, dx, dw, ops.zeros_like(eps)

        self.add_rms_norm = prim("add_rms_norm", lambda a, b, w, eps: (a, a, [_rows(a)]),
                                 lambda a, b, w, eps: (a, a, a), bprop=add_norm_bprop)

        # ---- SwiGLU and rotary embedding ------------------------------------------------------
        swiglu_grad = prim("swiglu_grad", lambda da, g, u: (g, u), lambda *d: (d[1], d[2]))

        def swiglu_bprop(g, u, out, dout):
            return swiglu_grad(dout, g, u)

        self.swiglu = prim("swiglu", lambda g, u: g, bprop=swiglu_bprop)
        rope_grad = prim("rope_grad", lambda dy, c, s: dy)

        def rope_bprop(x, cos, sin, out, dout):
            return rope_grad(dout, cos, sin), ops.zeros_like(cos), ops.zeros_like(sin)

        self.rope = prim("rope", lambda x, c, s: x, bprop=rope_bprop)

        # ---- grouped linear (experts): dx_g = dy_g w_g, dw_g = dy_g^T x_g (csrc/grouped.cc) ------
        grouped_dx = prim("grouped_linear_dx", lambda dy, w, off: [dy[0], w[2]])
        grouped_dw = prim("grouped_linear_dw", lambda dy, x, off: [off[0] - 1, dy[1], x[1]])

        def grouped_bprop(x, w, off, out, dout):
            return grouped_dx(dout, w, off), grouped_dw(dout, x, off), ops.zeros_like(off)

        self.grouped_linear = prim("grouped_linear", lambda x, w, off: [x[0], w[1]], bprop=grouped_bprop)

        # ---- decoding: one query per row over the key/value cache (csrc/decode.cc), no gradient --
        self.decode_attention = prim("decode_attention", lambda q, k, v, m: q)
        # a batched prefill of left-padded rows (csrc/attention.cc), no gradient
        self.flash_attention_padded = prim("flash_attention_padded", lambda q, k, v, w, start: q)
        # embedding rows from a float32 or bfloat16 table (csrc/decode.cc), float32 out, no gradient
        self.embedding = prim("embedding", lambda table, ids: list(ids) + [table[1]], lambda table, ids: ms.float32)
        # weight-only int8 linear layer (csrc/linear_int8.cc), float32 out, no gradient (inference)
        self.linear_int8 = prim("linear_int8", lambda x, q, s, g: list(x[:-1]) + [q[0]],
                                lambda x, q, s, g: ms.float32)
        # the same two products on slice ``layer`` of a weight stacked over the decoder layers, read where it
        # lies (csrc/linear.cc, csrc/linear_int8.cc; msllm/models/llama/stacked.py), no gradient
        self.linear_layer = prim(f"linear_layer{lin}", lambda x, w, layer: list(x[:-1]) + [w[1]],
                                 lambda x, w, layer: ms.float32)
        self.linear_int8_layer = prim("linear_int8_layer", lambda x, q, s, g, layer: list(x[:-1]) + [q[1]],
                                      lambda x, q, s, g, layer: ms.float32)
        # a decoder layer's decode step in two operators (csrc/decode_fused.cc), no gradient; the
        # front's output shapes need the head counts: decode_front(heads, kv_heads, head_dim)
        self._prim = prim
        self.decode_back = prim("decode_back", lambda x, *rest: x, lambda x, *rest: ms.float32)
        # the whole decoder stack's decode step in one operator (the same code per layer, one launch)
        self.decode_stack = prim("decode_stack", lambda x, *rest: x, lambda x, *rest: ms.float32)
        # the train step's end (csrc/optim.cc): AdamW's update of one parameter, written in place,
        # and a gradient's sum of squares; no gradient
        self.adamw = prim("adamw", lambda p, m, v, g, hyper: [1], lambda *d: ms.float32)
        self.sum_squares = prim("sum_squares", lambda x: [1])

    @functools.lru_cache(maxsize=None)
    def decode_front(self, heads: int, kv_heads: int, head_dim: int):
        """The fused front of a decode step for H = ``heads``, K = ``kv_heads``, D = ``head_dim``
        (csrc/decode_fused.cc): x (B, 1, C), norm weight (C,), eps (1,), the q / k / v weights
        (each ``Linear.decode_weights()``: one tensor, or three for int8), cos, sin (B, 1, 1, D),
        scale (1,) [, k cache, v cache (R, K, D) float32, rows (1, B) int32: k and v also written into
        cache rows ``rows[0, b]`` in place] -> q (B, H, 1, D) rotated and scaled, k (1, B, K, D)
        rotated, v (1, B, K, D)."""
        def shapes(x, *rest):
            b = _rows(x)
            return [b, heads, 1, head_dim], [1, b, kv_heads, head_dim], [1, b, kv_heads, head_dim]

        return self._prim("decode_front", shapes, lambda *d: (ms.float32, ms.float32, ms.float32))

    @staticmethod
    def decode_stack_enabled() -> bool:
        """Whether a model built now runs its decode step's decoder layers as one operator
        (:attr:`decode_stack`, csrc/decode_fused.cc) where every layer can: yes unless the
        environment says ``MSLLM_DECODE_STACK=0`` (two operators per layer then, the same bits;
        for ``benchmarks/decode_gemv_rows_ab.py --var MSLLM_DECODE_STACK --at build`` and the tests that
        compare the two)."""
        return os.environ.get("MSLLM_DECODE_STACK", "1") != "0"

    @staticmethod
    def stacked_weights_enabled() -> bool:
        """Whether :func:`msllm.models.llama.stacked.stack_decoder_weights` stacks a model loaded for
        inference: yes unless the environment says ``MSLLM_STACK_WEIGHTS=0`` (each layer's own weights
        then, the same bits; for the benchmark and the tests that compare the two)."""
        return os.environ.get("MSLLM_STACK_WEIGHTS", "1") != "0"

    @staticmethod
    def window_tensor(window) -> Tensor:
        """The (1,) float32 tensor the flash operators take the sliding window from (0 = none)."""
        return Tensor(np.array([window or 0], np.float32), ms.float32)

    @staticmethod
    def group_tensor(group: int) -> Tensor:
        """The (1,) float32 tensor ``linear_int8`` takes its group size (inputs per scale) from."""
        return Tensor(np.array([group], np.float32), ms.float32)

    @staticmethod
    def eps_tensor(eps: float) -> Tensor:
        """The (1,) float32 tensor the norm operators take their epsilon from."""
        return Tensor(np.array([eps], np.float32), ms.float32)


def _rows(shape) -> int:
    """Product of all but the last dimension (-1 if any is unknown at compile time)."""
    n = 1
    for s in list(shape)[:-1]:
        if s < 0:
            return -1
        n *= s
    return n


@functools.lru_cache(maxsize=None)
def cpu_kernels(lib: str, gemm_dtype: str = "float32") -> CpuKernels:
    """The operators of the library at ``lib`` with ``gemm_dtype`` GEMMs, made once per process."""
    return CpuKernels(lib, gemm_dtype)
