"""Converting a loaded :class:`~msllm.models.llama.model.LlamaForCausalLM` to weight-only int8 in
place (:func:`quantize_model`), by the rule and configuration of
:mod:`msllm.models.llama.quantization`: each converted linear layer then holds int8 weights with
float32 scales and multiplies on msllm's ``linear_int8`` kernel (``Linear.use_int8``).
"""

from __future__ import annotations

import logging

import numpy as np

from msllm.errors import MsllmError
from msllm.models.llama.model import Linear
from msllm.models.llama.quantization import QuantizationConfig, quantize_rows

log = logging.getLogger("msllm")


def quantize_model(net, qcfg: QuantizationConfig, kernels) -> dict:
    """Quantize ``net``'s (a loaded :class:`~msllm.models.llama.model.LlamaForCausalLM`) linear layers
    in place, per ``qcfg``; the weights must already be loaded. A tied head gets its own int8 copy of
    the embedding table. Logs one line; returns ``{"layers": n, "int8_bytes": b, "kept": [names]}``.

    Raises:
        MsllmError: no msllm CPU kernels (``kernels`` None: the int8 layer is theirs).
    """
    if kernels is None:
        raise MsllmError("model.model_config.quantization_config (weight-only int8) runs on msllm's CPU kernels "
                         "(the CPU fast path with cpu_kernels not false; build them with "
                         "`python -m msllm.kernels.build`)")
    done, kept, nbytes = 0, [], 0
    for name, cell in list(net.cells_and_names()):
        if not isinstance(cell, Linear) or cell.int8:
            continue
        if not qcfg.converts(name):
            kept.append(name)
            continue
        q, scale, g = quantize_rows(_float_array(cell.weight), qcfg.group)
        cell.use_int8(q, scale, g, kernels)
        done, nbytes = done + 1, nbytes + q.nbytes + scale.nbytes
    if getattr(net, "lm_head", "absent") is None:   # tied head: an int8 copy of the table for the head
        if qcfg.converts("lm_head"):
            table = net.model.embed_tokens.embedding_table
            q, scale, g = quantize_rows(_float_array(table), qcfg.group)
            head = Linear(q.shape[1], q.shape[0], net.config, 0.0, kernels)
            head.use_int8(q, scale, g, kernels)
            net.lm_head = head   # the root cell names its parameters lm_head.weight / lm_head.weight_scale
            done, nbytes = done + 1, nbytes + q.nbytes + scale.nbytes
        else:
            kept.append("lm_head (tied to the embedding table)")
    log.info("quantization_config: %s: %d linear layers in int8 (%.1f MB with scales)%s", qcfg.describe(), done,
             nbytes / 1e6, f"; kept in {net.config.param_init_type}: {', '.join(kept)}" if kept else "")
    return {"layers": done, "int8_bytes": nbytes, "kept": kept}


def _float_array(param) -> np.ndarray:
    """A parameter's values as float32 numpy (bfloat16 widened exactly)."""
    import mindspore as ms

    if param.dtype == ms.bfloat16:
        return param.astype(ms.float32).asnumpy()
    return param.asnumpy().astype(np.float32, copy=False)


__all__ = ["quantize_model"]
