"""The one place that turns ``context`` / ``parallel`` / ``parallel_config`` into MindSpore global
state, joins the process group, and refuses what the device cannot do.

Facts this relies on (measured on MindSpore 2.10, see shared NOTES.md): on CPU, DATA_PARALLEL
across processes works (AllReduce sum), operator sharding (SEMI_AUTO_PARALLEL) and pipeline
stages fail to compile with ``Invalid backend: CPU``, bf16 kernels are missing, and
``jit_level: O2`` is silently ignored.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from msllm.config import RunConfig
from msllm.errors import MsllmError
from msllm.kernels.select import check_bf16_compute

log = logging.getLogger("msllm")


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: ``rank`` in ``0..world_size-1`` and the device type."""

    rank: int
    world_size: int
    device_target: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """Processes in the job as the launcher announced them (``MS_WORKER_NUM`` on a CPU cluster,
    ``RANK_SIZE`` under an HCCL rank table); 1 when started alone."""
    for key in ("MS_WORKER_NUM", "RANK_SIZE"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def launcher_role() -> tuple[str, int | None]:
    """What ``scripts/run_distribute.sh`` (:mod:`msllm.cluster.launch`) started this process as:
    ``("worker", rank)`` (env ``RANK_ID``, set for every worker on Ascend and CPU),
    ``("scheduler", None)`` (env ``MS_ROLE=MS_SCHED``, CPU/GPU clusters), or ``("alone", None)``
    when started by hand. Raises MsllmError for a malformed ``RANK_ID``."""
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return "scheduler", None
    raw = os.environ.get("RANK_ID", "").strip()
    if not raw:
        return "alone", None
    if not raw.isdigit():
        raise MsllmError(f"environment RANK_ID={raw!r}: expected a rank number")
    return "worker", int(raw)


def check_device_support(cfg: RunConfig, inference: bool = False) -> None:
    """Raise one clear :class:`MsllmError` if ``cfg`` asks the device for something it cannot do.

    Any device: a pipeline split MindFormers would refuse (:mod:`msllm.training.pipeline`);
    semi-auto parallel needs ``full_batch``. (``runner_config.sink_mode`` does not stop a run: msllm feeds steps one by one
    and says so in the start-up line of :func:`msllm.settings.log_settings`.)
    CPU: no expert_parallel / model_parallel / pipeline_stage > 1, no semi/auto parallel mode, no bf16/fp16 compute
    (bf16 kernels are missing on CPU; fp16 runs but only slower than fp32, so it is refused too
    rather than silently slow), except ``compute_dtype`` bfloat16 on the fast path: msllm's CPU kernels
    round the linear GEMMs' inputs to bfloat16 (:mod:`msllm.kernels.select` says what else it needs),
    with float32 parameters for training. ``inference`` (predict, chat, serve, evaluate): parameters may be
    stored in bfloat16 (``param_init_type`` / ``embedding_init_type``) with float32 compute on the
    CPU fast path, whose linear kernel reads bf16 weights (``msllm/kernels/csrc/linear.cc``), or with
    ``compute_dtype`` bfloat16 (the GEMMs take the bf16 weights as stored and round the activations).
    """
    check_quantization(cfg, inference)
    if cfg.context.device_target != "CPU":
        check_layout_trainable(cfg)
        return
    pc = cfg.parallel_config
    if pc.expert_parallel > 1:
        raise MsllmError(
            f"parallel_config.expert_parallel={pc.expert_parallel} on CPU: expert parallelism moves tokens to "
            "their experts' ranks by all-to-all, and MindSpore 2.10 has no AlltoAll kernel on CPU (nor operator "
            "sharding). Train it on Ascend; on CPU set expert_parallel=1 (every rank holds every expert, data "
            "parallel). The offline tools (strategy files, transform_ckpt, plan) accept it.")
    if pc.model_parallel > 1 or pc.pipeline_stage > 1:
        raise MsllmError(
            f"parallel_config asks for model_parallel={pc.model_parallel}, pipeline_stage="
            f"{pc.pipeline_stage}, but context.device_target is CPU: MindSpore 2.10 cannot compile "
            "operator sharding or pipeline stages on CPU ('Invalid backend: CPU'). Train this layout "
            "on Ascend; on CPU use data_parallel only (set parallel_config.model_parallel=1 and "
            "pipeline_stage=1). The offline tools (strategy files, transform_ckpt, plan) accept it.")
    if cfg.parallel.mode_name != "data_parallel":
        raise MsllmError(
            f"parallel.parallel_mode={cfg.parallel.parallel_mode!r} needs operator sharding, which "
            "MindSpore 2.10 cannot compile on CPU; use parallel_mode: 0 (data_parallel) on CPU")
    mc = cfg.model_config
    stored = {mc.param_init_type, mc.embedding_init_type or mc.param_init_type}
    bf16_inference = inference and stored <= {"float32", "bfloat16"} and cfg.fast_paths
    # bf16-input GEMMs on msllm's CPU kernels (whether they are built: choose()); bfloat16
    # weights for inference only
    if mc.compute_dtype == "bfloat16" and cfg.fast_paths:
        check_bf16_compute(mc, inference=inference)
        return
    if mc.compute_dtype != "float32" or (stored != {"float32"} and not bf16_inference):
        raise MsllmError(
            f"model.model_config.compute_dtype={mc.compute_dtype!r} / param_init_type="
            f"{mc.param_init_type!r} / embedding_init_type={mc.embedding_init_type!r}: MindSpore 2.10 on CPU "
            "has no bf16 kernels (MatMul, Softmax ...) and fp16 only runs slower; use float32 on CPU (training "
            "and fine-tuning also take compute_dtype bfloat16 with float32 parameters: msllm's CPU kernels round "
            "the GEMMs' inputs to bfloat16; for predict / chat / serve / evaluate, param_init_type bfloat16 with "
            "compute_dtype float32 keeps the weights in bfloat16 for msllm's CPU kernels, float32 arithmetic, "
            "and with compute_dtype bfloat16 rounds the GEMMs' activations too)")


def check_quantization(cfg: RunConfig, inference: bool) -> None:
    """MsllmError unless ``model.model_config.quantization_config`` (weight-only int8,
    :mod:`msllm.models.llama.quantization`) is absent or asked of inference on the CPU fast path,
    where msllm's ``linear_int8`` kernel runs it: the int8 weights have no gradient (training,
    fine-tuning and DPO update float weights), and no other device has the kernel."""
    qc = cfg.model_config.quantization_config
    if qc is None:
        return
    if not inference:
        raise MsllmError("model.model_config.quantization_config (weight-only int8) is for inference only (predict, "
                         "chat, serve, evaluate): training updates float weights; remove it (or param_init_type int8) "
                         "for train / finetune")
    if cfg.context.device_target != "CPU" or not cfg.fast_paths:
        raise MsllmError(f"model.model_config.quantization_config (weight-only int8) runs on msllm's CPU kernels: "
                         f"context.device_target CPU without operator sharding (got {cfg.context.device_target!r}, "
                         f"fast path {cfg.fast_paths}); on Ascend quantize with MindSpore Golden-Stick")


def check_layout_trainable(cfg: RunConfig) -> None:
    """Raise MsllmError for layouts msllm's trainer cannot train on any device (see
    :func:`check_device_support`)."""
    pc = cfg.parallel_config
    if pc.pipeline_stage > 1:  # the split must be one MindFormers would accept (msllm/training/pipeline.py)
        from msllm.parallel.stage_split import stage_layers_of

        stage_layers_of(cfg.model_config, pc.pipeline_stage)
    if cfg.parallel.mode_name != "data_parallel" and not cfg.parallel.full_batch:
        raise MsllmError("parallel.full_batch must be True with semi_auto_parallel: every rank reads "
                         "the global batch and MindSpore splits it by the layout")


def setup_runtime(cfg: RunConfig, inference: bool = False) -> Runtime:
    """Configure MindSpore for ``cfg``, join the process group if there is one, seed RNGs.

    Raises:
        MsllmError: unsupported layout for the device (:func:`check_device_support`), or the
            layout's device count (data_parallel x model_parallel x pipeline_stage) differs from
            the number of processes started.
    """
    import mindspore as ms

    check_device_support(cfg, inference)
    ctx = cfg.context
    if ctx.device_target == "CPU":
        ms.set_device("CPU")
    else:  # the launcher's DEVICE_ID (from the rank table) wins over the YAML's device_id
        ms.set_device(ctx.device_target, int(os.environ.get("DEVICE_ID", ctx.device_id)))
    jit_level = ctx.jit_level
    if ctx.device_target == "CPU" and jit_level == "O2":
        log.warning("context.jit_level O2 (GE graph mode) exists on Ascend only; CPU runs O0")
        jit_level = "O0"
    ms.set_context(mode=ms.GRAPH_MODE if ctx.mode == 0 else ms.PYNATIVE_MODE,
                   jit_config={"jit_level": jit_level}, max_call_depth=ctx.max_call_depth)
    if ctx.max_device_memory and ctx.device_target != "CPU":
        ms.set_context(max_device_memory=ctx.max_device_memory)
    if cfg.deterministic:
        ms.set_context(deterministic="ON")

    world = env_world_size()
    rank = 0
    if world > 1:
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank, world = get_rank(), get_group_size()
    want = cfg.parallel_config.device_num
    if want != world:
        pc = cfg.parallel_config
        raise MsllmError(
            f"parallel_config needs data_parallel x model_parallel x pipeline_stage = "
            f"{pc.data_parallel} x {pc.model_parallel} x {pc.pipeline_stage} = {want} processes, but "
            f"{world} were started; start {want} (scripts/run_distribute.sh ... RANK_SIZE={want}) "
            f"or override --parallel_config.data_parallel={world}")
    from msllm.parallel.context import parallel_context_kwargs  # validates the layout against the model

    kwargs = parallel_context_kwargs(cfg, rank)
    if world > 1:
        ms.set_auto_parallel_context(**kwargs)
    ms.set_seed(cfg.seed)
    np.random.seed(cfg.seed)
    ms.dataset.config.set_seed(cfg.seed)
    return Runtime(rank=rank, world_size=world, device_target=ctx.device_target)


def setup_logging(rank: int) -> None:
    """The root logger at INFO with this rank's number on every line (the per-rank log files that
    ``run_distribute.sh`` collects are this output)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s", force=True)
