"""The child process of a dry-run: compile the configured train step for one rank, nothing more.

Started by :mod:`msllm.dryrun.driver` with the environment of
:func:`msllm.cluster.simulation.simulation_env` (``MS_SIMULATION_LEVEL``, ``RANK_SIZE``, ``RANK_ID``,
the device layer on ``LD_LIBRARY_PATH``). It builds exactly what a real Ascend launch builds —
:func:`msllm.cluster.context.setup_runtime` (MindSpore context, ``init()``, the auto-parallel
context with this rank's strategy file), the model with :func:`msllm.parallel.apply.apply_layout`,
AdamW, and the train step (:func:`msllm.training.setup.build_train_step`, or
:func:`msllm.training.pipeline.build_pipeline_train_step` when ``pipeline_stage`` > 1) — and then
runs one step through MindSpore's simulated device with inputs shaped from the YAML: ``(B, seq_length + 1)`` int32 with
``B = batch_size x data_parallel x micro_batch_num (pipelines) x gradient_accumulation_steps``,
the global batch every rank feeds under ``full_batch``. No dataset is read; the simulated step computes nothing (its outputs are not meaningful).

Weights: msllm's parameters are ``mindspore.common.initializer``s, built inside
``mindspore.nn.utils.no_init_parameters()``, so nothing is filled while building; MindSpore slices
each one to the rank's shape when compiling (``mindspore/parallel/_utils.py _slice_parameter``) and
fills the slice on the host when the level-1 step runs (``Tensor.init_data``). Before that,
:func:`zero_initializers` swaps every deferred initializer for ``Zero``, for which ``init_data``
allocates with ``np.zeros`` and writes nothing (``mindspore/common/tensor.py``): the pages are
never touched (the simulated device copies nothing), so a rank's weights and optimizer states cost
no host memory. Nothing is computed in a dry-run, so the values do not matter; the shapes and dtypes,
which the compile and the memory count use, are unchanged.

The last line of stdout is ``MSLLM_DRYRUN_RESULT {json}`` (stage, jit level used, ...) or
``MSLLM_DRYRUN_ERROR {json}`` with MindSpore's message; MindSpore prints the level-1 memory
figures itself at exit, which the parent reads.

Usage (internal): ``python -m msllm.dryrun.compile --config CONFIG [--key=value ...]`` (overrides
already in msllm's ``--section.key=value`` form: the parent normalized them).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np

RESULT = "MSLLM_DRYRUN_RESULT"
ERROR = "MSLLM_DRYRUN_ERROR"

log = logging.getLogger("msllm")


def global_batch(cfg) -> int:
    """Rows every rank feeds per step (``full_batch``): ``batch_size x data_parallel x
    micro_batch_num`` (pipelines) ``x gradient_accumulation_steps`` (MindFormers' global batch)."""
    from msllm.parallel.layout_checks import global_batch_size

    return global_batch_size(cfg)


def packed_documents(cfg) -> int:
    """Documents per row (the ``actual_seq_len`` width, :func:`msllm.data.dataset.packed_layout`)
    when ``train_dataset.dataset_dir`` names packed MindRecords, else 0 (unpacked rows, also when
    no dataset is configured: the dry-run needs none). Only the files' schema and that one column
    are read; the rows are shaped from the YAML as ever. Raises MsllmError for a dataset that
    does not fit the model (as training would), or packed rows with a layout msllm refuses them
    for (:func:`msllm.parallel.layout_checks.check_packed_layout`)."""
    from msllm.data.dataset import packed_layout
    from msllm.data.mindrecord import check_dataset
    from msllm.parallel.layout_checks import check_packed_layout

    source = cfg.train_dataset.dataset_dir
    if not source or not os.path.exists(source) or cfg.dpo is not None:
        return 0
    layout, documents = packed_layout(check_dataset(source, cfg.model_config.seq_length),
                                      cfg.model_config.seq_length)
    if layout == "rows":
        return 0
    check_packed_layout(cfg, source)
    return documents


def zero_initializers(cell) -> int:
    """Replace the deferred initializer of every not yet filled parameter of ``cell`` by ``Zero``
    with the same shape and dtype (see the module docstring: a zero slice costs no host memory).
    Returns how many were replaced."""
    from mindspore.common.initializer import Zero, initializer

    n = 0
    for p in cell.get_parameters():
        mode = getattr(p, "init_mode", None)
        if p.has_init and mode is not None and not isinstance(mode.init, Zero):
            p.init_mode = initializer("zeros", mode.shape, mode.dtype)
            n += 1
    return n


def compile_train_step(cfg) -> dict:
    """Build and compile ``cfg``'s train step on this simulated rank; returns facts for the report.
    Raises whatever MindSpore raises for a layout it rejects."""
    import mindspore as ms
    from mindspore.nn.utils import no_init_parameters

    from msllm.cluster.context import setup_logging, setup_runtime
    from msllm.parallel.param_layout import stage_of_rank
    from msllm.parallel import stage_split
    from msllm.training.setup import build_network, build_optimizer, build_train_step

    rt = setup_runtime(cfg)
    setup_logging(rt.rank)
    pc, mc = cfg.parallel_config, cfg.model_config
    stage_layers = stage_split.stage_layers_of(mc, pc.pipeline_stage) if mc.pp_interleave_num == 1 else None
    steps = 4  # the learning-rate table's length; the compiled graph does not depend on it
    # the trainer's own builders (training/setup.py), inside mindspore.nn.utils.no_init_parameters()
    # (MindSpore's way to build a network without filling its weights; its effect on the dry-run's
    # host memory is not established, see docs/dryrun.md)
    documents = packed_documents(cfg)
    with no_init_parameters():
        # LoRA (pet_config): adapters on the base as built; no base checkpoint is read
        network, _ = build_network(cfg, rt, sharded=cfg.parallel.mode_name != "data_parallel", load_base=False,
                                   packed=documents > 0)
        optimizer = build_optimizer(network, cfg, np.full(steps, cfg.lr_schedule.learning_rate, np.float32))
        step = build_train_step(network, optimizer, cfg, rt, packed=documents > 0)
    zeroed = zero_initializers(step)
    rows = global_batch(cfg)
    shape = (rows, mc.seq_length + 1)
    ids = ms.Tensor(np.zeros(shape, np.int32))
    inputs = (ids, ids)
    if documents:  # packed rows: every row one document ending at seq_length (the values are not used)
        inputs += (ms.Tensor(np.full((rows, documents), mc.seq_length, np.int32)),)
    if os.environ.get("MS_SIMULATION_LEVEL") == "0":
        step.compile(*inputs)  # level 0: the compile alone
    else:
        # level 1: one step through MindSpore's simulated device; its host-side run counts each
        # operator's device memory (printed at exit); nothing is computed
        # (docs: mindspore-ai/docs tutorials/source_en/debug/dryrun.md)
        step(*inputs)
    return {"rank": rt.rank, "rank_size": rt.world_size, "stage": stage_of_rank(rt.rank, pc),
            "input_shape": list(shape), "packed_documents": documents, "stage_layers": stage_layers,
            "pipeline_train_step": pc.pipeline_stage > 1, "zero_initialized_parameters": zeroed}


def main(argv: list[str] | None = None) -> int:
    from msllm.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "--config":  # the parent passes normalized --key=value overrides
        print("usage: python -m msllm.dryrun.compile --config CONFIG [--key=value ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[1], argv[2:])
    from msllm.errors import MsllmError

    try:
        facts = compile_train_step(cfg)
    except MsllmError as exc:  # msllm's own refusal inside the build: not MindSpore's
        print(f"{ERROR} {json.dumps({'type': 'MsllmError', 'message': str(exc)})}", flush=True)
        return 2
    except Exception as exc:  # MindSpore's RuntimeError/ValueError/TypeError: reported, not a traceback
        print(f"{ERROR} {json.dumps({'type': type(exc).__name__, 'message': str(exc)})}", flush=True)
        return 2
    print(f"{RESULT} {json.dumps(facts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
