"""What each accepted setting does on this run: refuse what cannot work, name what has no effect.

msllm's rule (README "Configuration"): every configuration key does what it says, or is refused at
start with a reason and what to set instead, or, when its only effect is on hardware or in a mode
this run does not use, is named in one start-up log line. :func:`check_settings` is that check; the
trainer, predict, chat and eval call it once, after the config is loaded and before anything is
built, and ``run_distribute.sh`` calls it before it starts any rank (so no rank starts for a
setting the entry point would refuse).

The keys handled here are the ones whose effect depends on the device or the parallel mode. The
test ``tests/test_config_schema.py`` walks every field of the schema and fails when a field is
read by no code and is not named here, so silent keys cannot come back.
"""

from __future__ import annotations

import logging
import os

from msllm.config import TRAINING_MODES, RunConfig
from msllm.data.dataset import usable_workers
from msllm.errors import MsllmError

log = logging.getLogger("msllm")

# Keys that change nothing in msllm on any device, with the reason: they are accepted (MindFormers
# YAMLs set them) and named in the start-up line when set away from their default.
NO_EFFECT = {
    "parallel_config.gradient_aggregation_group":
        "MindFormers' gradient fusion group size for Ascend communication; msllm all-reduces "
        "gradients in one fused call per step and has no fusion groups",
    "parallel.search_mode": "applies to parallel_mode 2 (auto_parallel), which msllm does not run",
    # evaluation (do_eval, run_mode eval) reads every record once, in file order, and reports a
    # token-weighted mean: order, batching and the reader's threads cannot change it
    "eval_dataset.shuffle": "evaluation reads every record once, in file order; the mean loss does not depend on it",
    "eval_dataset.drop_remainder": "evaluation scores every record, the last partial batch included",
    "eval_dataset.num_parallel_workers": "evaluation reads the records with numpy, not a MindDataset pipeline",
    "eval_dataset.prefetch_size": "evaluation reads the records with numpy, not a MindDataset pipeline",
}


def _default(key: str):
    """The schema's default of ``section.name`` (``RunConfig()``'s, so that a section whose
    defaults differ from its class's, like ``eval_dataset``, compares against its own)."""
    section, name = key.split(".")
    return getattr(getattr(RunConfig(), section), name)


def _layout_refusal(cfg: RunConfig, mode: str) -> None:
    """predict (and chat) decode data parallel only: refuse model_parallel / pipeline_stage > 1."""
    pc = cfg.parallel_config
    if mode != "predict" or (pc.model_parallel == 1 and pc.pipeline_stage == 1):
        return
    if cfg.context.device_target == "CPU":
        raise MsllmError(
            f"parallel_config asks for model_parallel={pc.model_parallel}, pipeline_stage={pc.pipeline_stage}, "
            "but context.device_target is CPU: MindSpore 2.10 cannot compile operator sharding or pipeline "
            "stages on CPU ('Invalid backend: CPU'). Predict on CPU is data parallel only (each rank decodes "
            "its share of the prompts): set parallel_config.model_parallel=1 and pipeline_stage=1")
    raise MsllmError(
        f"parallel_config asks for model_parallel={pc.model_parallel}, pipeline_stage={pc.pipeline_stage}: "
        "msllm's predict does not shard the model yet (data parallel only); set model_parallel=1 and "
        "pipeline_stage=1")


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
    training = mode in TRAINING_MODES
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
    _layout_refusal(cfg, mode)
    for key, reason in NO_EFFECT.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != _default(key):
            notes.append(f"{key}={value!r} ({reason})")
    cores = usable_workers()
    if training and cfg.train_dataset.num_parallel_workers > cores:
        notes.append(f"train_dataset.num_parallel_workers={cfg.train_dataset.num_parallel_workers} (this machine has "
                     f"{cores} CPU cores and MindDataset accepts 1..{cores}: {cores} are used)")
    if mode == "eval" and (pc.model_parallel > 1 or pc.pipeline_stage > 1):
        notes.append(f"parallel_config.model_parallel={pc.model_parallel} / pipeline_stage={pc.pipeline_stage} "
                     "(evaluation runs data parallel only: requests are split over the launched processes)")
    if dp:
        for name in ("mp_comm_recompute", "parallel_optimizer_comm_recompute", "recompute_slice_activation"):
            default = getattr(type(rc)(), name)
            if getattr(rc, name) != default and training:
                notes.append(f"recompute_config.{name} (recomputes model-parallel / optimizer-shard "
                             "communication; data_parallel mode has none)")
    # strategy files: none in a data_parallel run; otherwise only the key's extension is used
    path, default_path = par.strategy_ckpt_save_file, _default("parallel.strategy_ckpt_save_file")
    if dp and not cfg.only_save_strategy:
        if path != default_path:
            notes.append("parallel.strategy_ckpt_save_file (data_parallel runs have no parallel "
                         "strategy to save)")
    elif os.path.splitext(path)[0] != os.path.splitext(default_path)[0]:
        notes.append(f"parallel.strategy_ckpt_save_file={path!r}: only its extension is used (.json: JSON, "
                     "else protobuf); the strategy files go to output_dir/strategy/ckpt_strategy_rank_{i}, "
                     "as MindFormers writes them")
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


def log_notes(notes: list[str]) -> None:
    """One log line naming every setting without effect (``notes`` of :func:`check_settings`)."""
    if notes:
        log.info("settings with no effect on this run: %s", "; ".join(notes))


def log_settings(cfg: RunConfig, mode: str) -> None:
    """:func:`check_settings`, then :func:`log_notes`."""
    log_notes(check_settings(cfg, mode))
