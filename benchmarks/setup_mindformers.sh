#!/usr/bin/env bash
# Create benchmarks/.venv-mindformers: MindFormers 1.9.0 on MindSpore 2.9.0 (the newest pair that
# installs from PyPI here; see shared NOTES.md), for the side-by-side benchmarks. Idempotent.
#   bash benchmarks/setup_mindformers.sh            # uses python3.11 / python3
# Env: PYTHON (interpreter for the venv), MF_VENV (venv path).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MF_VENV:-$HERE/.venv-mindformers}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ -f "$VENV/.installed" ]; then
  echo "MindFormers venv ready: $VENV"; exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# numpy<2: the MindSpore wheels are built against numpy 1.x; transformers==4.57.1: MindFormers 1.9.0 pins it.
"$VENV/bin/python" -m pip install -q "mindspore==2.9.0" "mindformers==1.9.0" "numpy<2" "transformers==4.57.1" \
  sentencepiece pyyaml tqdm
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
for p in ("mindspore", "mindformers", "numpy", "transformers"):
    print(f"{p}=={md.version(p)}")
PYEOF
touch "$VENV/.installed"
echo "MindFormers venv ready: $VENV"
