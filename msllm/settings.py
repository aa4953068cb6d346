"""What each accepted setting does on this run: refuse what cannot work, name what has no effect.

msllm's rule (README "Configuration"): every configuration key does what it says, or is refused at
start with a reason and what to set instead, or, when its only effect is on hardware or in a mode
this run does not use, is named in one start-up log line. :func:`check_settings` is that check; the
trainer, predict and eval call it once, after the config is loaded and before anything is built.

The keys handled here are the ones whose effect depends on the device or the parallel mode. The
test ``tests/test_config_schema.py`` walks every field of the schema and fails when a field is
read by no code and is not named here, so silent keys cannot come back.
"""

from __future__ import annotations

import logging

from msllm.config import RunConfig
from msllm.errors import MsllmError

log = logging.getLogger("msllm")

# Keys that change nothing in msllm on any device, with the reason: they are accepted (MindFormers
# YAMLs set them) and named in the start-up line when set away from their default.
NO_EFFECT = {
    "parallel_config.gradient_aggregation_group":
        "MindFormers' gradient fusion group size for Ascend communication; msllm all-reduces "
        "gradients in one fused call per step and has no fusion groups",
    "parallel.search_mode": "applies to parallel_mode 2 (auto_parallel), which msllm does not run",
}


def check_settings(cfg: RunConfig, mode: str) -> list[str]:
    """Refuse settings that cannot work for ``mode`` (``train``/``finetune``/``predict``/``eval``)
    on ``cfg.context.device_target``; return notes for settings with no effect on this run.

    Raises:
        MsllmError: one message naming the key, why, and what to set instead.
    Returns:
        ``["key: reason", ...]`` (also the keys :func:`msllm.config.load_config` accepted from a
        MindFormers YAML without effect, ``cfg.ignored_keys``), for one log line.
    """
    notes = list(getattr(cfg, "ignored_keys", []))
    training = mode in ("train", "finetune")
    dp = cfg.parallel.mode_name == "data_parallel"
    cpu = cfg.context.device_target == "CPU"
    pc, rc, par = cfg.parallel_config, cfg.recompute_config, cfg.parallel

    if (pc.optimizer_shard or par.enable_parallel_optimizer) and dp and training:
        raise MsllmError(
            "parallel_config.optimizer_shard / parallel.enable_parallel_optimizer: sharding the "
            "optimizer states needs parallel_mode 1 (semi_auto_parallel), where MindSpore splits "
            "them over the data-parallel group; in data_parallel mode msllm reduces gradients "
            "itself and every rank keeps whole states (and CPU has no ReduceScatter). Set both to "
            "False, or use semi_auto_parallel on Ascend")
    if cfg.optimizer.type == "FP32StateAdamWeightDecay" and cfg.model_config.param_init_type != "float32":
        raise MsllmError(
            f"optimizer.type FP32StateAdamWeightDecay with param_init_type="
            f"{cfg.model_config.param_init_type!r}: msllm's AdamW keeps its moments in the parameters' "
            "dtype, so float32 states need float32 parameters; set param_init_type: float32 "
            "(msllm's AdamW then is FP32StateAdamWeightDecay)")
    for key, reason in NO_EFFECT.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        default = getattr(type(getattr(cfg, section))(), name)
        if value != default:
            notes.append(f"{key}={value!r} ({reason})")
    if dp:
        for name in ("mp_comm_recompute", "parallel_optimizer_comm_recompute", "recompute_slice_activation"):
            default = getattr(type(rc)(), name)
            if getattr(rc, name) != default and training:
                notes.append(f"recompute_config.{name} (recomputes model-parallel / optimizer-shard "
                             "communication; data_parallel mode has none)")
        if par.strategy_ckpt_save_file != type(par)().strategy_ckpt_save_file and not cfg.only_save_strategy:
            notes.append("parallel.strategy_ckpt_save_file (data_parallel runs have no parallel "
                         "strategy to save)")
    runner = cfg.runner_config
    if runner.sink_mode and training:
        notes.append(f"runner_config.sink_mode=True, sink_size={runner.sink_size} (msllm has no data "
                     f"sinking on {cfg.context.device_target}: steps are fed one by one)")
    elif runner.sink_size != type(runner)().sink_size and training:
        notes.append(f"runner_config.sink_size={runner.sink_size} (used only with sink_mode: True)")
    if not training:
        for key in ("recompute", "select_recompute"):
            if getattr(rc, key):
                notes.append(f"recompute_config.{key} (recomputation saves training memory; {mode} "
                             "keeps no activations for a backward pass)")
    if cpu and cfg.context.max_device_memory:
        notes.append("context.max_device_memory (Ascend/GPU device memory; CPU has none)")
    return notes


def log_settings(cfg: RunConfig, mode: str) -> None:
    """:func:`check_settings`, then one log line naming every setting without effect."""
    notes = check_settings(cfg, mode)
    if notes:
        log.info("settings with no effect on this run: %s", "; ".join(notes))
