"""The training loop of a prepared run (:class:`msllm.training.setup.TrainRun`): steps, the loss
monitor, checkpoints, in-run evaluation, the profiler window, and the failure behaviour.

Failure behaviour (see README "What msllm guarantees on failure"): on SIGTERM/SIGINT every rank
saves a checkpoint of the last completed step and exits 143; the ranks agree on stopping at the
same step (a one-vector all-reduce after each step), so their checkpoints match. An exception
between steps saves the last completed step, then propagates; one inside a step saves nothing
(the parameters may be half-updated).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import numpy as np

from msllm.errors import MsllmError
from msllm.training import checkpoint as ckpt
from msllm.training.control import StopSignal, start_profiler, stop_profiler, target_count
from msllm.training.monitor import LossMonitor, StepRecord, router_summary
from msllm.training.setup import TrainRun

log = logging.getLogger("msllm")

EXIT_STOPPED = 143  # 128 + SIGTERM, the shell convention for "terminated"


class Checkpointer:
    """Saves the run's checkpoints (``{output_dir}/checkpoint/rank_{r}/``, pruned to
    ``keep_checkpoint_max``); the data's prompt template and tokenizer travel into every manifest,
    so predict and chat format and tokenize prompts as training saw them."""

    def __init__(self, run: TrainRun):
        from msllm.data.templates import read_template_name

        self.run = run
        self.dir = ckpt.rank_dir(run.out, run.rt.rank)
        self.saved: list[str] = []
        self.identity = {"template": read_template_name(run.cfg.train_dataset.dataset_dir)}
        if run.meta.get("tokenizer_md5"):
            self.identity["tokenizer"] = {"file": run.meta.get("tokenizer_file"), "md5": run.meta["tokenizer_md5"]}
        if run.dpo_reference:   # a resumed DPO run rebuilds its frozen reference from these weights
            self.identity["dpo_reference"] = run.dpo_reference

    def has(self, step: int) -> bool:
        """Whether the newest checkpoint saved by this run is of ``step``."""
        cc = self.run.cfg.callbacks.checkpoint
        return bool(self.saved) and self.saved[-1].endswith(f"_{step}.{cc.format}")

    def save(self, step: int) -> str:
        run, cc = self.run, self.run.cfg.callbacks.checkpoint
        epoch = (step - 1) // run.spe + 1 if step else 1
        name = ckpt.checkpoint_name(cc.prefix, run.rt.rank, epoch, step, cc.format)
        mc = run.cfg.model_config
        if run.lora:  # adapters + their AdamW state + counters; the base identity in the manifest
            path = run.lora.save(run.step_cell, os.path.join(self.dir, name), epoch, step, cc.format,
                                 model_config=mc, **self.identity)
        else:
            path = ckpt.save_checkpoint(run.step_cell, os.path.join(self.dir, name), epoch, step, cc.format,
                                        model_config=mc, **self.identity)
        self.saved.append(path)
        ckpt.prune_checkpoints(self.dir, cc.prefix, cc.keep_checkpoint_max)
        log.info("saved checkpoint %s", path)
        return path


class Evaluator:
    """``do_eval``: evaluation loss and perplexity of the network being trained, on every rank at
    the same step (``eval_step_interval`` steps, ``eval_epoch_interval`` epochs); results in
    :attr:`results` and TensorBoard. With ``dpo``: the held-out pairs' DPO loss and TRL's metrics
    (``eval_rewards/chosen``, ...; :class:`msllm.training.dpo_values.HeldOutPairs`)."""

    def __init__(self, run: TrainRun, tb):
        from msllm.eval.perplexity import read_eval_records

        cfg, mc = run.cfg, run.cfg.model_config
        if run.sharded:
            raise MsllmError("do_eval with operator sharding (semi_auto_parallel) is not implemented: the "
                             "evaluation pass splits samples over data-parallel ranks only; set do_eval: False "
                             "and evaluate the checkpoints with run_mode: eval")
        self.run, self.tb, self.results = run, tb, []
        self.batch = cfg.eval_dataset.batch_size or cfg.runner_config.batch_size
        self.pairs = None
        if cfg.dpo is not None:   # held-out preference pairs: DPO loss and TRL's metrics (msllm.training.dpo_values)
            from msllm.training.dpo_values import HeldOutPairs, read_pairs

            self.pairs = HeldOutPairs(run.network, *read_pairs(cfg.eval_dataset.dataset_dir, mc.seq_length),
                                      self.batch, cfg.dpo, run.dpo_eval_ref)
            self.data = (self.pairs.ids,)
        else:
            self.data = read_eval_records(cfg.eval_dataset.dataset_dir, mc.seq_length,
                                          cfg.eval_dataset.input_columns, mc.pad_token_id)
        self.step_interval, self.epoch_interval = cfg.eval_step_interval, cfg.eval_epoch_interval
        every = [f"{self.step_interval} steps" if self.step_interval > 0 else "",
                 f"{self.epoch_interval} epoch(s)" if self.epoch_interval > 0 else ""]
        log.info("do_eval: %d evaluation %s from %s, every %s", len(self.data[0]),
                 "preference pairs" if self.pairs is not None else "samples", cfg.eval_dataset.dataset_dir,
                 " and every ".join(x for x in every if x) or "never (both intervals <= 0)")

    def __call__(self, at_step: int, at_epoch: int) -> None:
        from msllm.eval.perplexity import evaluate_loss

        run, mc = self.run, self.run.cfg.model_config
        t0 = time.perf_counter()
        if self.pairs is not None:
            m = self.pairs(run.rt.rank, run.rt.world_size, run.agree.sums)
            log.info("eval: step %d, epoch %d, eval_loss %.4f, %s, %d pairs, %.1f s", at_step, at_epoch, m["loss"],
                     ", ".join(f"{k}: {v:.4f}" for k, v in m.items() if k != "loss"), len(self.pairs),
                     time.perf_counter() - t0)
            self.results.append({"step": at_step, "epoch": at_epoch, "loss": m["loss"], "pairs": len(self.pairs),
                                 "metrics": {k: v for k, v in m.items() if k != "loss"}})
            if self.tb is not None:
                self.tb.log_eval_metrics(at_step, m)
            return
        loss, ppl, tokens = evaluate_loss(run.network, self.data, self.batch, run.rt.rank, run.rt.world_size,
                                          mc.ignore_token_id, mc.pad_token_id)
        log.info("eval: step %d, epoch %d, loss %.4f, perplexity %.3f, %d tokens, %.1f s",
                 at_step, at_epoch, loss, ppl, tokens, time.perf_counter() - t0)
        self.results.append({"step": at_step, "epoch": at_epoch, "loss": loss, "ppl": ppl, "tokens": tokens})
        if self.tb is not None:
            self.tb.log_eval(at_step, loss, ppl)

    def after_step(self, step: int, epoch: int) -> None:
        if self.step_interval > 0 and step % self.step_interval == 0:
            self(step, epoch + 1)

    def after_epoch(self, step: int, epoch: int) -> None:
        if (self.epoch_interval > 0 and step == (epoch + 1) * self.run.spe and (epoch + 1) % self.epoch_interval == 0
                and not (self.results and self.results[-1]["step"] == step)):
            self(step, epoch + 1)


def run_loop(run: TrainRun, start_step: int, monitor: LossMonitor, saver: Checkpointer,
             evaluator: Optional[Evaluator], tb) -> int:
    """Train from ``start_step`` to ``run.total_steps``; returns the last completed step.

    Raises:
        MsllmError: the loss became NaN or infinite.
        SystemExit(143): stopped by SIGTERM/SIGINT on any rank, after saving a checkpoint.
    """
    cfg, mc, step_cell, lr = run.cfg, run.cfg.model_config, run.step_cell, run.lr
    cc, spe, total_steps = cfg.callbacks.checkpoint, run.spe, run.total_steps
    compact = bool(getattr(run.network, "compact_loss", False))
    dpo = cfg.dpo is not None   # the network's stats are DPO's metrics (msllm.training.dpo)
    # DPO batches are cut to their longest pair (msllm.training.dpo.cut_pair_batch) where shapes may vary
    # from step to step: data parallel on CPU (a sharded or pipelined layout fixes its shapes; on Ascend
    # each new shape would be a graph compile of minutes)
    cut_pairs = dpo and not run.sharded and cfg.context.device_target == "CPU"
    widths_seen: set = set()
    if dpo:
        from msllm.training.dpo import cut_pair_batch, metrics_dict, pair_widths

        if cut_pairs and run.rt.rank == 0:
            log.info("dpo: each batch is cut to its longest pair, %s token positions (one compiled step per "
                     "width)", "/".join(str(w) for w in pair_widths(mc.seq_length)))
    profiler = start_profiler(run.out, run.rt.rank) if cfg.profile else None
    step = start_step
    lr_index = int(run.optimizer.global_step.asnumpy().reshape(-1)[0])
    in_step = False
    with StopSignal() as stop:
        try:
            for epoch in range(step // spe, run.epochs):
                batches = run.data.epoch_batches(epoch, start_step=step - epoch * spe)
                while step < min(total_steps, (epoch + 1) * spe):
                    t_data = time.perf_counter()
                    batch = next(batches)    # (input_ids, labels[, actual_seq_len] of packed rows)
                    if cut_pairs:
                        batch = cut_pair_batch(batch, mc.ignore_token_id, run.agree)
                        width = batch[0].shape[-1] - 1
                        if width not in widths_seen and run.rt.rank == 0:   # this step compiles its graph
                            log.info("dpo: step %d is the first at width %d", step + 1, width)
                        widths_seen.add(width)
                    labels = batch[1]
                    if profiler is not None and step + 1 == cfg.profile_start_step:
                        profiler.start()
                    t0 = time.perf_counter()
                    in_step = True
                    loss, overflow, scale, grad_norm, *router = step_cell(*batch)
                    loss_v = float(loss.asnumpy())  # synchronises: the time includes the whole step
                    in_step = False
                    seconds = time.perf_counter() - t0
                    step += 1
                    overflow_v = bool(overflow.asnumpy())
                    # one AllReduce per step: the stop vote (SIGTERM on any rank) and, for the
                    # compact loss's HFU, the global step's target positions (same HFU on every rank)
                    targets = target_count(labels, mc.ignore_token_id) if compact else (1, 1)
                    stop_votes, n_targets, n_positions = run.agree.sums([float(bool(stop.signum)), *targets])
                    monitor.add(StepRecord(step, epoch + 1, loss_v, seconds, float(lr[min(lr_index, total_steps - 1)]),
                                           overflow_v, float(scale.asnumpy()), float(grad_norm.asnumpy()),
                                           data_seconds=t0 - t_data, head_fraction=n_targets / n_positions,
                                           moe=router_summary(router[0].asnumpy()) if router and not dpo else None,
                                           metrics=metrics_dict(router[0].asnumpy()) if dpo else None))
                    if tb is not None:
                        tb.log_step(monitor.records[-1], monitor.throughput.tgs(seconds))
                    lr_index += 0 if overflow_v else 1
                    if profiler is not None and step == cfg.profile_stop_step:
                        stop_profiler(profiler, run.out, run.rt.rank)
                        profiler = None
                    if not np.isfinite(loss_v):
                        raise MsllmError(f"loss became {loss_v} at step {step}; lower the learning rate")
                    if step % cc.save_checkpoint_steps == 0:
                        saver.save(step)
                    if evaluator is not None:
                        evaluator.after_step(step, epoch)
                    if stop_votes > 0:
                        if not saver.has(step):
                            saver.save(step)
                        log.error("stopped by a signal at step %d; checkpoint: %s; resume with "
                                  "--resume_training=True", step, saver.saved[-1])
                        raise SystemExit(EXIT_STOPPED)
                if evaluator is not None:
                    evaluator.after_epoch(step, epoch)
        except (Exception, KeyboardInterrupt) as exc:
            if in_step:
                log.error("failed inside step %d (%s): parameters may be half-updated, not saving",
                          step + 1, type(exc).__name__)
            elif step > start_step and not saver.has(step):
                path = saver.save(step)
                log.error("failed after step %d (%s: %s); saved %s", step, type(exc).__name__, exc, path)
            raise
    if profiler is not None and step >= cfg.profile_start_step:  # the run ended inside the window
        stop_profiler(profiler, run.out, run.rt.rank)
    return step
