"""The run configuration: typed dataclasses that are both the YAML schema and the CLI.

Config flows one way: YAML file -> ``--key.sub=value`` overrides -> :class:`RunConfig`
(validated) -> builders. The sections and key names follow MindFormers' ``run_*.yaml`` files
(``context``, ``parallel``, ``parallel_config``, ``runner_config`` ...), so an existing MindFormers
user finds the same keys; keys msllm does not implement are rejected rather than ignored.

Errors: every unknown key, wrong type or bad value raises :class:`msllm.errors.MsllmError` naming
the key's full path (``runner_config.batch_size``), what was expected and, for a misspelt key,
the closest valid name (the generic conversion: :mod:`msllm.config_io`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

import yaml

from msllm.config_io import apply_overrides, from_dict, read_yaml, to_dict  # noqa: F401 (from_dict, to_dict re-exported)
from msllm.errors import MsllmError
from msllm.fileio import atomic_open
from msllm.config_generation import GenerationConfig
from msllm.config_lora import PetConfig
from msllm.models.llama.config import LlamaConfig

PARALLEL_MODES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel"}
# what run_msllm.py (and run_distribute.sh's MODE) can do; the one list every front checks
RUN_MODES = ("train", "finetune", "predict", "eval")
# the run modes that train (build a train step, write checkpoints)
TRAINING_MODES = ("train", "finetune")


@dataclass
class ContextConfig:
    """``context``: where and how MindSpore runs.

    mode: 0 = GRAPH_MODE, 1 = PYNATIVE_MODE (MindSpore ``set_context(mode=...)``).
    device_target: ``CPU`` or ``Ascend`` (``GPU`` is accepted by MindSpore but untested here).
    jit_level: ``O0``/``O1``/``O2`` (MindSpore ``jit_config``); on CPU ``O2`` ("GE") is mapped to
        ``O0`` with a log line, because MindSpore 2.10 silently ignores it there (NOTES.md).
    max_device_memory: e.g. ``"58GB"``; applied on Ascend/GPU only.
    peak_tflops: peak dense TFLOPs of one device used for MFU; ``None`` = the device's default
        (see :mod:`msllm.training.throughput`).
    max_call_depth: MindSpore's limit on nested graph calls while compiling (``set_context``;
        MindSpore's default 1000). 10000 as MindFormers' LLaMA YAMLs: the 80-layer 70B training
        graph exceeds 1000 (``Exceed function call depth limit 1000``, compiled by the dry-run).
    """

    mode: int = 0
    device_target: str = "CPU"
    jit_level: str = "O0"
    max_device_memory: Optional[str] = None
    device_id: int = 0
    peak_tflops: Optional[float] = None
    max_call_depth: int = 10000

    def validate(self, where: str) -> None:
        if self.mode not in (0, 1):
            raise MsllmError(f"{where}.mode={self.mode}: expected 0 (GRAPH_MODE) or 1 (PYNATIVE_MODE)")
        if self.device_target not in ("CPU", "Ascend", "GPU"):
            raise MsllmError(f"{where}.device_target={self.device_target!r}: expected CPU, Ascend or GPU")
        if self.jit_level not in ("O0", "O1", "O2"):
            raise MsllmError(f"{where}.jit_level={self.jit_level!r}: expected O0, O1 or O2")
        if not isinstance(self.max_call_depth, int) or self.max_call_depth < 1:
            raise MsllmError(f"{where}.max_call_depth={self.max_call_depth!r}: expected a positive integer")


@dataclass
class ParallelConfig:
    """``parallel``: MindSpore auto-parallel context (``set_auto_parallel_context``).

    parallel_mode: 0 data_parallel, 1 semi_auto_parallel, 2 auto_parallel, 3 hybrid_parallel
        (MindFormers' numbering), or the name.
    gradients_mean: average (not sum) gradients across data-parallel ranks.
    full_batch: every rank reads the full global batch (semi-auto parallel); ``False`` = each
        data-parallel rank reads its own shard.
    strategy_ckpt_save_file: the parallel strategy files' format by extension (``.json``: JSON,
        else MindSpore's protobuf ``.ckpt``); they are written to
        ``{output_dir}/strategy/ckpt_strategy_rank_{i}.{ext}`` (semi-auto parallel and
        ``only_save_strategy``; a data_parallel run has no strategy).
    """

    parallel_mode: Union[int, str] = 0
    gradients_mean: bool = True
    full_batch: bool = False
    enable_parallel_optimizer: bool = False
    strategy_ckpt_save_file: str = "./ckpt_strategy.ckpt"
    search_mode: Optional[str] = None

    @property
    def mode_name(self) -> str:
        if isinstance(self.parallel_mode, int):
            return PARALLEL_MODES[self.parallel_mode]
        return self.parallel_mode

    def validate(self, where: str) -> None:
        names = set(PARALLEL_MODES.values())
        if (isinstance(self.parallel_mode, int) and self.parallel_mode not in PARALLEL_MODES) or (
                isinstance(self.parallel_mode, str) and self.parallel_mode not in names):
            raise MsllmError(f"{where}.parallel_mode={self.parallel_mode!r}: expected one of "
                             f"{sorted(PARALLEL_MODES)} or {sorted(names)}")


@dataclass
class ParallelLayoutConfig:
    """``parallel_config``: the parallel layout (Megatron-LM terms, MindFormers key names).

    The device count of a run is ``data_parallel * model_parallel * pipeline_stage``.
    ``expert_parallel``: mixture-of-experts layers split their experts over this many of the
    data-parallel ranks (it divides ``data_parallel`` and adds no devices, MindFormers'
    convention); the tokens travel to their experts' ranks by all-to-all (Ascend only).
    """

    data_parallel: int = 1
    model_parallel: int = 1
    pipeline_stage: int = 1
    optimizer_shard: bool = False
    micro_batch_num: int = 1
    vocab_emb_dp: bool = True
    gradient_aggregation_group: int = 4
    use_seq_parallel: bool = False
    expert_parallel: int = 1

    @property
    def device_num(self) -> int:
        return self.data_parallel * self.model_parallel * self.pipeline_stage

    def validate(self, where: str) -> None:
        for key in ("data_parallel", "model_parallel", "pipeline_stage", "micro_batch_num",
                    "gradient_aggregation_group", "expert_parallel"):
            if getattr(self, key) < 1:
                raise MsllmError(f"{where}.{key} must be >= 1, got {getattr(self, key)}")
        if self.data_parallel % self.expert_parallel:
            raise MsllmError(f"{where}.expert_parallel={self.expert_parallel} must divide data_parallel="
                             f"{self.data_parallel}: experts are split over data-parallel ranks (MindFormers' rule)")


@dataclass
class RecomputeConfig:
    """``recompute_config``: activation recomputation (trade compute for memory)."""

    recompute: bool = False
    select_recompute: bool = False
    parallel_optimizer_comm_recompute: bool = False
    mp_comm_recompute: bool = True
    recompute_slice_activation: bool = False


@dataclass
class ModelSection:
    """``model``: holds ``model_config`` (a :class:`LlamaConfig`)."""

    model_config: LlamaConfig = field(default_factory=LlamaConfig)


@dataclass
class RunnerConfig:
    """``runner_config``: the training loop.

    batch_size: samples per step per data-parallel rank (per micro step when accumulating).
    train_steps: stop after this many steps (``None``: ``epochs`` full passes over the data).
    sink_mode / sink_size: MindSpore data sinking; ``sink_size`` steps run per host call.
    gradient_accumulation_steps: micro steps whose gradients are summed before one update.
    """

    epochs: int = 1
    batch_size: int = 1
    train_steps: Optional[int] = None
    sink_mode: bool = False
    sink_size: int = 1
    gradient_accumulation_steps: int = 1

    def validate(self, where: str) -> None:
        for key in ("epochs", "batch_size", "sink_size", "gradient_accumulation_steps"):
            if getattr(self, key) < 1:
                raise MsllmError(f"{where}.{key} must be >= 1, got {getattr(self, key)}")
        if self.train_steps is not None and self.train_steps < 1:
            raise MsllmError(f"{where}.train_steps must be >= 1 or null, got {self.train_steps}")


@dataclass
class OptimizerConfig:
    """``optimizer``: AdamW (Loshchilov & Hutter 2019), MindSpore ``nn.AdamWeightDecay``'s rule
    (:class:`msllm.training.adamw.AdamW`). ``type``: ``AdamW`` / ``AdamWeightDecay`` keep the moments
    in the parameters' dtype (MindSpore's ``nn.AdamWeightDecay``); ``FP32StateAdamWeightDecay`` keeps
    them in float32 whatever the parameters' dtype (MindFormers' class of that name, for fp16/bf16
    parameters on Ascend; on CPU parameters are float32 for training, where the two are the same).

    Weight decay applies to matrices only (not to RMSNorm weights), as in MindFormers/Megatron.
    """

    type: str = "AdamW"
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1

    def validate(self, where: str) -> None:
        if self.type not in ("AdamW", "AdamWeightDecay", "FP32StateAdamWeightDecay"):
            raise MsllmError(f"{where}.type={self.type!r}: only AdamW is implemented")
        if len(self.betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in self.betas):
            raise MsllmError(f"{where}.betas={self.betas!r}: expected two numbers in [0, 1)")


@dataclass
class LrScheduleConfig:
    """``lr_schedule``: linear warmup then cosine decay to ``lr_end``.

    ``warmup_ratio`` of the total steps warm up linearly from 0 (or ``warmup_steps`` if given);
    formula in :func:`msllm.training.schedule.cosine_with_warmup`.
    """

    type: str = "CosineWithWarmUpLR"
    learning_rate: float = 1e-4
    lr_end: float = 0.0
    warmup_ratio: float = 0.0
    warmup_steps: Optional[int] = None
    total_steps: int = -1

    def validate(self, where: str) -> None:
        if self.type not in ("CosineWithWarmUpLR", "cosine", "constant"):
            raise MsllmError(f"{where}.type={self.type!r}: expected CosineWithWarmUpLR or constant")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise MsllmError(f"{where}.warmup_ratio={self.warmup_ratio}: expected a number in [0, 1]")
        if self.learning_rate < 0 or self.lr_end < 0:
            raise MsllmError(f"{where}: learning_rate and lr_end must be >= 0")
        if self.total_steps == 0 or self.total_steps < -1:
            raise MsllmError(f"{where}.total_steps={self.total_steps}: expected -1 (the run's length) or >= 1")


@dataclass
class RunnerWrapperConfig:
    """``runner_wrapper``: loss scaling and gradient clipping around the train step.

    loss_scale: ``dynamic`` (MindSpore ``DynamicLossScaleUpdateCell`` semantics: divide by
        ``scale_factor`` on overflow and skip the update, multiply after ``scale_window`` clean
        steps), ``fixed`` (``scale_sense`` constant) or ``none``.
    max_grad_norm: global L2 norm the gradients are clipped to when ``use_clip_grad``.
    """

    loss_scale: str = "dynamic"
    scale_sense: float = 65536.0
    scale_factor: float = 2.0
    scale_window: int = 1000
    use_clip_grad: bool = True
    max_grad_norm: float = 1.0

    def validate(self, where: str) -> None:
        if self.loss_scale not in ("dynamic", "fixed", "none"):
            raise MsllmError(f"{where}.loss_scale={self.loss_scale!r}: expected dynamic, fixed or none")
        if self.scale_sense <= 0 or self.scale_factor <= 1 or self.scale_window < 1:
            raise MsllmError(f"{where}: need scale_sense > 0, scale_factor > 1, scale_window >= 1")


@dataclass
class LossMonitorConfig:
    """``callbacks.loss_monitor``: one log line every ``per_print_times`` steps."""

    per_print_times: int = 1


@dataclass
class CheckpointConfig:
    """``callbacks.checkpoint``: periodic checkpoints under ``output_dir/checkpoint/rank_{i}``."""

    prefix: str = "checkpoint"
    save_checkpoint_steps: int = 100
    keep_checkpoint_max: int = 5
    format: str = "ckpt"
    save_at_end: bool = True

    def validate(self, where: str) -> None:
        if self.save_checkpoint_steps < 1 or self.keep_checkpoint_max < 1:
            raise MsllmError(f"{where}: save_checkpoint_steps and keep_checkpoint_max must be >= 1")
        if self.format not in ("ckpt", "safetensors"):
            raise MsllmError(f"{where}.format={self.format!r}: expected ckpt or safetensors")


@dataclass
class CallbacksConfig:
    """``callbacks``."""

    loss_monitor: LossMonitorConfig = field(default_factory=LossMonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class DatasetConfig:
    """``train_dataset``: MindRecord data written by ``data_preprocess/llama_preprocess.py``.

    dataset_dir: a ``.mindrecord`` file, one file of a ``--file_partition`` group, or a directory.
    batch_size: ``None`` = ``runner_config.batch_size`` (they must agree if both are given).
    input_columns: ``["input_ids", "labels"]`` (train on the labels ``llama_preprocess`` wrote) or
        ``["input_ids"]`` (every non-padding token, as MindFormers' pretraining configs do).
    Each data-parallel rank reads a disjoint shard (``MindDataset(num_shards, shard_id)``).
    """

    dataset_dir: str = ""
    shuffle: bool = True
    drop_remainder: bool = True
    batch_size: Optional[int] = None
    num_parallel_workers: int = 1
    prefetch_size: int = 4
    input_columns: list = field(default_factory=lambda: ["input_ids", "labels"])


@dataclass
class EvalDatasetConfig(DatasetConfig):
    """``eval_dataset``: the same keys as :class:`DatasetConfig`, with evaluation's defaults (every
    record once, in file order), also when the YAML gives the section only in part. Read by
    ``do_eval`` and ``run_mode: eval`` (``dataset_dir``, ``batch_size``, ``input_columns``);
    ``shuffle``, ``drop_remainder``, ``num_parallel_workers`` and ``prefetch_size`` cannot change
    a mean evaluation loss and are named in the start-up line when set (:mod:`msllm.settings`)."""

    shuffle: bool = False
    drop_remainder: bool = False


@dataclass
class TensorBoardConfig:
    """``tensorboard`` (MindFormers 1.5+): TensorBoard event files written with tensorboardX.

    tensorboard_dir: where events go (``""``: no TensorBoard); each rank writes
        ``{tensorboard_dir}/rank_{r}``.
    tensorboard_queue_size: events buffered before a write (tensorboardX ``max_queue``).
    """

    tensorboard_dir: str = ""
    tensorboard_queue_size: int = 10

    def validate(self, where: str) -> None:
        if self.tensorboard_queue_size < 1:
            raise MsllmError(f"{where}.tensorboard_queue_size must be >= 1, got {self.tensorboard_queue_size}")


DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


@dataclass
class DPOConfig:
    """``dpo``: preference tuning (Rafailov et al. 2023) instead of the next-token loss; the data are
    pairs (``llama_preprocess.py --dataset_type dpo``). Names and defaults: TRL 1.16.0
    ``trl/trainer/dpo_config.py`` (``beta`` 0.1, ``loss_type`` "sigmoid", ``label_smoothing`` 0.0,
    ``precompute_ref_log_probs``), ``ftx`` = LLaMA-Factory's / MindSpeed-LLM's ``pref_ftx`` (0.0).

    beta: the KL weight beta (IPO: its tau).
    loss_type: ``sigmoid`` | ``ipo`` | ``hinge`` (formulas: :mod:`msllm.training.dpo`).
    label_smoothing: sigmoid only: the conservative-DPO flip probability eps in [0, 0.5).
    ftx: weight of the SFT term (mean per-token NLL of the chosen completion) added to the loss.
    precompute_ref: TRL's ``precompute_ref_log_probs``: the reference log-probs of every training
        (and held-out) pair are computed once before the first step with the starting weights (also
        on resume), and training runs without a reference model (a full fine-tune holds no frozen
        copy; :mod:`msllm.training.dpo_values`).
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    ftx: float = 0.0
    precompute_ref: bool = False

    def validate(self, where: str) -> None:
        if self.loss_type not in DPO_LOSS_TYPES:
            raise MsllmError(f"{where}.loss_type={self.loss_type!r}: expected one of {', '.join(DPO_LOSS_TYPES)}")
        if not self.beta > 0:
            raise MsllmError(f"{where}.beta={self.beta}: expected a number > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise MsllmError(f"{where}.label_smoothing={self.label_smoothing}: expected a number in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise MsllmError(f"{where}.label_smoothing={self.label_smoothing}: applies to loss_type sigmoid only "
                             f"(got {self.loss_type})")
        if self.ftx < 0:
            raise MsllmError(f"{where}.ftx={self.ftx}: expected a number >= 0")


@dataclass
class RunConfig:
    """A whole run: the top level of ``configs/llama/run_llama_*.yaml``.

    auto_trans_ckpt / src_strategy_path_or_dir: reshard ``load_checkpoint`` (full, or sharded
        with the given strategy file or directory) to this run's layout at start
        (:func:`msllm.parallel.reshard.reshard_for_start`).
    deterministic: MindSpore ``set_context(deterministic="ON")``: bit-identical losses across
        runs on the same device and layout (used by the resume tests).
    profile / profile_start_step / profile_stop_step: write a MindSpore profile
        (``mindspore.Profiler``) of steps start..stop (1-based, inclusive) to
        ``output_dir/profile/rank_{r}``.
    do_eval / eval_step_interval / eval_epoch_interval: evaluation loss and perplexity on
        ``eval_dataset`` during training, every so many steps / epochs (MindFormers' keys;
        an interval <= 0 turns that trigger off).
    generation_config: decoding settings for predict, chat and generative evaluation
        (:class:`msllm.config_generation.GenerationConfig`; MindFormers' decoding keys in
        ``model.model_config`` are moved here when the YAML is read).
    pet_config: LoRA fine-tuning (:class:`msllm.config_lora.PetConfig`, MindFormers' keys); None =
        full fine-tuning. MindFormers' place, ``model.model_config.pet_config`` (0.x:
        ``model.arch.pet``), in the YAML or in an override, is moved here when the YAML is read
        (:func:`msllm.compat.mindformers.hoist_pet_config`); validated at load.
    """

    seed: int = 0
    output_dir: str = "./output"
    run_mode: str = "train"
    load_checkpoint: str = ""
    resume_training: bool = False
    auto_trans_ckpt: bool = False
    src_strategy_path_or_dir: str = ""
    only_save_strategy: bool = False
    deterministic: bool = False
    profile: bool = False
    profile_start_step: int = 1
    profile_stop_step: int = 10
    do_eval: bool = False
    eval_step_interval: int = -1
    eval_epoch_interval: int = 1
    context: ContextConfig = field(default_factory=ContextConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    parallel_config: ParallelLayoutConfig = field(default_factory=ParallelLayoutConfig)
    recompute_config: RecomputeConfig = field(default_factory=RecomputeConfig)
    model: ModelSection = field(default_factory=ModelSection)
    runner_config: RunnerConfig = field(default_factory=RunnerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    runner_wrapper: RunnerWrapperConfig = field(default_factory=RunnerWrapperConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    eval_dataset: EvalDatasetConfig = field(default_factory=EvalDatasetConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)
    # parameter-efficient fine-tuning (LoRA; MindFormers' model.model_config.pet_config, moved here
    # when the YAML is read); None = full fine-tuning
    pet_config: Optional[PetConfig] = None
    # preference tuning (DPO) instead of the next-token loss; None = ordinary training
    dpo: Optional[DPOConfig] = None

    @property
    def model_config(self) -> LlamaConfig:
        return self.model.model_config

    @property
    def fast_paths(self) -> bool:
        """Build the model with its CPU fast paths (2-D norm/softmax views, loss over target
        positions only): on CPU without operator sharding. Elsewhere the model keeps the shapes
        the parallel layouts are written for (:mod:`msllm.models.llama.model`)."""
        return self.context.device_target == "CPU" and self.parallel.mode_name == "data_parallel"

    def validate(self) -> None:
        """Check each section, then the rules that join sections."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if section is not None and hasattr(section, "validate") and f.name != "model":
                section.validate(f.name)
        self.model_config.validate("model.model_config")
        from msllm.config_lora import validate_pet_config  # pure Python, no MindSpore

        validate_pet_config(self.pet_config)  # None (full fine-tuning) passes
        if self.run_mode not in RUN_MODES:
            raise MsllmError(f"run_mode={self.run_mode!r}: expected one of {RUN_MODES}")
        if self.profile and not 1 <= self.profile_start_step <= self.profile_stop_step:
            raise MsllmError(f"profile_start_step={self.profile_start_step} / profile_stop_step="
                             f"{self.profile_stop_step}: expected 1 <= start <= stop")
        from msllm.data.dataset import check_input_columns

        for name in ("train_dataset", "eval_dataset"):
            check_input_columns(getattr(self, name).input_columns, f"{name}.input_columns")
        ds_bs = self.train_dataset.batch_size
        if ds_bs is not None and ds_bs != self.runner_config.batch_size:
            raise MsllmError(f"train_dataset.batch_size={ds_bs} disagrees with "
                             f"runner_config.batch_size={self.runner_config.batch_size}; set one")


def load_config(path: str, overrides: Optional[list[str]] = None) -> RunConfig:
    """YAML file (msllm's or MindFormers' run YAML) + ``--key.sub=value`` overrides (msllm names)
    -> validated :class:`RunConfig`.

    A MindFormers YAML is first translated to this schema
    (:func:`msllm.compat.mindformers.translate_mindformers_yaml`); the MindFormers keys it accepts
    without effect are kept as ``cfg.ignored_keys`` (``"key (reason)"`` strings) for the one
    start-up log line of :func:`msllm.settings.log_settings`. The settings MindFormers keeps in
    ``model.model_config`` that are not the model's (decoding keys, LoRA's ``pet_config``) move to
    ``generation_config`` and ``pet_config`` there and again after the overrides, so
    ``--model.model_config.pet_config.lora_rank=8`` and ``--pet_config.lora_rank=8`` are one setting
    (:func:`msllm.compat.mindformers.hoist_pet_config`, :func:`~msllm.compat.mindformers.hoist_pet_overrides`).

    Raises:
        MsllmError: missing file, invalid YAML, unknown key, wrong type or inconsistent values,
            with the file name prefixed.
    """
    from msllm.compat.mindformers import (hoist_generation_keys, hoist_generation_overrides, hoist_pet_config,
                                          hoist_pet_overrides, translate_mindformers_yaml)

    data, notes = translate_mindformers_yaml(read_yaml(path), path, RunConfig)
    # --model.model_config.pet_config.KEY=V (MindFormers' place) overrides pet_config.KEY
    overrides = hoist_pet_overrides(overrides or [])
    # --model.model_config.top_k=5 (MindFormers' place) beats the YAML's generation_config.top_k, as
    # --generation_config.top_k=5 does
    overrides = hoist_generation_overrides(overrides)
    # an override such as --model.model_config.top_k=5 (MindFormers' place) moves like the YAML's
    data = hoist_pet_config(hoist_generation_keys(apply_overrides(data, overrides)), path)
    given = given_keys(data)
    fill_paired_keys(data, given)
    try:
        cfg = from_dict(RunConfig, data)
        cfg.validate()
    except MsllmError as exc:
        raise MsllmError(f"{path}: {exc}") from None
    cfg.ignored_keys = [f"{key} ({why})" for key, why in notes]
    cfg.given_keys = frozenset(given)
    return cfg


# Keys that name one setting twice (MindFormers' YAMLs carry both spellings). A YAML that gives
# only the first of a pair sets the second from it: an absent key is not a disagreement, and the
# dataclass default of the absent one is no user's value (issue #30: MindFormers' own
# run_llama_13b.yaml has enable_parallel_optimizer: True and no optimizer_shard key). Both given
# and different stays an error (RunConfig.validate / layout_checks.optimizer_shard_enabled).
PAIRED_KEYS = (
    ("parallel_config.optimizer_shard", "parallel.enable_parallel_optimizer"),
    ("parallel.enable_parallel_optimizer", "parallel_config.optimizer_shard"),
    # train_dataset.batch_size None already means "runner_config's", so only this direction
    ("train_dataset.batch_size", "runner_config.batch_size"),
)


def given_keys(data: dict, prefix: str = "") -> set:
    """Every dotted key path present in a run-YAML mapping (sections and their keys): what the
    user wrote, as opposed to what the dataclass defaults fill in."""
    out = set()
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        out.add(full)
        if isinstance(value, dict):
            out |= given_keys(value, full)
    return out


def fill_paired_keys(data: dict, given: set) -> None:
    """For each ``(src, dst)`` of :data:`PAIRED_KEYS` with ``src`` given and ``dst`` not, set
    ``dst`` to ``src``'s value in ``data`` (modified in place; ``given`` is not)."""
    for src, dst in PAIRED_KEYS:
        if src not in given or dst in given:
            continue
        node = data
        for part in src.split("."):
            node = node[part]
        value = node
        if value is None:
            continue
        section, _, name = dst.rpartition(".")
        target = data
        for part in section.split("."):
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[name] = value


def was_given(cfg: RunConfig, key: str) -> bool:
    """Whether the user's YAML or an override set ``key`` (dotted). A config built in code (no
    ``given_keys``) counts a value different from the schema's default as given."""
    keys = getattr(cfg, "given_keys", None)
    if keys is not None:
        return key in keys
    node, ref = cfg, RunConfig()
    for part in key.split("."):
        node, ref = getattr(node, part), getattr(ref, part)
    return node != ref


def save_config(cfg: RunConfig, path: str) -> None:
    """Write the resolved config as YAML, atomically; it loads back to an equal config."""
    with atomic_open(path) as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
