"""A training run from a :class:`RunConfig`: set up (:mod:`msllm.training.setup`), the loop
(:mod:`msllm.training.loop`), and the end of the run (summary, curves), in that order.

Failure behaviour (see README "What msllm guarantees on failure"):
- ``resume_training``: parameters, AdamW moments, optimizer step (and so the learning-rate
  position), loss-scale state, step/epoch and the data position are restored from the newest
  checkpoint that is complete on every rank; the next batch is the one the uninterrupted run
  would have taken (the data order is a pure function of seed, epoch and rank, see
  :mod:`msllm.data.dataset`). There is no other random state in the loop (no dropout). Resuming
  a run that already finished does nothing (:func:`finished_run`).
- SIGTERM/SIGINT, or an exception between steps: every rank saves a checkpoint of the last
  completed step, logs where it is, and exits non-zero (:func:`msllm.training.loop.run_loop`).
"""

from __future__ import annotations

import json
import logging
import os

from msllm.config import RunConfig
from msllm.training.loop import Checkpointer, Evaluator, run_loop
from msllm.training.setup import build_monitor, load_start, prepare

log = logging.getLogger("msllm")


def train(cfg: RunConfig) -> dict:
    """Train per ``cfg``; returns the run summary (also written to ``output_dir``).

    Writes: ``{output_dir}/msllm_config.yaml`` (resolved config, rank 0),
    ``{output_dir}/checkpoint/rank_{r}/*.ckpt`` (+ ``.json`` manifests),
    ``{output_dir}/train_summary_rank_{r}.json``, the loss curve (rank 0).

    Raises:
        MsllmError: bad config for the device, bad dataset, bad checkpoint.
        SystemExit(143): stopped by SIGTERM/SIGINT after saving a checkpoint.
    """
    from msllm.training.curves import TensorBoardLogger, plot_run

    run = prepare(cfg)
    cfg, rt = run.cfg, run.rt   # the resolved config (an HF directory's model adopted)
    start_step, resumed = load_start(run)
    if resumed is not None and start_step >= run.total_steps:
        return finished_run(run.out, rt.rank, resumed[0], start_step, run.total_steps)

    monitor = build_monitor(run)
    saver = Checkpointer(run)
    rc = cfg.runner_config
    tb = TensorBoardLogger.from_config(cfg, rt.rank, rc.batch_size * rc.gradient_accumulation_steps * rt.world_size)
    evaluator = Evaluator(run, tb) if cfg.do_eval else None
    step = run_loop(run, start_step, monitor, saver, evaluator, tb)

    # the end of the run
    cc = cfg.callbacks.checkpoint
    if cc.save_at_end and not saver.has(step):
        saver.save(step)
    summary = monitor.write(os.path.join(run.out, f"train_summary_rank_{rt.rank}.json"),
                            {"rank": rt.rank, "world_size": rt.world_size, "checkpoints": saver.saved,
                             "parameters": run.n_params, "start_step": start_step,
                             "resumed_from": resumed[0] if resumed else None,
                             "eval": evaluator.results if evaluator else []})
    if tb is not None:
        tb.close()
    if rt.is_main:
        log.info("loss curve: %s", plot_run(run.out, rt.rank))
    log.info("done: %d steps, loss %.3f (first %d avg) -> %.3f (last %d avg), %.1f tokens/s/device, "
             "data wait %.1f%% of step time; checkpoints in %s", step, summary["first_avg_loss"],
             summary["avg_window"], summary["last_avg_loss"], summary["avg_window"],
             summary["tgs"] or 0.0, 100 * summary["data_wait_share"], saver.dir)
    return summary


def finished_run(out: str, rank: int, checkpoint: str, step: int, total_steps: int) -> dict:
    """A resume whose newest checkpoint is already the run's last step (a job scheduler re-running
    a finished launch, or a kill after the final checkpoint): nothing to do. Nothing is written: the
    run's summary, curves and checkpoints stay as they are. Returns the run's summary (its
    ``train_summary_rank_{rank}.json``, {} if it has none)."""
    log.info("resume_training: %s is at step %d, the run's last (total steps %d): nothing left to do; the "
             "summary, curves and checkpoints are left as they are", checkpoint, step, total_steps)
    path = os.path.join(out, f"train_summary_rank_{rank}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    return {}
