"""Making TRL's ``DPOTrainer`` importable beside MindSpore (the DPO parity tests' reference).

Why: ``trl`` 1.16.0 imports ``datasets`` (>= 4.7), which imports ``pyarrow``; every ``datasets`` release
trl accepts declares ``pyarrow >= 21`` and the one installed with the project's pins (5.2.0) ``>= 24``,
and pyarrow 22+ refuses NumPy 1.x at import ("pyarrow requires NumPy 2.0 or newer, found 1.26.4"),
while the mindspore 2.10 wheel needs ``numpy<2`` (shared NOTES.md). pip finds no combination that
keeps ``huggingface_hub`` 2.x (checked 2026-11-27 with ``pip install --dry-run``; the only one
downgrades it to 1.33). pyarrow 21.0.0 imports with NumPy 1.26, and ``datasets`` 5.2.0 imports and
works with it (its floor is a declaration, not a runtime check), except that a new ``Dataset``'s
fingerprint (a hash of its state, used only to name cache files) fails to pickle a pyarrow 21 type
(``Can't pickle <class 'MonthDayNano'>``): the helper gives new datasets a random fingerprint instead,
what ``datasets`` itself does when hashing a transform fails. Measured here. So the tests put a
private copy of the registry's pyarrow 21.0.0 wheel (``pip install --no-deps --target``, once, into
``$MSLLM_CACHE/pyarrow-21.0.0``) at the front of ``sys.path`` before anything imports ``datasets``.
The project's environment itself is unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys

from msllm.fileio import build_dir_once

PYARROW = "pyarrow==21.0.0"


def _cache() -> str:
    return os.path.join(os.environ.get("MSLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "msllm"),
                        "pyarrow-21.0.0")


def trl_importable() -> None:
    """Install (once) and put first on ``sys.path`` pyarrow 21.0.0, then import ``datasets`` and
    ``trl.DPOTrainer``. Raises RuntimeError if pip fails or ``datasets`` was already imported with
    another pyarrow."""
    if "pyarrow" in sys.modules and not sys.modules["pyarrow"].__version__.startswith("21."):
        raise RuntimeError(f"pyarrow {sys.modules['pyarrow'].__version__} is already imported; TRL needs 21.0.0 "
                           "beside numpy<2 (tests/helpers/trl_env.py)")
    def install(tmp: str) -> None:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
                            "--target", tmp, PYARROW], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"pip install {PYARROW} --target {tmp} failed: {r.stderr[-2000:]}")

    # once, under a lock: two pytest-xdist workers (or DPO worker processes) may ask at the same time
    target = build_dir_once(_cache(), install, ready=lambda d: os.path.isdir(os.path.join(d, "pyarrow")))
    if target not in sys.path:
        sys.path.insert(0, target)
    import uuid

    import datasets.arrow_dataset

    datasets.arrow_dataset.generate_fingerprint = lambda dataset: uuid.uuid4().hex
    from trl import DPOTrainer  # noqa: F401
