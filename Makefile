# make demo  : set up .venv if needed, then run the main job on the bundled real data
# make test  : set up .venv if needed, then run the test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: install kernels demo test test-fast clean

install: $(VENV)/.installed kernels

# msllm's CPU kernels (msllm/kernels/csrc -> msllm/kernels/_build, g++ >= 10): a no-op when the
# build is up to date for these sources, this CPU and this MindSpore; without a compiler the
# model uses MindSpore's operators (said once at start-up)
kernels: $(VENV)/.installed
	$(PY) -m msllm.kernels.build || echo "msllm kernels not built: the model falls back to MindSpore's operators"

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: install
	bash scripts/run_demo.sh

# each full run writes every test's duration to tests/durations.txt (committed: the slow ones stay visible);
# three parts one after another, each on 2 pytest-xdist workers (tests/run_parts.sh says why: one
# process outgrew the machine, and one process leaves the second core idle)
test: install
	MSLLM_DURATIONS_FILE=tests/durations.txt PY=$(PY) bash tests/run_parts.sh

test-fast: install
	$(PY) -m pytest tests -m "not slow"

clean:
	rm -rf output build *.egg-info
