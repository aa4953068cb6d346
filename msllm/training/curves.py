"""Training curves: TensorBoard events (tensorboardX) and loss-curve PNGs (matplotlib, Agg).

TensorBoard as MindFormers 1.5+ writes it (``mindformers/utils/tensorboard.py``: one
``tensorboardX.SummaryWriter(log_dir=tensorboard_dir/rank_{r}, max_queue=tensorboard_queue_size)``
per rank; ``mindformers/core/callback/callback.py`` ``MFLossMonitor``): scalars per step under
MindFormers' tags ``loss``, ``learning-rate``, ``grad-norm``, ``loss-scale`` and their
``"<tag> vs samples"`` twins (x = step x global batch size; tensorboardX stores the name with
underscores, ``loss_vs_samples``, as it does MindFormers'). MindFormers has no tag for tokens per
second per device nor for evaluation; msllm adds ``tokens-per-second-per-device`` (the log line's
``tgs``), ``eval-loss`` and ``eval-perplexity``.

PNG: :func:`plot_runs` draws the train loss per step (and the evaluation loss where recorded) of
one or more runs from their ``train_summary_rank_{r}.json`` (``losses`` per step from
``start_step + 1``; optional ``eval``: ``[{"step", "loss", "ppl", ...}]``).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional, Sequence

from msllm.errors import MsllmError
from msllm.fileio import atomic_path

TAGS = {"loss": "loss", "lr": "learning-rate", "grad_norm": "grad-norm", "loss_scale": "loss-scale",
        "tgs": "tokens-per-second-per-device", "eval_loss": "eval-loss", "eval_ppl": "eval-perplexity"}


class TensorBoardLogger:
    """Per-rank TensorBoard writer for the training loop.

    Args:
        tensorboard_dir: the ``tensorboard.tensorboard_dir`` of the run; events go to
            ``tensorboard_dir/rank_{rank}``.
        queue_size: ``tensorboard.tensorboard_queue_size`` (tensorboardX ``max_queue``: events
            buffered before a write).
        global_batch_size: samples per optimizer step over all ranks (for the "vs samples" tags).
    """

    def __init__(self, tensorboard_dir: str, rank: int = 0, queue_size: int = 10, global_batch_size: int = 1):
        from tensorboardX import SummaryWriter

        self.log_dir = os.path.join(os.path.abspath(tensorboard_dir), f"rank_{rank}")
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir, max_queue=queue_size)
        self.global_batch_size = global_batch_size

    @classmethod
    def from_config(cls, cfg, rank: int, global_batch_size: int) -> Optional["TensorBoardLogger"]:
        """The logger ``cfg.tensorboard`` asks for, or None when ``tensorboard_dir`` is empty."""
        tb = cfg.tensorboard
        if not tb.tensorboard_dir:
            return None
        return cls(tb.tensorboard_dir, rank, tb.tensorboard_queue_size, global_batch_size)

    def _scalar(self, tag: str, value: float, step: int, vs_samples: bool = True) -> None:
        self.writer.add_scalar(tag, float(value), global_step=step)
        if vs_samples:
            # the name tensorboardX stores for MindFormers' "<tag> vs samples"; given with the space, it warns
            # ("Summary name ... is illegal") on every call, 4 lines per logged step
            self.writer.add_scalar(f"{tag}_vs_samples", float(value), global_step=step * self.global_batch_size)

    def log_step(self, record, tgs: Optional[float] = None) -> None:
        """One :class:`msllm.training.monitor.StepRecord` (+ its tokens/s/device)."""
        s = record.step
        self._scalar(TAGS["loss"], record.loss, s)
        self._scalar(TAGS["lr"], record.lr, s)
        self._scalar(TAGS["grad_norm"], record.grad_norm, s)
        self._scalar(TAGS["loss_scale"], record.loss_scale, s)
        if tgs is not None:
            self._scalar(TAGS["tgs"], tgs, s, vs_samples=False)

    def log_eval(self, step: int, loss: float, ppl: float) -> None:
        """Evaluation loss and perplexity at training step ``step``."""
        self._scalar(TAGS["eval_loss"], loss, step, vs_samples=False)
        self._scalar(TAGS["eval_ppl"], ppl, step, vs_samples=False)

    def log_eval_metrics(self, step: int, metrics: dict) -> None:
        """DPO evaluation at training step ``step``: ``loss`` as ``eval-loss``, the others under their
        own names (TRL's ``eval_rewards/chosen``, ...)."""
        for k, v in metrics.items():
            self._scalar(TAGS["eval_loss"] if k == "loss" else k, v, step, vs_samples=False)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_run(run_dir: str, rank: Optional[int] = None) -> dict:
    """A run's curves from ``run_dir/train_summary_rank_{r}.json`` (``rank`` None: the lowest rank
    found): ``{"label", "steps", "losses", "eval_steps", "eval_losses"}``.

    Raises MsllmError if there is no summary or it has no per-step losses."""
    if os.path.isfile(run_dir):
        path = run_dir
    else:
        pattern = f"train_summary_rank_{'*' if rank is None else rank}.json"
        found = sorted(glob.glob(os.path.join(run_dir, pattern)),
                       key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))
        if not found:
            raise MsllmError(f"{run_dir}: no {pattern} (the summary a training run writes in its output_dir)")
        path = found[0]
    try:
        with open(path, encoding="utf-8") as fh:
            summary = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise MsllmError(f"{path}: cannot read the run summary ({exc})") from None
    losses = summary.get("losses")
    if not isinstance(losses, list) or not losses:
        raise MsllmError(f"{path}: no per-step 'losses' to plot")
    start = int(summary.get("start_step") or 0)
    evals = [e for e in summary.get("eval") or [] if isinstance(e, dict) and "step" in e and "loss" in e]
    return {"label": os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
            "path": path, "steps": list(range(start + 1, start + 1 + len(losses))), "losses": losses,
            "eval_steps": [e["step"] for e in evals], "eval_losses": [e["loss"] for e in evals]}


def moving_average(values: Sequence[float], window: int) -> list:
    """Trailing mean over up to ``window`` values (same length as ``values``)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: Sequence[dict], out_png: str, smooth: int = 10, title: Optional[str] = None) -> str:
    """Draw the runs (from :func:`read_run`) into one PNG: per run the raw train loss (faint), its
    ``smooth``-step moving average, and the evaluation loss (markers); written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, run in enumerate(runs):
        c = colors[k % len(colors)]
        label = run["label"] if len(runs) > 1 else "train"
        ax.plot(run["steps"], run["losses"], color=c, alpha=0.25, linewidth=0.8)
        ax.plot(run["steps"], moving_average(run["losses"], max(1, smooth)), color=c, linewidth=1.8,
                label=f"{label} loss ({smooth}-step mean)")
        if run["eval_steps"]:
            ax.plot(run["eval_steps"], run["eval_losses"], color=c, marker="o", linestyle="--", linewidth=1.2,
                    label=f"{run['label'] + ' ' if len(runs) > 1 else ''}eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean token cross-entropy)")
    ax.set_title(title or ("loss: " + ", ".join(r["label"] for r in runs)))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out_png


def plot_run(output_dir: str, rank: int = 0, smooth: int = 10) -> str:
    """The end-of-training picture: ``output_dir/loss_curve_rank_{rank}.png`` from this rank's
    summary. Returns its path."""
    run = read_run(output_dir, rank)
    return plot_runs([run], os.path.join(output_dir, f"loss_curve_rank_{rank}.png"), smooth,
                     title=f"{os.path.abspath(output_dir)} (rank {rank})")
