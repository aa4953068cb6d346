"""Compatibility re-exports (issue #13): the former ``msllm.parallel.layout`` is split by job into

* :mod:`msllm.parallel.layout_checks` (layout validation, layers per pipeline stage, run rules),
* :mod:`msllm.parallel.layout_rules` (the sharding rule table: :func:`op_rules`, :func:`cell_stages`),
* :mod:`msllm.parallel.param_layout` (per-parameter layouts, optimizer shard, rank slices),
* :mod:`msllm.parallel.apply` (:func:`apply_layout`, :func:`apply_recompute` on a built network),
* :mod:`msllm.parallel.context` (:func:`parallel_context_kwargs`),
* :mod:`msllm.parallel.strategy_files` (strategy file names and format).

New code imports from those modules. The names below remain importable from here only for the
callers that still use this path; remove this module once they have switched:
``msllm/cluster/context.py`` (parallel_context_kwargs), ``tests/cluster/test_cluster_launch.py``
(param_layouts), ``tests/training/test_training_recompute.py`` (apply_recompute),
``tests/kernels/test_kernels_ascend_wiring.py`` (apply_layout), ``benchmarks/recompute_effect.py``
(apply_recompute), ``benchmarks/planner_vs_measured.py`` (apply_layout).
"""

from msllm.parallel.apply import apply_layout, apply_recompute
from msllm.parallel.context import parallel_context_kwargs
from msllm.parallel.param_layout import param_layouts

__all__ = ["apply_layout", "apply_recompute", "parallel_context_kwargs", "param_layouts"]
