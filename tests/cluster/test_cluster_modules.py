"""The split of msllm/cluster into one-job modules: no import cycle, each module importable on its
own, and the import paths used outside msllm/cluster (tools/, other test areas) still valid."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.imports import find_cycle, import_graph

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "msllm" / "cluster"
MODULES = sorted(p.stem for p in CLUSTER.glob("*.py") if p.stem != "__init__")


def test_cluster_modules_import_each_other_without_a_cycle():
    graph = {m.rsplit(".", 1)[1]: {d.rsplit(".", 1)[1] for d in deps if d.startswith("msllm.cluster.")}
             for m, deps in import_graph("msllm.cluster").items() if m != "msllm.cluster"}
    print("import graph:", graph)
    assert set(graph) == set(MODULES)
    assert graph["rank_table_format"] == set()  # the base: the format knows nothing else
    for m, deps in graph.items():
        assert deps <= set(graph), f"{m} imports a msllm.cluster module that does not exist: {deps - set(graph)}"
    assert find_cycle(graph) is None, find_cycle(graph)


@pytest.mark.parametrize("module", MODULES)
def test_each_cluster_module_imports_first_in_a_fresh_interpreter(module):
    proc = subprocess.run([sys.executable, "-c", f"import msllm.cluster.{module}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_import_paths_used_outside_the_cluster_package():
    # tools/hccl_tools.py, tools/merge_hccl.py and the multi-process tests of generation, training,
    # lora and eval import these names from msllm.cluster.rank_table.
    from msllm.cluster import rank_table, rank_table_devices, rank_table_format
    from msllm.cluster.rank_table import (  # noqa: F401
        DEFAULT_HCCN_CONF,
        make_rank_table,
        merge_rank_table_files,
        save_rank_table,
        write_server_rank_table,
    )

    assert make_rank_table is rank_table_format.make_rank_table
    assert DEFAULT_HCCN_CONF == rank_table_devices.DEFAULT_HCCN_CONF == "/etc/hccn.conf"
    assert set(rank_table.__all__) <= set(dir(rank_table))
    # scripts/run_distribute.sh runs `python -m msllm.cluster.launch`: too few arguments is a usage error
    proc = subprocess.run([sys.executable, "-m", "msllm.cluster.launch"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "expected at least 4 arguments" in proc.stderr and "usage: bash scripts/run_distribute.sh" in proc.stderr
