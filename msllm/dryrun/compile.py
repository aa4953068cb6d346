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
``mindspore.nn.utils.no_init_parameters()``; measured on the 13B job's rank 0, the host still fills
gigabytes (3.7 and 5.5 GB RSS in two runs with fp16 weights, 15.8 GB with fp32 weights at level 0,
stopped): keeping the host to what compiling needs is open (docs/dryrun.md).

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
    if cfg.pet_config is not None:
        raise ValueError("pet_config (LoRA): the dry-run compiles full training only; LoRA's "
                         "frozen base is loaded from load_checkpoint, which a dry-run does not read")
    stage_layers = stage_split.stage_layers_of(mc, pc.pipeline_stage) if mc.pp_interleave_num == 1 else None
    steps = 4  # the learning-rate table's length; the compiled graph does not depend on it
    # the trainer's own builders (training/setup.py), inside mindspore.nn.utils.no_init_parameters()
    # (MindSpore's way to build a network without filling its weights; its effect on the dry-run's
    # host memory is not established, see docs/dryrun.md)
    with no_init_parameters():
        network, _ = build_network(cfg, rt, sharded=cfg.parallel.mode_name != "data_parallel")
        optimizer = build_optimizer(network, cfg, np.full(steps, cfg.lr_schedule.learning_rate, np.float32))
        step = build_train_step(network, optimizer, cfg, rt)
    rows = global_batch(cfg)
    shape = (rows, mc.seq_length + 1)
    ids = ms.Tensor(np.zeros(shape, np.int32))
    if os.environ.get("MS_SIMULATION_LEVEL") == "0":
        step.compile(ids, ids)  # level 0: the compile alone
    else:
        # level 1: one step through MindSpore's simulated device; its host-side run counts each
        # operator's device memory (printed at exit); nothing is computed
        # (docs: mindspore-ai/docs tutorials/source_en/debug/dryrun.md)
        step(ids, ids)
    return {"rank": rt.rank, "rank_size": rt.world_size, "stage": stage_of_rank(rt.rank, pc),
            "input_shape": list(shape), "stage_layers": stage_layers,
            "pipeline_train_step": pc.pipeline_stage > 1}


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
