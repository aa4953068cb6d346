"""Training curves: TensorBoard events read back with TensorBoard's own reader equal the values of
the log line; loss-curve PNGs from run summaries (one run, and overlaid runs via
tools/plot_loss.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from msllm.errors import MsllmError
from msllm.training.curves import TAGS, TensorBoardLogger, plot_run, read_run
from msllm.training.monitor import LossMonitor, StepRecord
from msllm.training.throughput import Throughput

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 7


def records(n=12, seed=SEED):
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    return [StepRecord(step=s, epoch=1, loss=float(10.4 - 0.3 * s + rng.normal(0, 0.05)), seconds=float(0.8 + 0.1 * rng.random()),
                       lr=float(2e-3 * min(1.0, s / 4)), overflow=False, loss_scale=65536.0 / (1 + (s > 6)),
                       grad_norm=float(1.5 + rng.random())) for s in range(1, n + 1)]


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_equal_the_log_line(tmp_path, caplog):
    monitor = LossMonitor(epochs=1, total_steps=12, throughput=Throughput(8 * 256, 1.0e8, None))
    tb = TensorBoardLogger(str(tmp_path / "tb"), rank=1, queue_size=3, global_batch_size=16)
    recs = records()
    with caplog.at_level("INFO", logger="msllm"):
        for r in recs:
            monitor.add(r)
            tb.log_step(r, monitor.throughput.tgs(r.seconds))
        tb.log_eval(6, 5.25, float(np.exp(5.25)))
        tb.log_eval(12, 4.5, float(np.exp(4.5)))
    tb.close()
    lines = [m for m in caplog.messages if m.startswith("Epoch:")]
    assert len(lines) == 12
    events = read_events(str(tmp_path / "tb" / "rank_1"))
    for tag in ("loss", "learning-rate", "grad-norm", "loss-scale", "tokens-per-second-per-device",
                "loss_vs_samples", "eval-loss", "eval-perplexity"):
        assert tag in events, tag
    assert [s for s, _ in events["loss"]] == list(range(1, 13))
    assert [s for s, _ in events["loss_vs_samples"]] == [16 * s for s in range(1, 13)]
    for (step, _), line, r in zip(events["loss"], lines, recs):
        ev = {k: dict(events[TAGS[k]])[step] for k in ("loss", "lr", "grad_norm", "loss_scale", "tgs")}
        # the stored values are the logged ones (float32 in the event file) ...
        assert ev["loss"] == np.float32(r.loss) and ev["lr"] == np.float32(r.lr)
        assert ev["grad_norm"] == np.float32(r.grad_norm) and ev["loss_scale"] == np.float32(r.loss_scale)
        # ... and agree with the log line to its printed precision
        loss = float(re.search(r"loss:\[([0-9.]+)/", line).group(1))
        lr = float(re.search(r"lr:\[([0-9.e+-]+)\]", line).group(1))
        gn = float(re.search(r"grad_norm: ([0-9.]+)", line).group(1))
        tgs = float(re.search(r"tgs: ([0-9.]+) tokens", line).group(1))
        scale = float(re.search(r"loss_scale: ([0-9.]+)", line).group(1))
        assert abs(ev["loss"] - loss) <= 5e-4 and abs(ev["grad_norm"] - gn) <= 5e-4
        assert abs(ev["lr"] - lr) <= 5e-5 * lr and abs(ev["tgs"] - tgs) <= 0.05 and ev["loss_scale"] == scale
    assert dict(events["eval-loss"]) == {6: 5.25, 12: 4.5}
    assert dict(events["eval-perplexity"])[12] == pytest.approx(np.exp(4.5), rel=1e-6)


def write_summary(run_dir, losses, start_step=0, evals=None, rank=0):
    os.makedirs(run_dir, exist_ok=True)
    data = {"losses": losses, "start_step": start_step, "rank": rank}
    if evals is not None:
        data["eval"] = evals
    with open(os.path.join(run_dir, f"train_summary_rank_{rank}.json"), "w") as fh:
        json.dump(data, fh)


def check_png(path, min_size=(400, 300)):
    from matplotlib import image

    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    h, w = image.imread(path).shape[:2]
    assert w >= min_size[0] and h >= min_size[1]


def test_loss_curve_png_of_a_run(tmp_path):
    losses = [float(10 * np.exp(-s / 40) + 2) for s in range(120)]
    evals = [{"step": s, "loss": 10 * np.exp(-s / 40) + 2.3, "ppl": 0.0} for s in (30, 60, 90, 120)]
    run = tmp_path / "run_a"
    write_summary(str(run), losses, evals=evals)
    got = read_run(str(run))
    assert got["steps"][0] == 1 and got["eval_steps"] == [30, 60, 90, 120]
    path = plot_run(str(run), 0)
    assert path.endswith("loss_curve_rank_0.png")
    check_png(path)


def test_plot_loss_overlays_runs_and_rejects_bad_input(tmp_path):
    write_summary(str(tmp_path / "lr_2e-3"), [float(9 - 0.05 * s) for s in range(100)])
    write_summary(str(tmp_path / "lr_1e-3"), [float(9 - 0.03 * s) for s in range(50)], start_step=50)
    out = tmp_path / "overlay.png"
    tool = os.path.join(ROOT, "tools", "plot_loss.py")
    proc = subprocess.run([sys.executable, tool, str(tmp_path / "lr_2e-3"), str(tmp_path / "lr_1e-3"),
                           "--out", str(out), "--smooth", "5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_png(str(out))
    assert read_run(str(tmp_path / "lr_1e-3"))["steps"][0] == 51
    bad = subprocess.run([sys.executable, tool, str(tmp_path / "nothing_here")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "train_summary_rank_" in bad.stderr
    write_summary(str(tmp_path / "empty"), [])
    with pytest.raises(MsllmError, match="no per-step 'losses'"):
        read_run(str(tmp_path / "empty"))
