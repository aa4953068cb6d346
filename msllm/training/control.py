"""What the training loop needs besides the model and the step: stopping on a signal between
steps, agreeing with the other data-parallel ranks (the stop vote, the resume step), the
profiler, and the count of positions with a target (for the compact loss's HFU)."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np

log = logging.getLogger("msllm")


class StopSignal:
    """Turns SIGTERM / SIGINT into a flag the loop checks between steps (a handler that saved
    from inside the signal could catch the step half-way)."""

    def __init__(self):
        self.signum = 0

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, _frame):
        self.signum = signum
        log.warning("received %s: stopping after the current step", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class RankAgreement:
    """Small collectives over the data-parallel ranks (CPU-safe: AllReduce sum and AllGather)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        if world_size > 1:
            from mindspore import ops

            self._sum = ops.AllReduce()
            self._gather = ops.AllGather()

    def sums(self, values: list[float]) -> list[float]:
        """``values`` summed element-wise over the ranks, in one AllReduce (float32: the only dtype
        MindSpore 2.10's CPU AllReduce kernel takes; counts stay exact below 2^24)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        import mindspore as ms

        return [float(v) for v in self._sum(ms.Tensor(np.asarray(values, np.float32))).asnumpy()]

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        return self.sums([float(flag)])[0] > 0

    def common_max(self, steps: list[int]) -> int | None:
        """The largest value present in every rank's ``steps`` (None if there is none); exact for
        any step number and list length (:func:`msllm.cluster.gather.all_gather_json`)."""
        if self.world_size == 1:
            return max(steps) if steps else None
        from msllm.cluster.gather import all_gather_json

        every = all_gather_json(sorted(int(s) for s in steps), self.world_size, self._gather)
        common = set(every[0])
        for row in every[1:]:
            common &= set(row)
        return max(common) if common else None


def start_profiler(out: str, rank: int):
    """A MindSpore profiler writing to ``out/profile/rank_{rank}``, not yet started."""
    import mindspore as ms

    return ms.Profiler(start_profile=False, output_path=os.path.join(out, "profile", f"rank_{rank}"))


def stop_profiler(profiler, out: str, rank: int) -> None:
    """Stop, analyse, and say where the profile is."""
    profiler.stop()
    profiler.analyse()
    log.info("profile written to %s (trace_view.json opens in chrome://tracing or Perfetto)",
             os.path.join(out, "profile", f"rank_{rank}"))


def target_count(labels, ignore_token_id: int) -> tuple[int, int]:
    """``(positions with a target, positions)`` of a batch: ``labels`` (B, T+1) int32 (a MindSpore
    tensor or array; targets are ``labels[:, 1:]``), ``ignore_token_id`` marks the others."""
    targets = np.asarray(labels.asnumpy() if hasattr(labels, "asnumpy") else labels)[:, 1:]
    return int((targets != ignore_token_id).sum()), int(targets.size)
