"""Each kind of decoder-layer weight stacked over the layers, for inference on msllm's CPU kernels.

msllm's decode step runs every decoder layer in one operator (csrc/decode_fused.cc
``msllm_decode_stack``), which took each layer's weights as inputs of their own: 13 per layer at
float32 / bfloat16, 27 at int8 (a weight is three inputs then), ~400-800 inputs for a 30-layer model.
MindSpore's CPU runtime does work per operator input at every launch; on the AMD EPYC Zen 3 machine
SmolLM2's 30-layer decode step spent 57-92 us per layer outside msllm's kernels, 1.5-2.5 ms of an
18.6 ms int8 step (BENCHMARKS.md, "Where SmolLM2's batch-1 step goes on the AMD EPYC Zen 3").

:func:`stack_decoder_weights` moves each projection's weights into one (L, out, in) Parameter (int8: q
(L, out, in) and scale (L, out, G)) shared by the L layers' :class:`~msllm.models.llama.model.Linear`, which
from then on multiply by their slice where it lies (``Linear.use_stacked``: csrc ``msllm_linear_layer``,
``msllm_linear_int8_layer``), and copies the two norms' weights into (L, C) Parameters (2 x L x C values;
the layers keep theirs for prefill). The decode step then takes each kind once, 17 + 2L inputs with the
caches (31 + 2L at int8; the kernel's second layout). The weights are moved, not copied: the model holds one copy of them
after the call, and while it runs at most one projection's L weights three times (the layers', numpy's
array, MindSpore's copy of it).

Inference only: the stacked weights have no gradient and checkpoints are not written from such a model;
:func:`msllm.generation.loading.load_for_inference` calls this last, after any adapter and quantization.
"""

from __future__ import annotations

import logging

import numpy as np

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor

log = logging.getLogger(__name__)

# the decoder layer's projections, in csrc/decode_fused.cc's stacked order
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def can_stack(model) -> bool:
    """Whether :func:`stack_decoder_weights` applies to ``model`` (a :class:`LlamaModel`): its decode step
    runs as msllm's one decoder-stack operator over plain projections (``decode_layers_ok``: no LoRA wrapper,
    no bias, every layer the fused kind, one mask), it is not stacked yet, and ``MSLLM_STACK_WEIGHTS`` is not
    0 (:meth:`msllm.kernels.ops.CpuKernels.stacked_weights_enabled`)."""
    from msllm.kernels.ops import CpuKernels

    return (CpuKernels.stacked_weights_enabled() and model.stacked_norms is None and model.decode_layers_ok()
            and len(model.layers) > 0)


def _stored(param) -> np.ndarray:
    """A parameter's values as stored, as numpy: bfloat16 as its 16-bit patterns (uint16; numpy has no
    bfloat16), other dtypes as they are."""
    if param.dtype == ms.bfloat16:
        return param.view(ms.uint16).asnumpy()
    return param.asnumpy()


def _stack(params, name: str) -> Parameter:
    """One (L, ...) Parameter of ``params``' values (each (...), one dtype), named ``name``. Built from the
    stored bits (a bfloat16 weight is never widened): the model's memory grows by at most twice the stack's
    bytes while this runs (numpy's array and MindSpore's copy of it), then by the stack's until the layers'
    own weights are dropped (``Linear.use_stacked``)."""
    first = params[0]
    out = None
    for i, p in enumerate(params):
        values = _stored(p)
        if out is None:
            out = np.empty((len(params),) + values.shape, values.dtype)
        out[i] = values
    t = Tensor(out)
    del out
    if first.dtype == ms.bfloat16:
        t = t.view(ms.bfloat16)   # the same bits
    return Parameter(t, name=name, requires_grad=False)


def stack_decoder_weights(model, kernels) -> bool:
    """Stack ``model``'s (a :class:`LlamaModel`) decoder-layer weights over its L layers when
    :func:`can_stack`; returns whether it did. ``kernels``: the model's
    :class:`~msllm.kernels.ops.CpuKernels`.

    Each projection ``p`` becomes one Parameter ``model.layers.stacked.p.weight`` (L, out, in) in the layers'
    dtype (float32, bfloat16 or int8, with int8 ``...weight_scale`` (L, out, G) float32) that every layer's
    ``p`` reads its slice of; the norms' weights are copied into ``model.layers.stacked.{input,post_attention}
    _layernorm.weight`` (L, C). Same products, same bits (tests/models/test_llama_stacked.py).

    Where two layers' weights of one projection differ in dtype or shape (int8 with one layer's
    projection kept in float32: ``modules_to_not_convert``), nothing is stacked (logged): the shapes are
    checked before anything moves.
    """
    if not can_stack(model):
        return False
    layers = list(model.layers)
    projections = {proj: [getattr(getattr(layer, part), proj) for layer in layers] for part, proj in PROJECTIONS}
    for proj, lins in projections.items():   # check every projection before moving any
        kinds = {(lin.weight.dtype, tuple(lin.weight.shape), lin.int8,
                  tuple(lin.weight_scale.shape) if lin.int8 else None) for lin in lins}
        if len(kinds) > 1:
            log.info("decode step: the layers' %s weights differ in dtype or shape (%s): each layer's own weights "
                     "are kept", proj, sorted(map(str, kinds)))
            return False
    for proj, lins in projections.items():
        weight = _stack([lin.weight for lin in lins], f"model.layers.stacked.{proj}.weight")
        scale = None
        if lins[0].int8:
            scale = _stack([lin.weight_scale for lin in lins], f"model.layers.stacked.{proj}.weight_scale")
        for i, lin in enumerate(lins):   # the layers' own weights are dropped here
            lin.use_stacked(weight, scale, i, kernels)
    model.stacked_norms = ParameterTuple((
        _stack([layer.input_layernorm.weight for layer in layers], "model.layers.stacked.input_layernorm.weight"),
        _stack([layer.post_attention_layernorm.weight for layer in layers],
               "model.layers.stacked.post_attention_layernorm.weight")))
    log.info("decode step: the %d decoder layers' weights stacked by kind (one decoder-stack operator input per "
             "kind instead of one per layer; MSLLM_STACK_WEIGHTS=0 keeps them per layer)", len(layers))
    return True
