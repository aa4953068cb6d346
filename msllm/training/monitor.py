"""The per-step log line and the loss history of a run.

Line format follows MindFormers' ``MFLossMonitor`` so existing log parsers keep working, with
throughput appended::

    Epoch:[  1/  2], step:[   10/  248], loss:[10.123/10.234], time:812.300 ms, lr:[1.0e-04],
    overflow cond: False, loss_scale: 65536.0, grad_norm: 0.930, tgs: 1260.5 tokens/s/device,
    TFLOPs: 0.039, MFU: 5.30%, HFU: 4.12%

and, with experts, ``, aux_loss: 0.02512, dropped: 3.12%, expert share min/max: 21.0%/29.5%``
(the load-balancing loss, the token choices the capacity dropped, the experts' shares of the
choices; with data parallel the shares and the balancing counts are the global batch's).

MFU counts model FLOPs (PaLM's 6N + 12LHDT), HFU the FLOPs the step executes
(:class:`msllm.training.throughput.Throughput`).

``loss:[current/average]``: this step's loss and the mean of the logged losses so far.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from msllm.fileio import write_json_atomic
from msllm.training.throughput import Throughput

log = logging.getLogger("msllm")


@dataclass
class StepRecord:
    """One optimizer step: global step (1-based), epoch (1-based), loss, seconds, lr, scale."""

    step: int
    epoch: int
    loss: float
    seconds: float
    lr: float
    overflow: bool
    loss_scale: float
    grad_norm: float
    data_seconds: float = 0.0  # time spent waiting for the batch before the step
    head_fraction: float = 1.0  # share of positions the output head ran at (compact loss: targets)
    # mixture of experts: (load-balancing loss, fraction of token choices dropped by the capacity,
    # smallest and largest expert share of the token choices), from the model's router stats
    moe: tuple | None = None
    # DPO: {TRL metric name: batch mean} (msllm.training.dpo.METRIC_NAMES)
    metrics: dict | None = None


def router_summary(stats) -> tuple:
    """A mixture of experts' router stats (E + 2,) (``[aux loss, dropped fraction, each expert's
    share]``, :class:`msllm.models.llama.model.LlamaForCausalLM`) -> (aux loss, dropped fraction,
    smallest share, largest share) floats for :class:`StepRecord`."""
    shares = [float(x) for x in stats[2:]]
    return float(stats[0]), float(stats[1]), min(shares), max(shares)


@dataclass
class LossMonitor:
    """Collects :class:`StepRecord` s and prints one line every ``per_print_times`` steps."""

    epochs: int
    total_steps: int
    throughput: Throughput
    per_print_times: int = 1
    records: list = field(default_factory=list)
    warned_peak: bool = False

    def _util_text(self, seconds: float, head_fraction: float) -> str:
        mfu, hfu = self.throughput.mfu(seconds), self.throughput.hfu(seconds, head_fraction)
        if mfu is None:
            return "MFU: n/a, HFU: n/a (set context.peak_tflops)"
        if max(mfu, hfu) > 1.0 and not self.warned_peak:
            # HFU cannot pass 100% with a true peak: the peak in use is below what this device just did
            self.warned_peak = True
            log.warning("%s %.1f%% is above 100%%: %s", "HFU" if hfu > 1.0 else "MFU", max(mfu, hfu) * 100,
                        "the peak in use (%.4g TFLOP/s per device) is lower than what this device executed; set "
                        "context.peak_tflops to the device's documented peak" % self.throughput.peak_tflops
                        if hfu > 1.0 else "the model FLOPs count work the step skips (causal attention blocks, "
                        "the output head off target positions); HFU is the hardware figure")
        return f"MFU: {mfu * 100:.2f}%, HFU: {hfu * 100:.2f}%"

    def format(self, r: StepRecord) -> str:
        avg = sum(x.loss for x in self.records) / len(self.records)
        return (f"Epoch:[{r.epoch:3d}/{self.epochs:3d}], step:[{r.step:5d}/{self.total_steps:5d}], "
                f"loss:[{r.loss:.3f}/{avg:.3f}], time:{r.seconds * 1000:.3f} ms, lr:[{r.lr:.4e}], "
                f"overflow cond: {r.overflow}, loss_scale: {r.loss_scale}, grad_norm: {r.grad_norm:.3f}, "
                f"tgs: {self.throughput.tgs(r.seconds):.1f} tokens/s/device, "
                f"TFLOPs: {self.throughput.tflops(r.seconds):.4f}, {self._util_text(r.seconds, r.head_fraction)}"
                + (f", aux_loss: {r.moe[0]:.5f}, dropped: {r.moe[1] * 100:.2f}%, "
                   f"expert share min/max: {r.moe[2] * 100:.1f}%/{r.moe[3] * 100:.1f}%" if r.moe else "")
                + "".join(f", {k}: {v:.4f}" for k, v in (r.metrics or {}).items()))

    def add(self, r: StepRecord) -> None:
        self.records.append(r)
        if r.step % self.per_print_times == 0 or r.step == self.total_steps:
            log.info(self.format(r))

    def summary(self, window: int = 10) -> dict:
        """First/last ``window``-step average loss, and tgs over steps after the first (compile)."""
        losses = [r.loss for r in self.records]
        rows = self.records[1:] or self.records
        timed = [r.seconds for r in rows]
        mean_s = sum(timed) / len(timed) if timed else float("nan")
        head = sum(r.head_fraction for r in rows) / len(rows) if rows else 1.0
        w = max(1, min(window, len(losses) // 2 or 1))
        return {
            "steps": len(losses),
            "first_avg_loss": sum(losses[:w]) / w if losses else None,
            "last_avg_loss": sum(losses[-w:]) / w if losses else None,
            "avg_window": w,
            "compile_first_step_seconds": self.records[0].seconds if self.records else None,
            "mean_step_seconds": mean_s,
            "tgs": self.throughput.tgs(mean_s) if timed else None,
            "tflops": self.throughput.tflops(mean_s) if timed else None,
            "mfu": self.throughput.mfu(mean_s) if timed else None,
            "hfu": self.throughput.hfu(mean_s, head) if timed else None,
            "peak_tflops": self.throughput.peak_tflops,
            "flops_per_token": self.throughput.flops_per_token,
            "executed_flops_per_token": self.throughput.executed_flops_per_token(head),
            "head_fraction": head,
            "data_wait_share": (sum(r.data_seconds for r in self.records[1:])
                                / max(1e-12, sum(r.data_seconds + r.seconds for r in self.records[1:])))
            if len(self.records) > 1 else 0.0,
            "losses": losses,
            **({"aux_losses": [r.moe[0] for r in self.records], "dropped_fractions": [r.moe[1] for r in self.records],
                "expert_share_min_max": [[r.moe[2], r.moe[3]] for r in self.records]}
               if self.records and self.records[0].moe else {}),
            **({"metrics": [r.metrics for r in self.records]} if self.records and self.records[0].metrics else {}),
        }

    def write(self, path: str, extra: dict | None = None) -> dict:
        """Write :meth:`summary` (plus ``extra``) as JSON atomically; returns it."""
        data = {**self.summary(), **(extra or {})}
        write_json_atomic(path, json.loads(json.dumps(data)))
        return data
