"""The MindSpore auto-parallel context of a run (``mindspore.set_auto_parallel_context`` keyword
arguments), derived from its validated layout. Used on Ascend by :mod:`msllm.cluster.context`;
the strategies themselves are set on the network by :func:`msllm.parallel.apply.apply_layout`.
"""

from __future__ import annotations

import os

from msllm.parallel.layout_checks import optimizer_shard_enabled, validate_run_layout
from msllm.parallel.param_layout import DEFAULT_OPT_THRESHOLD_KB
from msllm.parallel.strategy_files import strategy_file_name, strategy_format


def parallel_context_kwargs(run_config, rank: int = 0) -> dict:
    """Keyword arguments for ``mindspore.set_auto_parallel_context`` on Ascend.

    data_parallel mode: ``parallel_mode``, ``device_num``, ``gradients_mean``.
    semi_auto_parallel mode, additionally: ``full_batch``, ``enable_parallel_optimizer`` and
    ``parallel_optimizer_config`` (threshold 64 KB, ``optimizer_weight_shard_size`` -1 = the
    whole data-parallel group; :func:`msllm.parallel.param_layout.param_layouts` assumes exactly
    these), ``pipeline_stages`` (+ ``pipeline_config`` 1F1B when > 1), and ``strategy_ckpt_config``
    saving this rank's strategy to ``{output_dir}/strategy/ckpt_strategy_rank_{rank}.ckpt``
    (protobuf; ``.json`` when ``parallel.strategy_ckpt_save_file`` ends in .json,
    :func:`msllm.parallel.strategy_files.strategy_format`) with ``only_trainable_params=False``
    (so the AdamW moments are in it and checkpoints with them can be resharded).

    The runtime must also wrap the network for pipelining (``mindspore.nn.PipelineCell(net,
    micro_batch_num)``) and call :func:`msllm.parallel.apply.apply_layout`.

    Raises:
        MsllmError: the layout needs a mode the config does not set
            (:func:`msllm.parallel.layout_checks.validate_run_layout`).
    """
    validate_run_layout(run_config)
    pc = run_config.parallel_config
    mode = run_config.parallel.mode_name
    kwargs = {"parallel_mode": mode, "device_num": pc.device_num,
              "gradients_mean": run_config.parallel.gradients_mean}
    if mode == "data_parallel":
        return kwargs
    opt = optimizer_shard_enabled(run_config)
    kwargs.update({
        "full_batch": run_config.parallel.full_batch,
        "enable_parallel_optimizer": opt,
        "pipeline_stages": pc.pipeline_stage,
        "strategy_ckpt_config": {
            "save_file": os.path.join(os.path.abspath(run_config.output_dir), "strategy",
                                      strategy_file_name(rank, strategy_format(run_config))),
            "only_trainable_params": False},
    })
    if pc.expert_parallel > 1:
        # Tokens move between the router's data-parallel layout and the experts' (ep, dp/ep) layout;
        # without this switch MindSpore 2.10 builds that move from AllGather + slicing (every rank
        # gathers the whole expert group's tokens) instead of one AlltoAll each way
        # (mindspore/parallel/_auto_parallel_context.py set_enable_alltoall; GShard's dispatch/combine).
        kwargs["enable_alltoall"] = True
    if opt:
        kwargs["parallel_optimizer_config"] = {"parallel_optimizer_threshold": DEFAULT_OPT_THRESHOLD_KB,
                                               "optimizer_weight_shard_size": -1}
    if pc.pipeline_stage > 1:
        # MindFormers' pp_interleave_num > 1: interleaved chunks (pipeline_segment) per stage
        interleave = getattr(run_config.model_config, "pp_interleave_num", 1) > 1
        kwargs["pipeline_config"] = {"pipeline_interleave": interleave, "pipeline_scheduler": "1f1b"}
    return kwargs


__all__ = ["parallel_context_kwargs"]
