"""Setting up a training run from a :class:`RunConfig`: the process group, the data, the network
(LoRA, layouts, recompute), the optimizer and train step, and the weights it starts from.

Order matters: the process group is joined first (``setup_runtime``), before any weight is
allocated, so a failing launch fails fast and a CPU scheduler process does no model work.
:func:`prepare` builds; :func:`load_start` loads (resume, fine-tune base, HF directory, resharded
checkpoint); :mod:`msllm.training.loop` runs the steps; :mod:`msllm.training.trainer` ties them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from msllm.cluster.context import Runtime, setup_logging, setup_runtime
from msllm.config import RunConfig, save_config
from msllm.errors import MsllmError
from msllm.settings import log_settings
from msllm.training import checkpoint as ckpt
from msllm.training.control import RankAgreement
from msllm.training.monitor import LossMonitor
from msllm.training.schedule import build_schedule
from msllm.training.throughput import device_peak_tflops, throughput_for_run

log = logging.getLogger("msllm")


def build_optimizer(network, cfg: RunConfig, lr_per_step: np.ndarray):
    """msllm's AdamW (:class:`msllm.training.adamw.AdamW`, MindSpore's ``nn.AdamWeightDecay`` rule)
    over ``network``'s trainable parameters; decay on matrices only (ndim >= 2).
    ``optimizer.type: FP32StateAdamWeightDecay`` keeps the moments in float32 whatever the
    parameters' dtype (MindFormers' class of that name); ``AdamW`` / ``AdamWeightDecay`` keep them in
    the parameters' dtype (MindSpore's ``nn.AdamWeightDecay``). ``lr_per_step``: (steps,) float32.
    When the model runs on msllm's CPU kernels, the update does too (``AdamW.cpu_update``: the same
    rule in one pass per parameter with the clip factor folded in, csrc/optim.cc); which update runs
    is logged."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.training.adamw import AdamW

    params = network.trainable_params()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    o = cfg.optimizer
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = AdamW(
        [g for g in groups if g["params"]],  # MindSpore refuses an empty group (LoRA: matrices only)
        learning_rate=Tensor(lr_per_step), beta1=float(o.betas[0]), beta2=float(o.betas[1]), eps=o.eps,
        state_dtype=ms.float32 if o.type == "FP32StateAdamWeightDecay" else None,
        cpu_kernels=model_cpu_kernels(network))
    log.info("optimizer: %s", "AdamW update and gradient norms on msllm's CPU kernels (one pass per parameter)"
             if optimizer.cpu_kernels is not None else
             f"MindSpore's AdamWeightDecay ({optimizer.cpu_update_note})")
    return optimizer


def model_cpu_kernels(network):
    """The CPU kernels (:class:`msllm.kernels.ops.CpuKernels`) the LLaMA model inside ``network``
    (the model itself, or a LoRA / DPO / pipeline wrapper around it) was built with, or None:
    the optimizer uses them when the model does (config key ``cpu_kernels``)."""
    from msllm.kernels.select import KernelChoice

    for _, cell in network.cells_and_names():
        choice = getattr(cell, "kernels", None)
        if isinstance(choice, KernelChoice):
            return choice.cpu
    return None


def build_train_step(network, optimizer, cfg: RunConfig, rt: Runtime, packed: bool = False):
    """The graph-mode train step (loss scale, clipping, data-parallel gradient all-reduce);
    ``packed``: a pipelined step takes the packed rows' ``actual_seq_len`` as its third input
    (the unpipelined step takes it whenever it is given)."""
    from mindspore import nn

    from msllm.training.step import TrainStep

    if cfg.parallel_config.pipeline_stage > 1:  # PipelineCell + PipelineGradReducer (training/pipeline.py)
        from msllm.training.pipeline import build_pipeline_train_step

        return build_pipeline_train_step(network, optimizer, cfg, packed)
    rw = cfg.runner_wrapper
    reducer = None
    # data parallel: msllm all-reduces gradients itself; semi-auto parallel: MindSpore inserts
    # the collectives the layout implies
    if rt.world_size > 1 and cfg.parallel.mode_name == "data_parallel":
        reducer = nn.DistributedGradReducer(optimizer.parameters, mean=cfg.parallel.gradients_mean,
                                            degree=rt.world_size)
    step = TrainStep(network, optimizer, loss_scale=rw.loss_scale, scale_sense=rw.scale_sense,
                     scale_factor=rw.scale_factor, scale_window=rw.scale_window,
                     max_grad_norm=rw.max_grad_norm if rw.use_clip_grad else None,
                     accum_steps=cfg.runner_config.gradient_accumulation_steps, grad_reducer=reducer,
                     # CPU keeps the branch; Ascend's O0/O1 backend cannot build it (step.py)
                     branch_free_skip=cfg.context.device_target != "CPU")
    step.set_train()
    return step


def peak_tflops(cfg: RunConfig, world_size: int) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device, how it was obtained): ``context.peak_tflops`` if set, else the
    device's documented (Ascend) or computed (CPU: cores x FMA units x SIMD lanes x 2 x clock)
    peak, the same on every rank (:func:`msllm.training.throughput.device_peak_tflops`). On CPU the
    host's peak is shared by the ranks on this host: ``DEVICE_NUM`` (set by run_distribute.sh),
    checked against the communication group's size ``world_size``, else ``world_size``. Under
    ``compute_dtype: bfloat16`` on CPU: the peak of the unit its bfloat16 GEMMs run on
    (:func:`msllm.training.throughput.bf16_gemm_peak`).

    Raises MsllmError: ``DEVICE_NUM`` is not an integer in [1, world_size] (a stale value would
    multiply every MFU by it)."""
    raw = os.environ.get("DEVICE_NUM")
    local = world_size
    if cfg.context.device_target == "CPU" and raw:
        if not raw.isdigit() or not 1 <= int(raw) <= world_size:
            raise MsllmError(f"environment DEVICE_NUM={raw!r} does not fit this job of {world_size} rank(s) (expected "
                             f"1..{world_size}: the ranks started on this host); unset it or launch with "
                             "scripts/run_distribute.sh, which sets it")
        local = int(raw)
    bf16_gemms = None
    if cfg.context.device_target == "CPU" and cfg.model_config.compute_dtype == "bfloat16":
        from msllm import kernels   # bf16 compute on CPU runs on msllm's kernels (select.check_bf16_compute)

        bf16_gemms = kernels.gemm_bf16_native()
    return device_peak_tflops(cfg.context.device_target, cfg.context.peak_tflops, ranks_on_host=local,
                              bf16_gemms=bf16_gemms)


def load_resharded(network, step_cell, cfg: RunConfig, rt: Runtime, out: str, data) -> str:
    """``auto_trans_ckpt``: reshard ``load_checkpoint`` (full, or sharded per
    ``src_strategy_path_or_dir``) to this rank's slice of the run's layout and load it.

    With data parallel the slice is the whole model, loaded like any checkpoint. With operator
    sharding (Ascend) the parameters only take their sliced shapes once the step is compiled,
    so the step is compiled on the first batch first (MindSpore's ``load_distributed_checkpoint``
    flow); that path cannot compile on CPU and is unverified here.
    """
    from msllm.parallel.reshard import reshard_for_start

    path = reshard_for_start(cfg.load_checkpoint, cfg.src_strategy_path_or_dir or None, cfg, rt.rank,
                             os.path.join(out, "transformed_checkpoint"))
    params = ckpt.load_params(path)
    if cfg.parallel.mode_name == "data_parallel":
        ckpt.load_into(network, params, path)
    else:
        step_cell.compile(*next(data.epoch_batches(0)))   # (input_ids, labels[, actual_seq_len])
        ckpt.load_into_strict_after_compile(network, params, path)
    log.info("auto_trans_ckpt: resharded %s to this rank's layout: %s", cfg.load_checkpoint, path)
    return path


@dataclass
class TrainRun:
    """Everything a run's loop needs, built once by :func:`prepare` (one rank's view).

    ``data``: :class:`msllm.data.dataset.TrainData`; ``meta``: its first file's MindRecord sidecar;
    ``spe``: steps per epoch on this rank; ``lr``: float32 learning rate per optimizer step,
    shape (total_steps,); ``lora``: :class:`msllm.lora.training.LoraTraining` or None; ``sharded``:
    operator sharding / pipeline (semi-auto parallel, Ascend only), else data parallel.
    """

    cfg: RunConfig
    rt: Runtime
    out: str
    data: Any
    meta: dict
    spe: int
    total_steps: int
    epochs: int
    network: Any
    lora: Any
    optimizer: Any
    step_cell: Any
    lr: np.ndarray
    agree: RankAgreement
    n_params: int
    sharded: bool
    dpo_reference: str = ""   # DPO full fine-tune: the starting weights (recorded in every checkpoint's manifest)
    dpo_eval_ref: Optional[np.ndarray] = None   # dpo.precompute_ref with do_eval: held-out pairs' (N, 2) reference


def build_network(cfg: RunConfig, rt: Runtime, sharded: bool, load_base: bool = True, packed: bool = False):
    """The training network of ``cfg`` on this rank: (``LlamaForCausalLM``, ``LoraTraining`` or None).

    LoRA adapters (the frozen base loaded from ``load_checkpoint`` by ``LoraTraining``, unless
    ``load_base`` is False: the dry-run compiles it without reading a base); with
    ``sharded`` the layout's shard strategies, stages and recompute (Ascend only), else recompute
    and, for experts under data parallel, the global-batch router counts
    (:func:`msllm.parallel.apply.apply_data_parallel_moe`); experts return their router stats
    for the log. ``packed``: the rows will hold several documents (``actual_seq_len``), which
    the layout's rotary and mask strategies follow."""
    from msllm.models.llama.model import LlamaForCausalLM

    mc = cfg.model_config
    network = LlamaForCausalLM(mc, fast_paths=cfg.fast_paths, device=cfg.context.device_target)
    lora = None
    if cfg.pet_config is not None:  # LoRA: base from load_checkpoint, frozen; adapters trainable
        from msllm.lora.training import LoraTraining

        lora = LoraTraining(network, cfg, rt.rank, load_base=load_base)
    if sharded:  # shard strategies, stages and recompute from parallel_config (Ascend only)
        from msllm.parallel.apply import apply_layout
        from msllm.parallel import stage_split
        from msllm.training import pipeline

        pc = cfg.parallel_config
        # contiguous stage split per MindFormers' offset (interleaved chunks: assign_stages below)
        stage_layers = stage_split.stage_layers_of(mc, pc.pipeline_stage) if mc.pp_interleave_num == 1 else None
        apply_layout(network, pc, cfg.recompute_config, stage_layers, packed)
        if pc.pipeline_stage > 1:
            pipeline.assign_stages(network, mc, pc.pipeline_stage)
            pipeline.mark_lazy_inline(network)
        if lora is not None:
            lora.shard(cfg.parallel_config)
    else:
        from msllm.parallel.apply import apply_data_parallel_moe, apply_recompute

        if apply_data_parallel_moe(network, rt.world_size):
            log.info("mixture of experts: the load-balancing loss counts the routing of all %d data-parallel "
                     "ranks' tokens (global batch)", rt.world_size)
        if apply_recompute(network, cfg.recompute_config):
            log.info("recompute: %s activations of %d layers are recomputed in the backward pass",
                     "all" if cfg.recompute_config.recompute else "attention-core and SwiGLU",
                     mc.num_layers)
    network.return_router_stats(True)   # experts: aux loss, dropped share, expert shares in the log
    if cfg.dpo is not None:   # preference tuning: the policy and its reference in one network
        from msllm.training.dpo import build_dpo_network

        if sharded:
            raise MsllmError("dpo with operator sharding (semi_auto_parallel) is not implemented: the reference "
                             "model gets no layout; use data parallel")
        network = build_dpo_network(network, cfg.dpo, lora is not None, cfg.fast_paths, cfg.context.device_target)
        what = "the base without adapters" if lora is not None else "the starting weights"
        log.info("dpo: loss %s, beta %g, label_smoothing %g, ftx %g; reference = %s", cfg.dpo.loss_type,
                 cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.ftx,
                 f"precomputed once before the first step with {what} (precompute_ref: no reference model in "
                 "training)" if cfg.dpo.precompute_ref
                 else "the base without adapters (shared weights)" if lora is not None
                 else "a frozen copy of the starting weights")
    return network, lora


def prepare(cfg: RunConfig) -> TrainRun:
    """Join the process group, then build data, network, optimizer and train step per ``cfg``.

    Writes ``{output_dir}/msllm_config.yaml`` (the resolved config, rank 0).

    Raises:
        MsllmError: bad config for the device, bad dataset, data of another tokenizer than the model's.
    """
    from msllm.data.dataset import build_train_data
    from msllm.data.mindrecord import read_mindrecord_meta
    from msllm.training.sources import adopt_hf_model_config, check_data_tokenizer

    rt = setup_runtime(cfg)
    setup_logging(rt.rank)
    log_settings(cfg, cfg.run_mode)
    cfg = adopt_hf_model_config(cfg)   # load_checkpoint: HF_DIR -> the model of its config.json
    out = os.path.abspath(cfg.output_dir)
    if rt.is_main:
        save_config(cfg, os.path.join(out, "msllm_config.yaml"))
    log.info("rank %d of %d on %s; output in %s", rt.rank, rt.world_size, rt.device_target, out)

    rc, mc = cfg.runner_config, cfg.model_config
    accum = rc.gradient_accumulation_steps
    sharded = cfg.parallel.mode_name != "data_parallel"
    # semi-auto parallel (full_batch): every rank reads the same global batch and MindSpore
    # splits it by the layout; data parallel: each rank reads its own shard
    data_rank, data_world, dp_batches = (0, 1, cfg.parallel_config.data_parallel) if sharded \
        else (rt.rank, rt.world_size, 1)
    if cfg.parallel_config.pipeline_stage > 1:  # PipelineCell slices micro_batch_num micro batches off axis 0
        dp_batches *= cfg.parallel_config.micro_batch_num
    # train_dataset.batch_size: None = runner_config.batch_size (load_config refuses two that disagree)
    batch_size = cfg.train_dataset.batch_size or rc.batch_size
    data = build_train_data(cfg.train_dataset.dataset_dir, mc.seq_length, batch_size * accum * dp_batches,
                            cfg.train_dataset.shuffle, cfg.train_dataset.drop_remainder, data_rank,
                            data_world, cfg.seed, cfg.train_dataset.num_parallel_workers,
                            cfg.train_dataset.prefetch_size, input_columns=cfg.train_dataset.input_columns,
                            pad_token_id=mc.pad_token_id, vocab_size=mc.vocab_size, pairs=cfg.dpo is not None)
    if data.packed:
        from msllm.parallel.layout_checks import check_packed_layout

        check_packed_layout(cfg, cfg.train_dataset.dataset_dir)
    meta = read_mindrecord_meta(data.files[0])
    check_data_tokenizer(cfg, meta, data.files[0])   # before any step: data of the model's own tokenizer
    spe = data.steps_per_epoch
    total_steps = rc.train_steps or rc.epochs * spe
    epochs = -(-total_steps // spe)
    log.info("data: %s, %d samples, %d steps per epoch on this rank, %d steps in %d epoch(s)",
             ",".join(data.files), data.num_samples, spe, total_steps, epochs)

    network, lora = build_network(cfg, rt, sharded, packed=data.packed)
    # (a DPO reference's frozen copies are not the model's parameters)
    n_params = sum(p.size for p in network.get_parameters() if not p.name.startswith(ckpt.REFERENCE_PREFIX))
    log.info("model: %.2fM parameters (%d layers, hidden %d, heads %d/%d kv, ffn %d, vocab %d, seq %d)",
             n_params / 1e6, mc.num_layers, mc.hidden_size, mc.num_heads, mc.kv_heads, mc.ffn_size,
             mc.vocab_size, mc.seq_length)
    lr = build_schedule(cfg.lr_schedule, total_steps)
    optimizer = build_optimizer(network, cfg, lr)
    step_cell = build_train_step(network, optimizer, cfg, rt, packed=data.packed)
    return TrainRun(cfg, rt, out, data, meta, spe, total_steps, epochs, network, lora, optimizer, step_cell, lr,
                    RankAgreement(rt.world_size), n_params, sharded)


def load_start(run: TrainRun) -> tuple[int, Optional[tuple[str, int]]]:
    """Load the weights the run starts from; returns ``(start_step, resumed)`` with ``resumed`` =
    ``(checkpoint path, step)`` when ``resume_training`` found one, else None.

    ``resume_training``: the newest checkpoint complete on every rank (parameters, AdamW moments,
    optimizer step, loss-scale state; the data position follows from the step). Otherwise
    ``load_checkpoint``: a LoRA run's frozen base (loaded by ``LoraTraining``), a resharded
    checkpoint (``auto_trans_ckpt``), a Hugging Face directory, or an msllm / MindFormers checkpoint.

    Raises:
        MsllmError: finetune without load_checkpoint; corrupt or mismatched checkpoints (none usable
            while some exist); a LoRA resume on another base than the adapter's.
    """
    from msllm.training.sources import hf_start_dir

    cfg, rt, out, lora = run.cfg, run.rt, run.out, run.lora
    policy = getattr(run.network, "policy", run.network)   # DPO: the model being trained
    start_step, resumed = 0, None
    if cfg.resume_training:
        source = lora.resume_source(out) if lora else (cfg.load_checkpoint or os.path.join(out, "checkpoint"))
        # corrupt checkpoints are never loaded: none usable while some exist is an error
        resumed = ckpt.find_resume_checkpoint(source, rt.rank, run.agree.common_max)
        if resumed is None:
            log.warning("resume_training: no checkpoint under %s; starting from step 0", source)
        else:
            path, start_step = resumed
            if lora:
                lora.resume(run.step_cell, path)  # refuses a base other than the adapter's (SHA-256)
            else:
                if cfg.dpo is not None and cfg.dpo.precompute_ref:   # from the starting weights, not the resumed ones
                    from msllm.convert.starting import load_base_into
                    from msllm.training.dpo import reference_source

                    run.dpo_reference = reference_source(cfg.load_checkpoint, path)
                    load_base_into(policy, run.dpo_reference, rt.rank)
                    precompute_reference(run, policy)
                missing = ckpt.load_into(run.step_cell, ckpt.load_params(path), path, strict=cfg.dpo is None)
                ckpt.check_only_reference_missing(missing, path)
            log.info("resumed from %s: step %d (epoch %d, batch %d of the epoch)", path, start_step,
                     start_step // run.spe + 1, start_step % run.spe)
    elif lora:
        pass  # LoraTraining loaded the frozen base from load_checkpoint
    elif cfg.run_mode == "finetune" and not cfg.load_checkpoint:
        raise MsllmError("run_mode finetune needs load_checkpoint (the pretrained weights to start from)")
    elif cfg.load_checkpoint and cfg.auto_trans_ckpt:
        load_resharded(policy, run.step_cell, cfg, rt, out, run.data)
    elif hf_start_dir(cfg):
        from msllm.convert.starting import load_base_into

        load_base_into(policy, cfg.load_checkpoint, rt.rank)   # HF names -> msllm's, tied head included
        log.info("loaded weights from the Hugging Face directory %s", cfg.load_checkpoint)
    elif cfg.load_checkpoint:
        path = ckpt.resolve_checkpoint(cfg.load_checkpoint, rt.rank)
        ckpt.load_into(policy, ckpt.load_params(path), path)
        log.info("loaded weights from %s", path)
    if cfg.dpo is not None and lora is None:   # the frozen reference = the starting weights
        from msllm.training.dpo import fill_reference, reference_source

        run.dpo_reference = reference_source(cfg.load_checkpoint, resumed[0] if resumed else None)
        if not cfg.dpo.precompute_ref:
            fill_reference(run.network, run.dpo_reference if resumed else None, rt.rank)
        elif resumed is None:   # the policy holds the starting weights now
            precompute_reference(run, policy)
    elif cfg.dpo is not None and cfg.dpo.precompute_ref:   # LoRA: the base without adapters (shared, no copy)
        from msllm.training.dpo import build_reference

        precompute_reference(run, build_reference(policy, True, cfg.fast_paths, cfg.context.device_target))
    return start_step, resumed


def precompute_reference(run: TrainRun, model) -> None:
    """``dpo.precompute_ref``: the reference log-probs of every training pair (and held-out pair with
    ``do_eval``) with ``model`` holding the starting weights, split over the ranks
    (:mod:`msllm.training.dpo_values`); the training data then yields them as each batch's third
    input ((B, 2) float32) and the evaluation reads them."""
    import time

    from msllm.training.dpo_values import read_pairs, reference_values

    cfg, rt = run.cfg, run.rt
    seq, batch = cfg.model_config.seq_length, cfg.train_dataset.batch_size or cfg.runner_config.batch_size
    t0 = time.perf_counter()
    ids, labels = read_pairs(cfg.train_dataset.dataset_dir, seq)
    if ids.shape[0] != run.data.num_samples:
        raise MsllmError(f"{cfg.train_dataset.dataset_dir}: {ids.shape[0]} pairs read, the dataset counts "
                         f"{run.data.num_samples}")
    run.data.ref_logps = reference_values(model, ids, labels, batch, rt.rank, rt.world_size, run.agree.sums)
    n_eval = 0
    if cfg.do_eval:
        eval_batch = cfg.eval_dataset.batch_size or cfg.runner_config.batch_size
        ids, labels = read_pairs(cfg.eval_dataset.dataset_dir, seq)
        run.dpo_eval_ref = reference_values(model, ids, labels, eval_batch, rt.rank, rt.world_size, run.agree.sums)
        n_eval = ids.shape[0]
    log.info("dpo.precompute_ref: reference log-probs of %d training and %d held-out pairs computed with the starting "
             "weights in %.1f s", run.data.num_samples, n_eval, time.perf_counter() - t0)


def build_monitor(run: TrainRun) -> LossMonitor:
    """The loss monitor with the run's throughput accounting: MFU (model FLOPs, PaLM / Megatron
    convention) and HFU (FLOPs executed) against the device peak (:func:`peak_tflops`), logged once."""
    cfg, mc, network, lora = run.cfg, run.cfg.model_config, run.network, run.lora
    peak, how = peak_tflops(cfg, run.rt.world_size)
    log.info("MFU peak: %s", how)
    # LoRA: the frozen base gets no weight gradients (matrices only; norms and the embedding
    # lookup are not in 6N anyway); adapters are in neither N nor here, a < 1% undercount
    frozen_names = {p.name for p in network.get_parameters() if not p.requires_grad and p.ndim >= 2
                    and "embed_tokens" not in p.name} if lora else set()
    frozen = sum(p.size for p in network.get_parameters() if p.name in frozen_names)
    from msllm.kernels.select import CPU_FLASH

    flash = getattr(getattr(network, "kernels", None), "attention", None) == CPU_FLASH
    grouped = getattr(getattr(network, "kernels", None), "cpu", None) is not None   # moe.py's grouped dispatch
    throughput = throughput_for_run(cfg, peak, frozen, head_frozen=any("lm_head" in n for n in frozen_names),
                                    flash_attention=flash, grouped_experts=grouped)
    # the compact loss runs the output head only at positions with a target: HFU counts those
    compact = bool(getattr(network, "compact_loss", False))
    log.info("MFU (model FLOPs, PaLM app. B / Megatron convention) = tgs x %.4g FLOPs/token (6N + 12LHDT%s) / peak %s "
             "TFLOPs; HFU (FLOPs executed) counts %s, %s%s",
             throughput.flops_per_token, ", minus 2 x the frozen LoRA base" if lora else "",
             f"{throughput.peak_tflops:.4f}" if throughput.peak_tflops else "unknown",
             "the output head only at the positions with a target (the compact loss)" if compact
             else "the output head at every position",
             f"the attention as the CPU flash kernel runs it ({throughput.attention_executed_factor:.3f} x 12LHDT: "
             "causal blocks, scores recomputed in the backward pass)" if flash else "the full T x T attention",
             ", and the recomputed forward" if throughput.recompute_flops_per_token else "")
    return LossMonitor(epochs=run.epochs, total_steps=run.total_steps, throughput=throughput,
                       per_print_times=cfg.callbacks.loss_monitor.per_print_times)
