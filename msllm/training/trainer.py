"""Build everything a run needs from a :class:`RunConfig` and run the training loop.

Order matters: the process group is joined first (``setup_runtime``), before any weight is
allocated, so a failing launch fails fast and a CPU scheduler process does no model work.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from msllm.cluster.context import Runtime, setup_runtime
from msllm.config import RunConfig, save_config
from msllm.errors import MsllmError
from msllm.training import checkpoint as ckpt
from msllm.training.monitor import LossMonitor, StepRecord
from msllm.training.schedule import build_schedule
from msllm.training.throughput import Throughput, measure_cpu_peak_tflops

log = logging.getLogger("msllm")


def build_optimizer(network, cfg: RunConfig, lr_per_step: np.ndarray):
    """AdamW over ``network``'s trainable parameters; decay on matrices only (ndim >= 2)."""
    from mindspore import Tensor, nn

    params = network.trainable_params()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    o = cfg.optimizer
    return nn.AdamWeightDecay(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        learning_rate=Tensor(lr_per_step), beta1=float(o.betas[0]), beta2=float(o.betas[1]), eps=o.eps)


def build_train_step(network, optimizer, cfg: RunConfig, rt: Runtime):
    """The graph-mode train step (loss scale, clipping, data-parallel gradient all-reduce)."""
    from mindspore import nn

    from msllm.training.step import TrainStep

    rw = cfg.runner_wrapper
    reducer = None
    if rt.world_size > 1:
        reducer = nn.DistributedGradReducer(optimizer.parameters, mean=cfg.parallel.gradients_mean,
                                            degree=rt.world_size)
    step = TrainStep(network, optimizer, loss_scale=rw.loss_scale, scale_sense=rw.scale_sense,
                     scale_factor=rw.scale_factor, scale_window=rw.scale_window,
                     max_grad_norm=rw.max_grad_norm if rw.use_clip_grad else None,
                     accum_steps=cfg.runner_config.gradient_accumulation_steps, grad_reducer=reducer)
    step.set_train()
    return step


def peak_tflops(cfg: RunConfig) -> float | None:
    """``context.peak_tflops`` if set; on CPU a measured fp32 matmul rate; else None."""
    if cfg.context.peak_tflops:
        return cfg.context.peak_tflops
    if cfg.context.device_target == "CPU":
        return measure_cpu_peak_tflops()
    return None


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s",
                        force=True)


def train(cfg: RunConfig) -> dict:
    """Train per ``cfg``; returns the run summary (also written to ``output_dir``).

    Writes: ``{output_dir}/msllm_config.yaml`` (resolved config, rank 0),
    ``{output_dir}/checkpoint/rank_{r}/*.ckpt``, ``{output_dir}/train_summary_rank_{r}.json``.

    Raises:
        MsllmError: bad config for the device, bad dataset, bad checkpoint.
    """
    from msllm.data.dataset import build_train_data
    from msllm.models.llama.model import LlamaForCausalLM

    rt = setup_runtime(cfg)
    setup_logging(rt.rank)
    out = os.path.abspath(cfg.output_dir)
    if rt.is_main:
        save_config(cfg, os.path.join(out, "msllm_config.yaml"))
    log.info("rank %d of %d on %s; output in %s", rt.rank, rt.world_size, rt.device_target, out)

    rc, mc = cfg.runner_config, cfg.model_config
    accum = rc.gradient_accumulation_steps
    data = build_train_data(cfg.train_dataset.dataset_dir, mc.seq_length, rc.batch_size * accum,
                            cfg.train_dataset.shuffle, cfg.train_dataset.drop_remainder, rt.rank,
                            rt.world_size, cfg.train_dataset.num_parallel_workers,
                            cfg.train_dataset.prefetch_size)
    total_steps = rc.train_steps or rc.epochs * data.steps_per_epoch
    epochs = -(-total_steps // data.steps_per_epoch)
    log.info("data: %s, %d steps per epoch on this rank, %d steps in %d epoch(s)",
             ",".join(data.files), data.steps_per_epoch, total_steps, epochs)

    network = LlamaForCausalLM(mc)
    n_params = sum(p.size for p in network.trainable_params())
    log.info("model: %.2fM parameters (%d layers, hidden %d, heads %d/%d kv, ffn %d, vocab %d, seq %d)",
             n_params / 1e6, mc.num_layers, mc.hidden_size, mc.num_heads, mc.kv_heads, mc.ffn_size,
             mc.vocab_size, mc.seq_length)
    if cfg.run_mode == "finetune" and not cfg.load_checkpoint:
        raise MsllmError("run_mode finetune needs load_checkpoint (the pretrained weights to start from)")
    if cfg.load_checkpoint:
        path = ckpt.resolve_checkpoint(cfg.load_checkpoint, rt.rank)
        ckpt.load_into(network, ckpt.load_params(path), path)
        log.info("loaded weights from %s", path)

    lr = build_schedule(cfg.lr_schedule, total_steps)
    optimizer = build_optimizer(network, cfg, lr)
    step_cell = build_train_step(network, optimizer, cfg, rt)

    tokens_per_step = rc.batch_size * accum * mc.seq_length
    monitor = LossMonitor(epochs=epochs, total_steps=total_steps,
                          throughput=Throughput(tokens_per_step, mc.train_flops_per_token(), peak_tflops(cfg)),
                          per_print_times=cfg.callbacks.loss_monitor.per_print_times)
    log.info("MFU = tgs x %.4g FLOPs/token (6N + 12LHDT, PaLM app. B) / peak %s TFLOPs",
             monitor.throughput.flops_per_token,
             f"{monitor.throughput.peak_tflops:.4f}" if monitor.throughput.peak_tflops else "unknown")

    cc = cfg.callbacks.checkpoint
    ckpt_dir = ckpt.rank_dir(out, rt.rank)
    saved = []

    def save(epoch: int, step: int) -> None:
        name = ckpt.checkpoint_name(cc.prefix, rt.rank, epoch, step, cc.format)
        saved.append(ckpt.save_checkpoint(step_cell, os.path.join(ckpt_dir, name), epoch, step, cc.format))
        ckpt.prune_checkpoints(ckpt_dir, cc.prefix, cc.keep_checkpoint_max)
        log.info("saved checkpoint %s", saved[-1])

    step = 0
    iterator = data.dataset.create_tuple_iterator(num_epochs=epochs)
    for epoch in range(1, epochs + 1):
        for _ in range(data.steps_per_epoch):
            if step >= total_steps:
                break
            input_ids, labels = next(iterator)
            t0 = time.perf_counter()
            loss, overflow, scale, grad_norm = step_cell(input_ids, labels)
            loss_v = float(loss.asnumpy())  # synchronises: the time below includes the whole step
            seconds = time.perf_counter() - t0
            step += 1
            monitor.add(StepRecord(step, epoch, loss_v, seconds, float(lr[min(step, total_steps) - 1]),
                                   bool(overflow.asnumpy()), float(scale.asnumpy()),
                                   float(grad_norm.asnumpy())))
            if not np.isfinite(loss_v):
                raise MsllmError(f"loss became {loss_v} at step {step}; lower the learning rate")
            if step % cc.save_checkpoint_steps == 0:
                save(epoch, step)
    if cc.save_at_end and (not saved or not saved[-1].endswith(f"_{step}.{cc.format}")):
        save(epochs, step)
    summary = monitor.write(os.path.join(out, f"train_summary_rank_{rt.rank}.json"),
                            {"rank": rt.rank, "world_size": rt.world_size, "checkpoints": saved,
                             "parameters": n_params})
    log.info("done: %d steps, loss %.3f (first %d avg) -> %.3f (last %d avg), %.1f tokens/s/device; "
             "checkpoints in %s", step, summary["first_avg_loss"], summary["avg_window"],
             summary["last_avg_loss"], summary["avg_window"], summary["tgs"] or 0.0, ckpt_dir)
    return summary
