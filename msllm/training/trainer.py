"""Build everything a run needs from a :class:`RunConfig` and run the training loop.

Order matters: the process group is joined first (``setup_runtime``), before any weight is
allocated, so a failing launch fails fast and a CPU scheduler process does no model work.

Failure behaviour (see README "What msllm guarantees on failure"):
- ``resume_training``: parameters, AdamW moments, optimizer step (and so the learning-rate
  position), loss-scale state, step/epoch and the data position are restored from the newest
  checkpoint that is complete on every rank; the next batch is the one the uninterrupted run
  would have taken (the data order is a pure function of seed, epoch and rank, see
  :mod:`msllm.data.dataset`). There is no other random state in the loop (no dropout).
- SIGTERM/SIGINT, or an exception between steps: every rank saves a checkpoint of the last
  completed step, logs where it is, and exits non-zero. In a multi-process run the ranks agree
  on stopping at the same step (a one-integer all-reduce after each step), so their checkpoints
  match.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from msllm.cluster.context import Runtime, setup_logging, setup_runtime
from msllm.config import RunConfig, save_config
from msllm.errors import MsllmError
from msllm.settings import log_settings
from msllm.training import checkpoint as ckpt
from msllm.training.control import RankAgreement, StopSignal, start_profiler, stop_profiler, target_count
from msllm.training.monitor import LossMonitor, StepRecord
from msllm.training.schedule import build_schedule
from msllm.training.throughput import device_peak_tflops, throughput_for_run

log = logging.getLogger("msllm")

EXIT_STOPPED = 143  # 128 + SIGTERM, the shell convention for "terminated"


def build_optimizer(network, cfg: RunConfig, lr_per_step: np.ndarray):
    """AdamW over ``network``'s trainable parameters; decay on matrices only (ndim >= 2)."""
    from mindspore import Tensor, nn

    params = network.trainable_params()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    o = cfg.optimizer
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return nn.AdamWeightDecay(
        [g for g in groups if g["params"]],  # MindSpore refuses an empty group (LoRA: matrices only)
        learning_rate=Tensor(lr_per_step), beta1=float(o.betas[0]), beta2=float(o.betas[1]), eps=o.eps)


def build_train_step(network, optimizer, cfg: RunConfig, rt: Runtime):
    """The graph-mode train step (loss scale, clipping, data-parallel gradient all-reduce)."""
    from mindspore import nn

    from msllm.training.step import TrainStep

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
                     accum_steps=cfg.runner_config.gradient_accumulation_steps, grad_reducer=reducer)
    step.set_train()
    return step


def peak_tflops(cfg: RunConfig, world_size: int) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device, how it was obtained): ``context.peak_tflops`` if set, else the
    device's documented (Ascend) or computed (CPU: cores x FMA units x SIMD lanes x 2 x clock)
    peak, the same on every rank (:func:`msllm.training.throughput.device_peak_tflops`). On CPU the
    host's peak is shared by the ranks on this host: ``DEVICE_NUM`` (set by run_distribute.sh),
    checked against the communication group's size ``world_size``, else ``world_size``.

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
    return device_peak_tflops(cfg.context.device_target, cfg.context.peak_tflops, ranks_on_host=local)


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
        input_ids, labels = next(data.epoch_batches(0))
        step_cell.compile(input_ids, labels)
        ckpt.load_into_strict_after_compile(network, params, path)
    log.info("auto_trans_ckpt: resharded %s to this rank's layout: %s", cfg.load_checkpoint, path)
    return path


def finished_run(out: str, rank: int, checkpoint: str, step: int, total_steps: int) -> dict:
    """A resume whose newest checkpoint is already the run's last step (a job scheduler re-running
    a finished launch, or a kill after the final checkpoint): nothing to do. Nothing is written: the
    run's summary, curves and checkpoints stay as they are. Returns the run's summary (its
    ``train_summary_rank_{rank}.json``, {} if it has none)."""
    import json

    log.info("resume_training: %s is at step %d, the run's last (total steps %d): nothing left to do; the "
             "summary, curves and checkpoints are left as they are", checkpoint, step, total_steps)
    path = os.path.join(out, f"train_summary_rank_{rank}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    return {}


def train(cfg: RunConfig) -> dict:
    """Train per ``cfg``; returns the run summary (also written to ``output_dir``).

    Writes: ``{output_dir}/msllm_config.yaml`` (resolved config, rank 0),
    ``{output_dir}/checkpoint/rank_{r}/*.ckpt`` (+ ``.json`` manifests),
    ``{output_dir}/train_summary_rank_{r}.json``.

    Raises:
        MsllmError: bad config for the device, bad dataset, bad checkpoint.
        SystemExit(143): stopped by SIGTERM/SIGINT after saving a checkpoint.
    """
    from msllm.data.dataset import build_train_data
    from msllm.models.llama.model import LlamaForCausalLM

    from msllm.training.sources import adopt_hf_model_config, check_data_tokenizer, hf_start_dir

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
    # train_dataset.batch_size: None = runner_config.batch_size (load_config refuses two that disagree)
    batch_size = cfg.train_dataset.batch_size or rc.batch_size
    data = build_train_data(cfg.train_dataset.dataset_dir, mc.seq_length, batch_size * accum * dp_batches,
                            cfg.train_dataset.shuffle, cfg.train_dataset.drop_remainder, data_rank,
                            data_world, cfg.seed, cfg.train_dataset.num_parallel_workers,
                            cfg.train_dataset.prefetch_size, input_columns=cfg.train_dataset.input_columns,
                            pad_token_id=mc.pad_token_id, vocab_size=mc.vocab_size)
    from msllm.data.mindrecord import read_mindrecord_meta

    meta = read_mindrecord_meta(data.files[0])
    check_data_tokenizer(cfg, meta, data.files[0])   # before any step: data of the model's own tokenizer
    spe = data.steps_per_epoch
    total_steps = rc.train_steps or rc.epochs * spe
    epochs = -(-total_steps // spe)
    log.info("data: %s, %d samples, %d steps per epoch on this rank, %d steps in %d epoch(s)",
             ",".join(data.files), data.num_samples, spe, total_steps, epochs)

    network = LlamaForCausalLM(mc, fast_paths=cfg.fast_paths, device=cfg.context.device_target)
    lora = None
    if mc.pet_config is not None:  # LoRA: base from load_checkpoint, frozen; adapters trainable
        from msllm.lora.training import LoraTraining

        lora = LoraTraining(network, cfg, rt.rank)
    if sharded:  # shard strategies, stages and recompute from parallel_config (Ascend only)
        from msllm.parallel.apply import apply_layout

        apply_layout(network, cfg.parallel_config, cfg.recompute_config)
        if lora is not None:
            lora.shard(cfg.parallel_config)
    else:
        from msllm.parallel.apply import apply_recompute

        if apply_recompute(network, cfg.recompute_config):
            log.info("recompute: %s activations of %d layers are recomputed in the backward pass",
                     "all" if cfg.recompute_config.recompute else "attention-core and SwiGLU",
                     mc.num_layers)
    n_params = sum(p.size for p in network.get_parameters())
    log.info("model: %.2fM parameters (%d layers, hidden %d, heads %d/%d kv, ffn %d, vocab %d, seq %d)",
             n_params / 1e6, mc.num_layers, mc.hidden_size, mc.num_heads, mc.kv_heads, mc.ffn_size,
             mc.vocab_size, mc.seq_length)
    lr = build_schedule(cfg.lr_schedule, total_steps)
    optimizer = build_optimizer(network, cfg, lr)
    step_cell = build_train_step(network, optimizer, cfg, rt)
    agree = RankAgreement(rt.world_size)

    start_step = 0
    resumed = None
    if cfg.resume_training:
        source = lora.resume_source(out) if lora else (cfg.load_checkpoint or os.path.join(out, "checkpoint"))
        # corrupt checkpoints are never loaded: none usable while some exist is an error
        resumed = ckpt.find_resume_checkpoint(source, rt.rank, agree.common_max)
        if resumed is None:
            log.warning("resume_training: no checkpoint under %s; starting from step 0", source)
        else:
            path, start_step = resumed
            if lora:
                lora.resume(step_cell, path)  # refuses a base other than the adapter's (SHA-256)
            else:
                ckpt.load_into(step_cell, ckpt.load_params(path), path)
            log.info("resumed from %s: step %d (epoch %d, batch %d of the epoch)", path, start_step,
                     start_step // spe + 1, start_step % spe)
    elif lora:
        pass  # LoraTraining loaded the frozen base from load_checkpoint
    elif cfg.run_mode == "finetune" and not cfg.load_checkpoint:
        raise MsllmError("run_mode finetune needs load_checkpoint (the pretrained weights to start from)")
    elif cfg.load_checkpoint and cfg.auto_trans_ckpt:
        load_resharded(network, step_cell, cfg, rt, out, data)
    elif hf_start_dir(cfg):
        from msllm.lora.base import load_base_into

        load_base_into(network, cfg.load_checkpoint, rt.rank)   # HF names -> msllm's, tied head included
        log.info("loaded weights from the Hugging Face directory %s", cfg.load_checkpoint)
    elif cfg.load_checkpoint:
        path = ckpt.resolve_checkpoint(cfg.load_checkpoint, rt.rank)
        ckpt.load_into(network, ckpt.load_params(path), path)
        log.info("loaded weights from %s", path)

    if resumed is not None and start_step >= total_steps:
        return finished_run(out, rt.rank, resumed[0], start_step, total_steps)

    peak, how = peak_tflops(cfg, rt.world_size)
    log.info("MFU peak: %s", how)
    # LoRA: the frozen base gets no weight gradients (matrices only; norms and the embedding
    # lookup are not in 6N anyway); adapters are in neither N nor here, a < 1% undercount
    frozen_names = {p.name for p in network.get_parameters() if not p.requires_grad and p.ndim >= 2
                    and "embed_tokens" not in p.name} if lora else set()
    frozen = sum(p.size for p in network.get_parameters() if p.name in frozen_names)
    from msllm.kernels.select import CPU_FLASH

    flash = getattr(getattr(network, "kernels", None), "attention", None) == CPU_FLASH
    throughput = throughput_for_run(cfg, peak, frozen, head_frozen=any("lm_head" in n for n in frozen_names),
                                    flash_attention=flash)
    monitor = LossMonitor(epochs=epochs, total_steps=total_steps, throughput=throughput,
                          per_print_times=cfg.callbacks.loss_monitor.per_print_times)
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

    cc = cfg.callbacks.checkpoint
    ckpt_dir = ckpt.rank_dir(out, rt.rank)
    saved: list[str] = []
    # the prompt template and tokenizer the data was built with travel into every checkpoint's
    # manifest, so predict and chat format and tokenize prompts as training saw them
    from msllm.data.templates import read_template_name

    data_identity = {"template": read_template_name(cfg.train_dataset.dataset_dir)}
    if meta.get("tokenizer_md5"):
        data_identity["tokenizer"] = {"file": meta.get("tokenizer_file"), "md5": meta["tokenizer_md5"]}

    def save(step: int) -> str:
        epoch = (step - 1) // spe + 1 if step else 1
        name = ckpt.checkpoint_name(cc.prefix, rt.rank, epoch, step, cc.format)
        if lora:  # adapters + their AdamW state + counters; the base identity in the manifest
            path = lora.save(step_cell, os.path.join(ckpt_dir, name), epoch, step, cc.format, model_config=mc,
                             **data_identity)
        else:
            path = ckpt.save_checkpoint(step_cell, os.path.join(ckpt_dir, name), epoch, step, cc.format,
                                        model_config=mc, **data_identity)
        saved.append(path)
        ckpt.prune_checkpoints(ckpt_dir, cc.prefix, cc.keep_checkpoint_max)
        log.info("saved checkpoint %s", path)
        return path

    from msllm.training.curves import TensorBoardLogger, plot_run

    tb = TensorBoardLogger.from_config(cfg, rt.rank, rc.batch_size * accum * rt.world_size)
    eval_data, evals = None, []
    if cfg.do_eval:
        if sharded:
            raise MsllmError("do_eval with operator sharding (semi_auto_parallel) is not implemented: the "
                             "evaluation pass splits samples over data-parallel ranks only; set do_eval: False "
                             "and evaluate the checkpoints with run_mode: eval")
        from msllm.eval.perplexity import evaluate_loss, read_eval_records

        eval_data = read_eval_records(cfg.eval_dataset.dataset_dir, mc.seq_length, cfg.eval_dataset.input_columns,
                                      mc.pad_token_id)
        eval_batch = cfg.eval_dataset.batch_size or rc.batch_size
        log.info("do_eval: %d evaluation samples from %s, every %s", len(eval_data[0]),
                 cfg.eval_dataset.dataset_dir,
                 " and every ".join(x for x in (f"{cfg.eval_step_interval} steps" if cfg.eval_step_interval > 0 else "",
                                                f"{cfg.eval_epoch_interval} epoch(s)" if cfg.eval_epoch_interval > 0
                                                else "") if x) or "never (both intervals <= 0)")

    def run_evaluation(at_step: int, at_epoch: int) -> None:
        """Evaluation loss and perplexity of the network being trained (every rank, same step)."""
        t0 = time.perf_counter()
        loss, ppl, tokens = evaluate_loss(network, eval_data, eval_batch, rt.rank, rt.world_size,
                                          mc.ignore_token_id, mc.pad_token_id)
        log.info("eval: step %d, epoch %d, loss %.4f, perplexity %.3f, %d tokens, %.1f s",
                 at_step, at_epoch, loss, ppl, tokens, time.perf_counter() - t0)
        evals.append({"step": at_step, "epoch": at_epoch, "loss": loss, "ppl": ppl, "tokens": tokens})
        if tb is not None:
            tb.log_eval(at_step, loss, ppl)

    profiler = start_profiler(out, rt.rank) if cfg.profile else None
    step = start_step
    lr_index = int(optimizer.global_step.asnumpy().reshape(-1)[0])
    in_step = False
    with StopSignal() as stop:
        try:
            for epoch in range(step // spe, epochs):
                batches = data.epoch_batches(epoch, start_step=step - epoch * spe)
                while step < min(total_steps, (epoch + 1) * spe):
                    t_data = time.perf_counter()
                    input_ids, labels = next(batches)
                    if profiler is not None and step + 1 == cfg.profile_start_step:
                        profiler.start()
                    t0 = time.perf_counter()
                    in_step = True
                    loss, overflow, scale, grad_norm = step_cell(input_ids, labels)
                    loss_v = float(loss.asnumpy())  # synchronises: the time includes the whole step
                    in_step = False
                    seconds = time.perf_counter() - t0
                    step += 1
                    overflow_v = bool(overflow.asnumpy())
                    # one AllReduce per step: the stop vote (SIGTERM on any rank) and, for the
                    # compact loss's HFU, the global step's target positions (same HFU on every rank)
                    targets = target_count(labels, mc.ignore_token_id) if compact else (1, 1)
                    stop_votes, n_targets, n_positions = agree.sums([float(bool(stop.signum)), *targets])
                    monitor.add(StepRecord(step, epoch + 1, loss_v, seconds, float(lr[min(lr_index, total_steps - 1)]),
                                           overflow_v, float(scale.asnumpy()), float(grad_norm.asnumpy()),
                                           data_seconds=t0 - t_data, head_fraction=n_targets / n_positions))
                    if tb is not None:
                        tb.log_step(monitor.records[-1], monitor.throughput.tgs(seconds))
                    lr_index += 0 if overflow_v else 1
                    if profiler is not None and step == cfg.profile_stop_step:
                        stop_profiler(profiler, out, rt.rank)
                        profiler = None
                    if not np.isfinite(loss_v):
                        raise MsllmError(f"loss became {loss_v} at step {step}; lower the learning rate")
                    if step % cc.save_checkpoint_steps == 0:
                        save(step)
                    if eval_data is not None and cfg.eval_step_interval > 0 and step % cfg.eval_step_interval == 0:
                        run_evaluation(step, epoch + 1)
                    if stop_votes > 0:
                        if not saved or not saved[-1].endswith(f"_{step}.{cc.format}"):
                            save(step)
                        log.error("stopped by a signal at step %d; checkpoint: %s; resume with "
                                  "--resume_training=True", step, saved[-1])
                        raise SystemExit(EXIT_STOPPED)
                if (eval_data is not None and cfg.eval_epoch_interval > 0 and step == (epoch + 1) * spe
                        and (epoch + 1) % cfg.eval_epoch_interval == 0 and not (evals and evals[-1]["step"] == step)):
                    run_evaluation(step, epoch + 1)
        except (Exception, KeyboardInterrupt) as exc:
            if in_step:
                log.error("failed inside step %d (%s): parameters may be half-updated, not saving",
                          step + 1, type(exc).__name__)
            elif step > start_step and (not saved or not saved[-1].endswith(f"_{step}.{cc.format}")):
                path = save(step)
                log.error("failed after step %d (%s: %s); saved %s", step, type(exc).__name__, exc, path)
            raise
    if profiler is not None and step >= cfg.profile_start_step:  # the run ended inside the window
        stop_profiler(profiler, out, rt.rank)
    if cc.save_at_end and (not saved or not saved[-1].endswith(f"_{step}.{cc.format}")):
        save(step)
    summary = monitor.write(os.path.join(out, f"train_summary_rank_{rt.rank}.json"),
                            {"rank": rt.rank, "world_size": rt.world_size, "checkpoints": saved,
                             "parameters": n_params, "start_step": start_step,
                             "resumed_from": resumed[0] if resumed else None, "eval": evals})
    if tb is not None:
        tb.close()
    if rt.is_main:
        log.info("loss curve: %s", plot_run(out, rt.rank))
    log.info("done: %d steps, loss %.3f (first %d avg) -> %.3f (last %d avg), %.1f tokens/s/device, "
             "data wait %.1f%% of step time; checkpoints in %s", step, summary["first_avg_loss"],
             summary["avg_window"], summary["last_avg_loss"], summary["avg_window"],
             summary["tgs"] or 0.0, 100 * summary["data_wait_share"], ckpt_dir)
    return summary
