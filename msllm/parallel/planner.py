"""Per-device training memory of a LLaMA layout, and layouts that fit a device.

Terms (bytes on the most loaded rank of each pipeline stage):

* **weights**: each rank's parameter slices, from :func:`msllm.parallel.param_layout.param_layouts`
  (the same table the strategy files come from), in ``param_init_type``. With the parallel
  optimizer MindSpore keeps only the 1/N optimizer slice of a sharded weight.
* **weight copies**: the compute-dtype copy of a weight that the forward pass makes and the
  backward pass keeps, ``model-parallel slice * bytes(compute_dtype)``: for an optimizer-sharded
  weight the all-gathered slice (MindSpore casts before the AllGather; kept for backward unless
  ``parallel_optimizer_comm_recompute`` with full recomputation), otherwise the ``Cast`` to
  ``compute_dtype`` when it differs from ``param_init_type`` (inside a fully recomputed decoder
  layer it is recomputed, not kept). An upper bound: MindSpore may free some earlier.
* **gradients**: one gradient per stored weight slice in the parameter dtype (MindSpore's
  ``Cast`` backward returns the parameter dtype); for an optimizer-sharded weight the backward of
  the AllGather is a ReduceScatter, so the gradient is the 1/N slice too. **gradient
  accumulation**: one more buffer of the model-parallel slice when pipelining (MindSpore's
  ``accu_grads``, not sharded at ``optimizer_level: level1``) or with
  ``gradient_accumulation_steps > 1`` (msllm's TrainStep keeps the running sum).
* **optimizer states**: AdamW's two moments per weight slice in fp32, divided by the
  optimizer-shard group size when ``optimizer_shard`` (ZeRO stage 1, Rajbhandari et al. 2020:
  ``2 * 4 * Psi / N_d`` bytes instead of ``2 * 4 * Psi``), from the same layouts.
* **activations** of one micro batch per decoder layer, after Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", sec. 4.1, eq. 1-3): a GPT
  layer in fp16 stores ``s*b*h*(34 + 5*a*s/h)`` bytes; with tensor parallelism t
  ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` and with sequence parallelism
  ``s*b*h*(34 + 5*a*s/h)/t``. Recounted for msllm's LLaMA layer (what its backward pass keeps),
  with e = bytes(compute_dtype), n = bytes(layernorm_compute_type), m = bytes(softmax_compute_type),
  c = e if the softmax dtype differs from the compute dtype else 0, f = ffn size, N = s*b::

      2 RMSNorms      2 (n + e) N h        input in the norm dtype + normalised output
      attention       e N h                q/k/v projection input          (replicated)
                      4 e N h / t          rotated q, repeated k and v (GQA broadcasts k/v to all
                                           h heads before the matmuls), o_proj input
                      a s N (m + c) / t    softmax output (+ its compute-dtype copy); no dropout;
                                           with FlashAttentionScore (``use_flash_attention``,
                                           :mod:`msllm.kernels.select`) instead its softmax_max
                                           and softmax_sum, (B, a, s, 8) fp32 each (MindSpore's
                                           FlashAttentionScore doc): 64 a N / t, no (B, a, s, s)
      SwiGLU MLP      e N h                gate/up input                    (replicated)
                      5 e N f / t          gate, sigmoid, silu, up, silu*up (GeGLU, Gemma: 4, gate,
                                           gelu, up, gelu*up)

  Family switches (:mod:`msllm.models.llama.families`): with an explicit ``head_dim`` D the four
  head-wide tensors are ``N a D`` wide, not ``N h`` (``4 e N a D / t``, a = heads); Qwen3's q/k
  norms keep their inputs and outputs, ``(n + e) N (a + k) D / t`` (k = kv heads); biases keep
  nothing more. A sliding window does not change what is stored: the composed attention still
  forms the whole (B, a, s, s) score tensor and masks it.

  i.e. ``N h [2(n+e) + 2e]/t_sp + N h 4e/t + 5 e N f/t + a s N (m+c)/t`` with ``t_sp = t`` under
  sequence parallelism, else 1. For fp16 everywhere and f = 4h this is
  ``s b h (12/t_sp + 48/t) + 2 a s^2 b/t``: more than Korthikanti's 34 because SwiGLU keeps five
  f-wide tensors where GeLU keeps two, and RMSNorm keeps its normalised output for the weight
  gradient. Full recomputation keeps only the layer input, ``e N h / t_sp`` per layer (Korthikanti
  eq. 4's ``2sbh``), plus one layer's activations while that layer is recomputed; selective
  recomputation drops the attention core ``a s N (m+c)/t`` (Korthikanti sec. 5) and the three
  recomputable SwiGLU tensors ``3 e N f/t``.
* **mixture-of-experts layers** (:mod:`msllm.models.llama.moe`) keep, instead of the SwiGLU
  MLP's ``5 e N f / t``: the router's fp32 probabilities and combine weights ``2 * 4 N E``, and
  for the R rows the experts run on one rank: the gathered input ``e R h``, ``5 e R I / t``
  (I = each expert's width) and the outputs ``e R h`` that the combine weights multiply, plus a
  shared expert's ``5 e N S / t``. R = E N for the dropless dense-over-experts dispatch (every
  expert on every token; with expert_parallel the rank runs E / ep experts on the ep ranks'
  tokens: the same E N), R = E x capacity for the capacity dispatch (``capacity_factor`` > 0,
  training). Full recomputation keeps the layer input only, as for a dense layer; selective
  recomputation drops the three recomputable SwiGLU tensors of every expert.
* **pipeline**: under 1F1B (Narayanan et al. 2021, sec. 2.2.1) stage i holds
  ``min(p - i, micro_batch_num)`` micro batches in flight, so stage 0 holds p micro batches of
  its L/p layers: ``L * per_layer`` as without pipelining (Korthikanti sec. 4.2.3).
* **last stage**: final norm ``(n+e) N h`` + head input ``e N h`` + loss ``4 N V * 2``
  (fp32 log-softmax output kept for backward, and the fp32 logits / their gradient; msllm's loss
  is not vocab-parallel, so V is whole even with a vocab-parallel head) + head output
  ``e N V / t_v`` when the compute dtype is not fp32.
* **constants**: the causal mask ``P^2 * m`` (with FlashAttentionScore its compressed
  (2048, 2048) uint8 mask) and rotary tables ``2 P D e`` (P = max positions).

The fused operators are those the layout path would run on Ascend for the model config
(:func:`msllm.kernels.select.choose` with ``device="Ascend"``).

Micro batch: ``runner_config.batch_size`` samples of one data-parallel rank (MindFormers'
meaning: with pipelining the step is ``micro_batch_num`` micro batches of that size).
Not counted: framework/runtime overhead (workspace, memory-pool fragmentation, communication
buffers, graph-compilation memory); ``benchmarks/planner_vs_measured.py`` measures that gap
on CPU.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Optional, Sequence

from msllm.errors import MsllmError
from msllm.kernels import select
from msllm.models.llama.names import is_optimizer_state
from msllm.parallel.layout_checks import stage_layer_counts, validate_layout
from msllm.parallel.param_layout import DTYPE_BYTES, param_layouts

RECOMPUTE_MODES = ("none", "select", "full")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_memory(text) -> int:
    """``"64GB"`` / ``"58GiB"`` / ``"512MB"`` / a byte count -> bytes (binary units: 1 GB = 2^30,
    as MindSpore's ``max_device_memory``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise MsllmError(f"device memory {text!r}: expected a size such as 64GB, 58GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def recompute_mode(recompute_config) -> str:
    """``"full"`` (recompute), ``"select"`` (select_recompute only) or ``"none"``."""
    if recompute_config is None:
        return "none"
    if recompute_config.recompute:
        return "full"
    return "select" if recompute_config.select_recompute else "none"


def layer_activation_bytes(model_config, micro_batch: int, tp: int = 1, seq_parallel: bool = False,
                           recompute: str = "none", flash_attention: bool = False,
                           moe_layer: bool = False) -> dict[str, float]:
    """Activation bytes one decoder layer keeps for backward, for one micro batch (module docstring).

    ``flash_attention``: the attention core is FlashAttentionScore (no (B, H, T, T) scores kept).
    ``moe_layer``: the layer's MLP is the mixture of experts (module docstring).

    Returns ``{"stored": bytes kept per layer, "full": bytes of the layer without recompute}``.
    """
    mc = model_config
    s, b, h, f, a = mc.seq_length, micro_batch, mc.hidden_size, mc.ffn_size, mc.num_heads
    heads_width = mc.q_size                                   # a * D (= h unless head_dim is explicit)
    e = DTYPE_BYTES[mc.compute_dtype]
    n = DTYPE_BYTES[mc.layernorm_compute_type]
    m = DTYPE_BYTES[mc.softmax_compute_type]
    c = e if mc.compute_dtype != mc.softmax_compute_type else 0
    tsp = tp if seq_parallel else 1
    tokens = s * b
    replicated = tokens * h * (2 * (n + e) + 2 * e) / tsp
    attn_split = tokens * heads_width * 4 * e / tp
    if mc.qk_norm:
        attn_split += tokens * (mc.q_size + mc.kv_size) * (n + e) / tp
    scores = (64 * a * tokens if flash_attention else a * s * tokens * (m + c)) / tp
    mlp_split = (4 if mc.hidden_act == "gelu_pytorch_tanh" else 5) * e * tokens * f / tp
    recomputable = 3 * e * tokens * f / tp
    if moe_layer:
        moe = mc.moe_config
        rows = tokens * moe.expert_num
        if moe.capacity_factor:
            from msllm.models.llama.moe import expert_capacity

            rows = moe.expert_num * expert_capacity(tokens, moe.num_experts_chosen, moe.capacity_factor,
                                                    moe.expert_num)
        shared = moe.shared_expert_intermediate_size
        mlp_split = (8 * tokens * moe.expert_num + 2 * e * rows * h + 5 * e * rows * mc.expert_size / tp
                     + 5 * e * tokens * shared / tp)
        recomputable = 3 * e * (rows * mc.expert_size + tokens * shared) / tp
    full = replicated + attn_split + scores + mlp_split
    if recompute == "full":
        stored = e * tokens * h / tsp
    elif recompute == "select":
        stored = full - scores - recomputable
    elif recompute == "none":
        stored = full
    else:
        raise MsllmError(f"recompute mode {recompute!r}: expected one of {RECOMPUTE_MODES}")
    return {"stored": stored, "full": full}


def uses_flash_attention(model_config) -> bool:
    """True when the layout path on Ascend runs MindSpore's FlashAttentionScore for this config
    (:func:`msllm.kernels.select.choose`; raises its MsllmError for a config it refuses)."""
    return select.choose(model_config, fast_paths=False, device="Ascend").attention == select.ASCEND_FLASH


def _stage_terms(mc, pc, layouts, stage: int, layers: int, micro_batch: int, recompute: str,
                 accum_steps: int, comm_recompute: bool = False, trainable=None) -> dict:
    """Memory terms of one rank of ``stage``; ``trainable``: the names that train (None: all), the
    rest frozen (no gradient, accumulator or moments: LoRA's base)."""
    e = DTYPE_BYTES[mc.compute_dtype]
    pbytes = DTYPE_BYTES[mc.param_init_type]
    weights = states = copies = grads = accum_buf = 0.0
    cast = mc.compute_dtype != mc.param_init_type
    for name, lay in layouts.items():
        if lay.stage != stage or name.startswith("accu_grads."):  # accumulators: accum_buf below
            continue
        if is_optimizer_state(name):
            if trainable is None or name.split(".", 1)[1] in trainable:
                states += lay.slice_numel * 4                 # AdamW moments are fp32
            continue
        mp_numel = math.prod(s // k for s, k in zip(lay.full_shape, lay.mp_strategy))
        nbytes = DTYPE_BYTES[lay.dtype]                       # (LoRA adapters: float32)
        weights += lay.slice_numel * nbytes
        if trainable is None or name in trainable:
            grads += lay.slice_numel * nbytes                 # ReduceScatter'd when optimizer-sharded
            accum_buf += mp_numel * nbytes                    # accu_grads: not sharded (level1)
        in_layer = name.startswith("model.layers.")
        if trainable is not None and name not in trainable and pc.pipeline_stage > 1:
            # a frozen weight under MindSpore's pipeline is copied (TensorMove) into each micro
            # batch's call of the shared model (MindSpore's memory tracker, tiny LoRA rank:
            # docs/dryrun.md); the head's copy is alive at the loss's backward peak
            copies += mp_numel * nbytes
            continue
        if lay.opt_shard_size > 0:                            # all-gathered copy (cast before gather)
            kept = not (in_layer and recompute == "full" and comm_recompute)
        else:                                                 # Cast copy, recomputed with the layer
            kept = cast and not (in_layer and recompute == "full")
        if kept:
            copies += mp_numel * e
    accum = accum_buf if (pc.pipeline_stage > 1 or accum_steps > 1) else 0.0
    tp = pc.model_parallel
    sp = pc.use_seq_parallel and tp > 1
    flash = uses_flash_attention(mc)
    per_layer = layer_activation_bytes(mc, micro_batch, tp, sp, recompute, flash)
    in_flight = min(pc.pipeline_stage - stage, pc.micro_batch_num) if pc.pipeline_stage > 1 else 1
    acts = layers * per_layer["stored"] * in_flight
    if recompute == "full":
        acts += per_layer["full"]                             # the layer being recomputed
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers)) if mc.moe_config is not None else 0
    if moe_layers:   # experts: no pipeline (validate_layout), so this stage holds every layer
        sparse = layer_activation_bytes(mc, micro_batch, tp, sp, recompute, flash, moe_layer=True)
        acts += moe_layers * (sparse["stored"] - per_layer["stored"])
        if recompute == "full":
            acts += max(0.0, sparse["full"] - per_layer["full"])
    tokens = mc.seq_length * micro_batch
    extra = 0.0
    if stage == pc.pipeline_stage - 1:
        n = DTYPE_BYTES[mc.layernorm_compute_type]
        tv = 1 if pc.vocab_emb_dp else tp
        extra = (n + e) * tokens * mc.hidden_size + e * tokens * mc.hidden_size + 8 * tokens * mc.vocab_size
        if e != 4:
            extra += e * tokens * mc.vocab_size / tv
    # the graph's constants: the causal mask and rotary cos/sin of the sequence in use (T = seq_length;
    # built in the graph from the positions, msllm/models/llama/batch_layout.py), or the compressed
    # (2048, 2048) uint8 mask of FlashAttentionScore
    t = mc.seq_length
    mask = 2048 * 2048 if flash else t * t * DTYPE_BYTES[mc.softmax_compute_type]
    consts = mask + 2 * t * mc.head_dim * e
    terms = {"weights": weights, "weight_copies": copies, "gradients": grads, "grad_accumulation": accum,
             "optimizer_states": states, "activations": acts, "head_and_loss": extra, "constants": consts}
    terms["total"] = sum(terms.values())
    terms.update({"stage": stage, "layers": layers, "micro_batches_in_flight": in_flight,
                  "activation_per_layer": per_layer["stored"]})
    return terms


def plan(run_config, device_memory_bytes: Optional[int] = None, stage_layers: Optional[Sequence[int]] = None,
         recompute: Optional[str] = None, layouts: Optional[dict] = None, trainable=None) -> dict:
    """Per-device memory of ``run_config``'s layout.

    Returns ``{"layout": {...}, "stages": [terms per stage], "worst_stage": i, "total": bytes,
    "device_memory": bytes | None, "fits": bool | None, "headroom": bytes | None}``; each stage's
    terms are ``weights, weight_copies, gradients, grad_accumulation, optimizer_states,
    activations, head_and_loss, constants, total`` (bytes) plus ``layers`` and
    ``micro_batches_in_flight``. ``recompute`` overrides the config (``none``/``select``/``full``).
    ``layouts`` / ``trainable``: the parameters (default: the model's) and the names of those that
    train (default: all); LoRA passes its adapters' too and only theirs as trainable
    (:func:`msllm.lora.layout.lora_plan_inputs`): a frozen weight has no gradient, accumulator or
    moments (checked against MindSpore's dry-run, docs/dryrun.md).

    Raises:
        MsllmError: an invalid layout (:func:`validate_layout`).
    """
    mc, pc = run_config.model_config, run_config.parallel_config
    counts = validate_layout(mc, pc, stage_layers=stage_layers)
    mode = recompute or recompute_mode(run_config.recompute_config)
    if mode not in RECOMPUTE_MODES:
        raise MsllmError(f"recompute mode {mode!r}: expected one of {RECOMPUTE_MODES}")
    if layouts is None:
        layouts = param_layouts(mc, pc, stage_layers)
    b = run_config.runner_config.batch_size
    comm_rc = bool(run_config.recompute_config.parallel_optimizer_comm_recompute)
    accum = run_config.runner_config.gradient_accumulation_steps
    stages = [_stage_terms(mc, pc, layouts, s, counts[s], b, mode, accum, comm_rc, trainable)
              for s in range(pc.pipeline_stage)]
    worst = max(range(len(stages)), key=lambda i: stages[i]["total"])
    total = stages[worst]["total"]
    out = {
        "layout": {"data_parallel": pc.data_parallel, "model_parallel": pc.model_parallel,
                   "pipeline_stage": pc.pipeline_stage, "optimizer_shard": pc.optimizer_shard,
                   "micro_batch_num": pc.micro_batch_num, "micro_batch_size": b, "recompute": mode,
                   "use_seq_parallel": pc.use_seq_parallel, "vocab_emb_dp": pc.vocab_emb_dp,
                   "device_num": pc.device_num, "seq_length": mc.seq_length,
                   "compute_dtype": mc.compute_dtype, "param_init_type": mc.param_init_type},
        "parameters": mc.num_params(),
        "stages": stages, "worst_stage": worst, "total": total,
        "device_memory": device_memory_bytes,
        "fits": None if device_memory_bytes is None else total <= device_memory_bytes,
        "headroom": None if device_memory_bytes is None else device_memory_bytes - total,
    }
    return out


def _variant(run_config, dp: int, mp: int, pp: int, opt: bool, recompute: str):
    cfg = copy.deepcopy(run_config)
    pc = cfg.parallel_config
    pc.data_parallel, pc.model_parallel, pc.pipeline_stage, pc.optimizer_shard = dp, mp, pp, opt
    cfg.parallel.enable_parallel_optimizer = opt
    if pp > 1:
        pc.micro_batch_num = max(pc.micro_batch_num, pp)
    cfg.recompute_config.recompute = recompute == "full"
    cfg.recompute_config.select_recompute = recompute == "select"
    return cfg


def suggest_layouts(run_config, device_memory_bytes: int, max_model_parallel: int = 8,
                    limit: int = 10) -> list[dict]:
    """Layouts for the same device count (dp x mp x pp) that fit ``device_memory_bytes``.

    Tries every valid (dp, mp, pp) with mp <= ``max_model_parallel`` (tensor parallelism within
    one 8-device server), optimizer_shard on/off and recompute none/select/full, keeping the micro
    batch size (and ``micro_batch_num = max(config, pp)`` when pipelining). Ordered by expected
    cost: less recomputation, then fewer pipeline stages (bubble), then less model parallelism
    (communication per layer), optimizer sharding preferred. Each entry: ``{"data_parallel",
    "model_parallel", "pipeline_stage", "optimizer_shard", "recompute", "total", "headroom"}``.
    """
    n = run_config.parallel_config.device_num
    found = []
    for mp in range(1, min(n, max_model_parallel) + 1):
        if n % mp:
            continue
        for pp in range(1, n // mp + 1):
            if (n // mp) % pp:
                continue
            dp = n // mp // pp
            for opt in (True, False):
                layouts = None
                for rc in RECOMPUTE_MODES:
                    cfg = _variant(run_config, dp, mp, pp, opt, rc)
                    try:
                        if layouts is None:
                            validate_layout(cfg.model_config, cfg.parallel_config)
                            layouts = param_layouts(cfg.model_config, cfg.parallel_config)
                        p = plan(cfg, device_memory_bytes, layouts=layouts)
                    except MsllmError:
                        break
                    if p["fits"]:
                        found.append({"data_parallel": dp, "model_parallel": mp, "pipeline_stage": pp,
                                      "optimizer_shard": opt, "recompute": rc, "micro_batch_num":
                                      cfg.parallel_config.micro_batch_num, "total": p["total"],
                                      "headroom": p["headroom"]})
    found.sort(key=lambda r: (RECOMPUTE_MODES.index(r["recompute"]), r["pipeline_stage"], r["model_parallel"],
                              not r["optimizer_shard"], r["total"]))
    return found[:limit]


def gib(x: float) -> str:
    return f"{x / (1 << 30):.2f}"


def format_plan(p: dict, suggestions: Optional[list[dict]] = None) -> str:
    """A plain-text table of :func:`plan` (GiB per rank of each stage) and the suggestions."""
    lay = p["layout"]
    lines = [f"layout: dp {lay['data_parallel']} x mp {lay['model_parallel']} x pp {lay['pipeline_stage']} = "
             f"{lay['device_num']} devices; optimizer_shard {lay['optimizer_shard']}; recompute {lay['recompute']}; "
             f"micro batch {lay['micro_batch_size']} x seq {lay['seq_length']}; micro_batch_num "
             f"{lay['micro_batch_num']}; compute {lay['compute_dtype']}, params {lay['param_init_type']}; "
             f"{p['parameters'] / 1e9:.2f}B parameters"]
    keys = ["weights", "weight_copies", "gradients", "grad_accumulation", "optimizer_states", "activations",
            "head_and_loss", "constants", "total"]
    head = ["GiB per device"] + [f"stage {s['stage']} ({s['layers']} layers, {s['micro_batches_in_flight']} mb)"
                                 for s in p["stages"]]
    rows = [[k] + [gib(s[k]) for s in p["stages"]] for k in keys]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if p["device_memory"] is not None:
        verdict = "fits" if p["fits"] else "does NOT fit"
        lines.append(f"worst stage {p['worst_stage']}: {gib(p['total'])} GiB of {gib(p['device_memory'])} GiB "
                     f"device memory -> {verdict} (headroom {gib(p['headroom'])} GiB; framework overhead "
                     "not included)")
    if suggestions is not None:
        if not suggestions:
            lines.append("no layout of this device count fits")
        else:
            lines.append(f"layouts of {lay['device_num']} devices that fit (cheapest first):")
            for s in suggestions:
                lines.append(f"  dp {s['data_parallel']:>3} mp {s['model_parallel']:>2} pp {s['pipeline_stage']:>2} "
                             f"optimizer_shard {str(s['optimizer_shard']):5} recompute {s['recompute']:6} "
                             f"micro_batch_num {s['micro_batch_num']:>3}: {gib(s['total'])} GiB "
                             f"(headroom {gib(s['headroom'])})")
    return "\n".join(lines)


__all__ = ["format_plan", "layer_activation_bytes", "parse_memory", "plan", "recompute_mode",
           "suggest_layouts", "RECOMPUTE_MODES", "stage_layer_counts"]
