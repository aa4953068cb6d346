"""MindFormers run YAMLs -> msllm's config schema.

:func:`translate_mindformers_yaml` takes the mapping read from a run YAML (``load_config`` then
applies the ``--key=value`` overrides, in msllm's names) and returns it in msllm's schema (:mod:`msllm.config`) plus the keys it accepted with
no effect, each with the reason (logged in one start-up line). What maps where, and why each
no-effect key changes nothing, is in ``docs/mindformers_compat.md``; the sources are MindFormers'
LLaMA configs (``configs/llama/run_llama_*.yaml`` at r0.6-r1.0, ``configs/llama2/*.yaml``) and the
classes they name, at mindformers r1.0 (commit 6a4076003f0c2461637b477199844cb92774e4d1):
``trainer/base_trainer.py``, ``dataset/utils.py``, ``core/callback/callback.py``,
``core/optim/optim.py``, ``core/lr/lr_schedule.py``, ``wrapper/wrapper.py``,
``models/llama/llama_config.py`` and ``llama_layer.py`` (``FreqsMgr``), ``run_mindformer.py``.

Rules:

* A key msllm's schema has is msllm's and is left alone, so an msllm YAML comes back unchanged
  (the translation is idempotent). The exceptions are MindFormers' *shapes* of sections msllm
  also has -- a ``callbacks`` list, a ``data_loader`` inside a dataset, a ``scale_sense`` mapping,
  ``beta1``/``beta2`` in ``optimizer``, ``type`` in ``model.model_config`` -- which only
  MindFormers writes; inside such a section MindFormers' defaults fill what the YAML leaves out
  (e.g. ``weight_decay`` 0.0, ``eps`` 1e-6, ``use_clip_grad`` False, checkpoint ``prefix`` "CKP").
* Where a MindFormers key and its msllm name are both given (``data_loader.dataset_dir`` and
  ``dataset_dir`` in one dataset section), the msllm one wins and the other is listed as
  overridden.
* A key with no effect is removed and listed; a value msllm cannot honour (``repeat: 2``,
  ``extend_method: YaRN``, ``lr_scale: True``, a trainer/model/dataset type msllm does not have)
  raises :class:`~msllm.errors.MsllmError` naming the file, the key and what to do.
* Settings MindFormers keeps in ``model.model_config`` that are not the model's move to msllm's own
  sections, after the translation and again after the overrides (:func:`msllm.config.load_config`):
  the decoding keys to ``generation_config`` (:func:`hoist_generation_keys`), ``pet_config`` (LoRA;
  0.x: ``model.arch.pet``) to the top-level ``pet_config`` (:func:`hoist_pet_config`,
  :func:`hoist_pet_overrides`). The no-effect keys inside it (``mindformers_keys.NO_EFFECT``'s
  ``model.model_config.pet_config.*``) are looked up before the move, at MindFormers' place.
* Anything else is left for the schema check, which rejects an unknown key with the nearest valid
  name (keys inside MindFormers-shaped sections are moved where that message names them).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Union

from msllm.config_io import apply_overrides, parse_override
from msllm.compat.mindformers_keys import CALLBACK_ARGS_NEUTRAL, CALLBACK_ARGS_NO_EFFECT, NEUTRAL, NO_EFFECT
from msllm.config_generation import MINDFORMERS_KEYS
from msllm.errors import MsllmError

DATASETS = ("train_dataset", "eval_dataset")
_CKPT_TYPES = ("CheckpointMointor", "CheckpointMonitor")  # MindFormers r1.0 spells it "Mointor"
_CALLBACK_TYPES = ("MFLossMonitor", *_CKPT_TYPES, "SummaryMonitor", "ProfileMonitor", "ObsMonitor", "EvalCallBack")
_WRAPPER_TYPES = ("MFTrainOneStepCell", "MFPipelineWithLossScaleCell", "TrainOneStepWithLossScaleCell")


def translate_mindformers_yaml(data: dict, source: str, schema: type) -> tuple[dict, list[tuple[str, str]]]:
    """A run-YAML mapping (MindFormers' or msllm's) in msllm's schema.

    Args:
        data: the mapping read from the YAML (``yaml.safe_load``; not modified).
        source: the file name, for error messages.
        schema: msllm's run-config dataclass (:class:`msllm.config.RunConfig`, passed in by
            :func:`msllm.config.load_config`, so that this module does not import it back): which
            keys msllm has decides what is mapped and what is named as without effect.

    Returns:
        ``(translated, no_effect)``: a new mapping for :func:`msllm.config.from_dict`, and the
        ``(key path, reason)`` of every key accepted with no effect, in YAML order. An msllm YAML
        comes back equal, with an empty list.

    Raises:
        MsllmError: a MindFormers value msllm cannot honour (names ``source``, the key and why).
    """
    t = _Translation(copy.deepcopy(data), source, schema)  # YAML aliases (&train_dataset) share objects
    t.run()
    return t.data, t.notes


def hoist_generation_keys(data: dict) -> dict:
    """MindFormers keeps inference settings in ``model.model_config`` (``do_sample``, ``top_k``,
    ``top_p``, ``repetition_penalty``, ``max_decode_length``, ``use_past``: its
    ``configs/llama2/predict_llama2_7b.yaml``); msllm's schema has them in ``generation_config``
    only. Each one found there moves to ``generation_config`` unless that section sets the key
    itself (the section wins, as it would at generation). Returns ``data`` (changed in place)."""
    mc = (data.get("model") or {}).get("model_config")
    if not isinstance(mc, dict):
        return data
    moved = {k: mc.pop(k) for k in MINDFORMERS_KEYS if k in mc}
    if moved:
        gen = data.setdefault("generation_config", {}) or {}
        data["generation_config"] = gen
        for k, v in moved.items():
            if gen.get(k) is None:
                gen[k] = v
    return data


# MindFormers' place of the LoRA section (model.model_config.pet_config) and msllm's (top level)
PET_MF_PATH = ("model", "model_config", "pet_config")
PET_PATH = ("pet_config",)


def _merge_pet(mf_value: Any, value: Any, mf_key: str, key: str, source: str = "") -> Any:
    """The LoRA section given at MindFormers' place (``mf_value``, named ``mf_key``) and at msllm's
    (``value``, ``key``) as one: None at either place is no value; two mappings join key by key;
    a key both set to different values (or two different non-mappings) is one MsllmError naming
    both keys."""
    if mf_value is None:
        return value
    if value is None:
        return mf_value
    where = f"{source}: " if source else ""
    hint = (f"give it once (msllm keeps LoRA in {'.'.join(PET_PATH)}; MindFormers' {'.'.join(PET_MF_PATH)} "
            "is moved there)")
    if isinstance(mf_value, dict) and isinstance(value, dict):
        for k in mf_value:
            if k in value and mf_value[k] != value[k]:
                raise MsllmError(f"{where}{mf_key}.{k}={mf_value[k]!r} and {key}.{k}={value[k]!r} both set LoRA's "
                                 f"{k}: {hint}")
        return {**mf_value, **value}
    if mf_value != value:
        raise MsllmError(f"{where}{mf_key}={mf_value!r} and {key}={value!r} both set LoRA (pet_config): {hint}")
    return value


def hoist_pet_config(data: dict, source: str = "") -> dict:
    """MindFormers keeps LoRA's settings in ``model.model_config.pet_config`` (its
    ``configs/llama2/lora_llama2_7b.yaml``); msllm's schema has them in the top-level ``pet_config``
    section (:class:`msllm.config_lora.PetConfig`), so the model config describes the model only.
    A ``pet_config`` found in ``model.model_config`` moves there; if both places are given, they
    join key by key, and a key set to two different values is one MsllmError naming both keys
    (``source``, the file, prefixed). Returns ``data`` (changed in place)."""
    mc = (data.get("model") or {}).get("model_config")
    if not isinstance(mc, dict) or "pet_config" not in mc:
        return data
    merged = _merge_pet(mc.pop("pet_config"), data.get("pet_config"), ".".join(PET_MF_PATH), "pet_config", source)
    if merged is not None or "pet_config" in data:
        data["pet_config"] = merged
    return data


def hoist_generation_overrides(overrides: list[str]) -> list[str]:
    """``--model.model_config.KEY=VALUE`` overrides of MindFormers' decoding keys
    (:data:`msllm.config_generation.MINDFORMERS_KEYS`) rewritten as ``--generation_config.KEY=VALUE``, so a
    command-line value beats the run YAML's ``generation_config`` section (after the YAML is read, the
    section would otherwise win over a value that :func:`hoist_generation_keys` finds in
    ``model.model_config``). Where the overrides also give ``--generation_config.KEY``, that one wins (as
    in a YAML) and the MindFormers spelling is left in place. The other overrides are returned unchanged."""
    from msllm.config_generation import MINDFORMERS_KEYS

    parsed = [parse_override(arg)[0] for arg in overrides]
    in_section = {keys[1] for keys in parsed if len(keys) == 2 and keys[0] == "generation_config"}
    out = []
    for arg, keys in zip(overrides, parsed):
        if (len(keys) == 3 and tuple(keys[:2]) == ("model", "model_config") and keys[2] in MINDFORMERS_KEYS
                and keys[2] not in in_section):
            arg = f"--generation_config.{keys[2]}=" + arg.split("=", 1)[1]
        out.append(arg)
    return out


def hoist_pet_overrides(overrides: list[str]) -> list[str]:
    """``--model.model_config.pet_config[.KEY]=VALUE`` overrides (MindFormers' place, as the README
    and MindFormers users write them) rewritten as ``--pet_config[.KEY]=VALUE``, in order, so that
    they override the run YAML's ``pet_config`` section (moved there by :func:`hoist_pet_config`)
    exactly as the ``--pet_config...`` spelling does. The other overrides are returned unchanged.

    Raises MsllmError when overrides give both spellings with different values for one key
    (naming both)."""
    out, mf_form, ms_form = [], [], []
    for arg in overrides:
        keys, _ = parse_override(arg)
        if tuple(keys[:3]) == PET_MF_PATH:
            raw = arg.split("=", 1)[1]
            new = "--" + ".".join(PET_PATH + tuple(keys[3:])) + "=" + raw
            mf_form.append(arg)
            out.append(new)
        else:
            if tuple(keys[:1]) == PET_PATH:
                ms_form.append(arg)
            out.append(arg)
    if mf_form and ms_form:
        mf_value = apply_overrides({}, mf_form)["model"]["model_config"]["pet_config"]
        _merge_pet(mf_value, apply_overrides({}, ms_form)["pet_config"], "--model.model_config.pet_config",
                   "--pet_config", "overrides")
    return out


def _schema_has(path: str, schema: type) -> bool:
    """Whether the run-config schema ``schema`` (a dataclass) has the key ``path`` (dotted)."""
    cls: Any = schema
    for part in path.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        tp = hints[part]
        if typing.get_origin(tp) in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else tp
        cls = tp
    return True


def _expand(path: str) -> list[str]:
    return [path.replace("{ds}", d) for d in DATASETS] if "{ds}" in path else [path]


class _Translation:
    def __init__(self, data: dict, source: str, schema: type):
        self.data = data
        self.source = source
        self.schema = schema
        self.notes: list[tuple[str, str]] = []
        self.order = list(data)

    # ---- helpers --------------------------------------------------------------------------
    def note(self, path: str, reason: str) -> None:
        self.notes.append((path, reason))

    def refuse(self, path: str, value: Any, why: str) -> None:
        raise MsllmError(f"{self.source}: {path}={value!r} (MindFormers key): {why}")

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def pop(self, path: str) -> Any:
        parent, _, key = path.rpartition(".")
        node = self.get(parent) if parent else self.data
        return node.pop(key) if isinstance(node, dict) and key in node else None

    def section(self, path: str) -> dict | None:
        node = self.get(path)
        return node if isinstance(node, dict) else None

    def put(self, sec: dict, key: str, value: Any, where: str, mf_key: str) -> None:
        """Set ``sec[key]`` from MindFormers' ``mf_key`` unless the msllm key is already given."""
        if key in sec:
            self.note(f"{where}.{mf_key}" if where else mf_key, f"overridden by {where + '.' if where else ''}{key}")
        else:
            sec[key] = value

    def rename(self, sec: dict, old: str, new: str, where: str, convert=lambda v: v) -> None:
        if old in sec:
            self.put(sec, new, convert(sec.pop(old)), where, old)

    # ---- the passes -----------------------------------------------------------------------
    def run(self) -> None:
        self.mindformers_style = self._looks_like_mindformers()
        self._top_level()
        for ds in DATASETS:
            self._dataset(ds)
        self._optimizer()
        self._lr_schedule()
        self._runner_wrapper()
        self._callbacks()
        self._context()
        self._parallel()
        self._model()
        self._generic()
        hoist_generation_keys(self.data)
        hoist_pet_config(self.data, self.source)

    def _looks_like_mindformers(self) -> bool:
        d = self.data
        return any((
            isinstance(d.get("callbacks"), list), "trainer" in d, "use_parallel" in d,
            "train_dataset_task" in d, self.get("train_dataset.data_loader") is not None,
            self.get("model.arch") is not None, self.get("model.model_config.type") is not None,
            self.get("runner_wrapper.type") is not None, self.get("optimizer.beta1") is not None,
        ))

    def _top_level(self) -> None:
        d = self.data
        if "resume_or_finetune_checkpoint" in d:  # MindFormers 0.x name of load_checkpoint
            value = d.pop("resume_or_finetune_checkpoint")
            if value and not d.get("load_checkpoint"):
                d["load_checkpoint"] = value
            else:
                self.note("resume_or_finetune_checkpoint", "empty or overridden by load_checkpoint")
        trainer = d.get("trainer")
        if isinstance(trainer, dict) and trainer.get("type", "CausalLanguageModelingTrainer") != \
                "CausalLanguageModelingTrainer":
            self.refuse("trainer.type", trainer["type"], "msllm trains causal language models only "
                        "(CausalLanguageModelingTrainer)")
        for task in ("train_dataset_task", "eval_dataset_task"):
            tsk = d.get(task)
            if not isinstance(tsk, dict):
                continue
            if tsk.get("type", "CausalLanguageModelDataset") != "CausalLanguageModelDataset":
                self.refuse(f"{task}.type", tsk["type"], "msllm reads causal-LM MindRecord data only "
                            "(CausalLanguageModelDataset)")
            ds = task[: -len("_task")]
            if ds not in d and isinstance(tsk.get("dataset_config"), dict):
                d[ds] = tsk["dataset_config"]  # only the task holds the dataset: use it
        moe = d.get("moe_config")
        if isinstance(moe, dict):   # MindFormers r1.0 keeps MoEConfig at the top level
            d.pop("moe_config")
            if (moe.get("expert_num") or 1) > 1:
                mc = d.setdefault("model", {}).setdefault("model_config", {})
                if isinstance(mc, dict) and "moe_config" not in mc:
                    # expert_num, num_experts_chosen, capacity_factor, aux_loss_factor: msllm's names;
                    # any other MoEConfig key is named by the schema check
                    mc["moe_config"] = dict(moe)
                else:
                    self.note("moe_config", "model.model_config.moe_config is given and wins")
            else:
                self.note("moe_config", "expert_num 1: no mixture of experts")
        metric = d.get("metric")
        if isinstance(metric, dict) or isinstance(metric, list):
            d.pop("metric")
            kinds = [m.get("type") for m in (metric if isinstance(metric, list) else [metric]) if isinstance(m, dict)]
            other = [k for k in kinds if k != "PerplexityMetric"]
            self.note("metric", "msllm's evaluation reports loss and perplexity (PerplexityMetric)" +
                      (f"; {', '.join(map(str, other))} not computed" if other else ""))

    def _dataset(self, ds: str) -> None:
        sec = self.section(ds)
        if sec is None or not isinstance(sec.get("data_loader"), dict):
            return
        loader = sec.pop("data_loader")
        kind = loader.pop("type", "MindDataset")
        if kind != "MindDataset":
            self.refuse(f"{ds}.data_loader.type", kind, "msllm reads MindRecord files (MindDataset) only; "
                        "convert the data with data_preprocess/llama_preprocess.py")
        for key, value in loader.items():  # dataset_dir, shuffle; others -> the schema names them
            self.put(sec, key, value, ds, f"data_loader.{key}")
        if "batch_size" in sec:
            sec.pop("batch_size")
            self.note(f"{ds}.batch_size", NO_EFFECT["{ds}.batch_size"])
        cols = sec.get("input_columns")
        if cols is not None and not _schema_has(f"{ds}.input_columns", self.schema):
            if sorted(cols) == ["input_ids", "labels"]:
                sec.pop("input_columns")
                self.note(f"{ds}.input_columns", "msllm reads input_ids and labels")
            else:
                self.refuse(f"{ds}.input_columns", cols, "this msllm build trains on the labels column "
                            "only; use [input_ids, labels]")

    def _optimizer(self) -> None:
        opt = self.section("optimizer")
        if opt is None or not any(k in opt for k in ("beta1", "beta2", "learning_rate")):
            return
        # MindFormers' AdamWeightDecay family defaults (core/optim/optim.py; weight_decay:
        # base_trainer.create_optimizer_scheduler uses 0. when unset)
        b1, b2 = opt.pop("beta1", 0.9), opt.pop("beta2", 0.999)
        self.put(opt, "betas", [float(b1), float(b2)], "optimizer", "beta1/beta2")
        opt.setdefault("eps", 1e-6)
        opt.setdefault("weight_decay", 0.0)
        if opt.get("type") == "AdamWeightDecay":  # mindspore.nn.AdamWeightDecay: msllm's AdamW
            opt["type"] = "AdamW"
        if "learning_rate" in opt:
            lr = opt.pop("learning_rate")
            if isinstance(self.data.get("lr_schedule"), dict):
                self.note("optimizer.learning_rate", "lr_schedule sets the learning rate (as in MindFormers, "
                          "which builds the optimizer with the schedule)")
            else:
                self.data["lr_schedule"] = {"type": "constant", "learning_rate": lr}

    def _lr_schedule(self) -> None:
        lr = self.section("lr_schedule")
        if lr is None:
            return
        if "total_steps" in lr and lr["total_steps"] is None:
            lr["total_steps"] = -1  # MindFormers: None or -1 = epochs x steps per epoch
        if "warmup_epochs" in lr:
            value = lr.pop("warmup_epochs")
            if lr.get("warmup_ratio") is not None or value is None:
                self.note("lr_schedule.warmup_epochs", "warmup_ratio takes precedence (as in MindFormers)")
            else:
                self.refuse("lr_schedule.warmup_epochs", value, "give the warmup as warmup_ratio or warmup_steps")
        if "warmup_ratio" in lr and lr["warmup_ratio"] is None:
            lr.pop("warmup_ratio")

    def _runner_wrapper(self) -> None:
        rw = self.section("runner_wrapper")
        if rw is None:
            if self.mindformers_style and "runner_wrapper" not in self.data:
                # MindFormers without a wrapper: mindspore Model's TrainOneStepCell, no loss
                # scaling, no clipping
                self.data["runner_wrapper"] = {"loss_scale": "none", "use_clip_grad": False}
            return
        if "type" not in rw and not isinstance(rw.get("scale_sense"), dict):
            return
        kind = rw.pop("type", "MFTrainOneStepCell")
        if kind not in _WRAPPER_TYPES:
            self.refuse("runner_wrapper.type", kind, f"msllm's train step implements {', '.join(_WRAPPER_TYPES)} "
                        "(loss scaling, overflow skip, gradient clipping)")
        ss = rw.pop("scale_sense", 1.0)  # MFTrainOneStepCell's default: a fixed scale of 1
        if isinstance(ss, dict):
            ss = dict(ss)
            cell = ss.pop("type", "DynamicLossScaleUpdateCell")
            if cell not in ("DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell"):
                self.refuse("runner_wrapper.scale_sense.type", cell,
                            "expected DynamicLossScaleUpdateCell or FixedLossScaleUpdateCell")
            value = ss.pop("loss_scale_value", None)
            if value is None:
                self.refuse("runner_wrapper.scale_sense.loss_scale_value", None, "the loss scale is required")
            if cell == "DynamicLossScaleUpdateCell" and ss.get("scale_factor") == 1:
                # a dynamic scale multiplied and divided by 1 never changes: MindSpore's
                # DynamicLossScaleUpdateCell then only skips overflowed steps, as msllm's fixed scale does
                ss.pop("scale_factor")
                ss.pop("scale_window", None)
                cell = "FixedLossScaleUpdateCell"
                self.note("runner_wrapper.scale_sense.scale_factor", "1: the dynamic scale never changes; "
                          "msllm runs it as a fixed scale (overflowed steps skipped either way)")
            self.put(rw, "loss_scale", "dynamic" if cell == "DynamicLossScaleUpdateCell" else "fixed",
                     "runner_wrapper", "scale_sense.type")
            self.put(rw, "scale_sense", float(value), "runner_wrapper", "scale_sense.loss_scale_value")
            for key in ("scale_factor", "scale_window"):
                if key in ss:
                    self.put(rw, key, ss.pop(key), "runner_wrapper", f"scale_sense.{key}")
            for key, value in ss.items():
                self.refuse(f"runner_wrapper.scale_sense.{key}", value,
                            "expected loss_scale_value, scale_factor, scale_window")
        else:
            self.put(rw, "loss_scale", "fixed", "runner_wrapper", "scale_sense")
            self.put(rw, "scale_sense", float(ss), "runner_wrapper", "scale_sense")
        rw.setdefault("use_clip_grad", False)  # MFTrainOneStepCell's default

    def _callbacks(self) -> None:
        cbs = self.data.get("callbacks")
        if not isinstance(cbs, list):
            return
        out: dict = {}
        saw_checkpoint = False
        for i, entry in enumerate(cbs):
            if not isinstance(entry, dict) or "type" not in entry:
                raise MsllmError(f"{self.source}: callbacks[{i}]={entry!r}: expected a mapping with a 'type' "
                                 f"(one of {', '.join(_CALLBACK_TYPES)})")
            args = dict(entry)
            kind = args.pop("type")
            name = "CheckpointMonitor" if kind in _CKPT_TYPES else kind
            where = f"callbacks[{kind}]"
            if kind not in _CALLBACK_TYPES:
                close = difflib.get_close_matches(str(kind), _CALLBACK_TYPES, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise MsllmError(f"{self.source}: unknown callback type {kind!r} in callbacks[{i}]{hint} "
                                 f"(msllm knows {', '.join(_CALLBACK_TYPES)})")
            target: dict | None = None
            if name == "MFLossMonitor":
                target = out.setdefault("loss_monitor", {})
                if "per_print_times" in args:
                    target["per_print_times"] = args.pop("per_print_times")
            elif name == "CheckpointMonitor":
                saw_checkpoint = True
                target = out.setdefault("checkpoint", {})
                # CheckpointMointor's defaults (core/callback/callback.py)
                target["prefix"] = args.pop("prefix", "CKP")
                target["save_checkpoint_steps"] = args.pop("save_checkpoint_steps", 1)
                target["keep_checkpoint_max"] = args.pop("keep_checkpoint_max", 5)
                if "checkpoint_format" in args:
                    target["format"] = args.pop("checkpoint_format")
            elif name == "SummaryMonitor":
                tb = self.data.setdefault("tensorboard", {})
                out_dir = str(self.data.get("output_dir") or "./output")
                tb.setdefault("tensorboard_dir", args.pop("summary_dir", None) or os.path.join(out_dir, "summary"))
            elif name == "ProfileMonitor":
                self.data["profile"] = True
                for src, dst in (("start_step", "profile_start_step"), ("stop_step", "profile_stop_step")):
                    if src in args:
                        self.put(self.data, dst, args.pop(src), "", f"{where}.{src}")
            else:  # ObsMonitor, EvalCallBack
                self.note(where, CALLBACK_ARGS_NO_EFFECT[f"{name}.*"])
                continue
            for key, value in args.items():
                self._callback_arg(name, where, key, value, target)
        if not saw_checkpoint:
            self.note("callbacks", "no CheckpointMonitor entry: MindFormers would save no checkpoints; "
                      "msllm saves with callbacks.checkpoint's defaults")
        self.data["callbacks"] = out

    def _callback_arg(self, name: str, where: str, key: str, value: Any, target: dict | None) -> None:
        neutral = CALLBACK_ARGS_NEUTRAL.get(f"{name}.{key}")
        if neutral is not None:
            if value not in neutral[0]:
                self.refuse(f"{where}.{key}", value, neutral[2])
            self.note(f"{where}.{key}", neutral[1])
        elif f"{name}.{key}" in CALLBACK_ARGS_NO_EFFECT:
            self.note(f"{where}.{key}", CALLBACK_ARGS_NO_EFFECT[f"{name}.{key}"])
        elif target is not None:
            target[key] = value  # unknown: the schema check names it with the nearest key
        else:
            raise MsllmError(f"{self.source}: unknown key {key!r} in {where}")

    def _context(self) -> None:
        ctx = self.section("context")
        if ctx is None:
            return
        jit = ctx.get("jit_config")
        if isinstance(jit, dict) and not _schema_has("context.jit_config", self.schema):
            ctx.pop("jit_config")
            if "jit_level" in jit:
                self.put(ctx, "jit_level", jit.pop("jit_level"), "context", "jit_config.jit_level")
            for key in jit:
                self.note(f"context.jit_config.{key}", "msllm sets only jit_level")
        if "deterministic" in ctx and not _schema_has("context.deterministic", self.schema):
            value = ctx.pop("deterministic")  # MindSpore set_context(deterministic="ON"|"OFF")
            if value not in ("ON", "OFF", True, False):
                self.refuse("context.deterministic", value, 'expected "ON" or "OFF"')
            self.put(self.data, "deterministic", value in ("ON", True), "", "context.deterministic")

    def _parallel(self) -> None:
        for key in ("recompute", "select_recompute"):
            rc = self.get(f"recompute_config.{key}")
            if isinstance(rc, (list, int, dict)) and not isinstance(rc, bool):
                self.refuse(f"recompute_config.{key}", rc, "recomputing chosen layers per pipeline stage is "
                            "not implemented; use True (every layer) or False")
        par = self.section("parallel")
        if par is not None:
            sc = par.get("strategy_ckpt_config")
            if isinstance(sc, dict) and not _schema_has("parallel.strategy_ckpt_config", self.schema):
                if "save_file" in sc:
                    self.put(par, "strategy_ckpt_save_file", sc.pop("save_file"), "parallel",
                             "strategy_ckpt_config.save_file")
                for key in list(sc):
                    path = f"parallel.strategy_ckpt_config.{key}"
                    if path in NO_EFFECT:
                        sc.pop(key)
                        self.note(path, NO_EFFECT[path])
                if sc:
                    self.refuse(f"parallel.strategy_ckpt_config.{next(iter(sc))}", sc[next(iter(sc))],
                                "msllm reads save_file only (load strategies with src_strategy_path_or_dir)")
                par.pop("strategy_ckpt_config")

    def _model(self) -> None:
        model = self.section("model")
        if model is None:
            return
        mc = model.get("model_config")
        arch = model.get("arch")
        if isinstance(arch, dict) and not _schema_has("model.arch", self.schema):
            model.pop("arch")
            kind = arch.get("type", "LlamaForCausalLM")
            given = [w for w, v in (("model.model_config.pet_config", mc.get("pet_config") if isinstance(mc, dict)
                                     else None), ("pet_config", self.data.get("pet_config"))) if isinstance(v, dict)]
            pet = arch.get("pet")
            if kind == "LlamaForCausalLMWithLora":  # MindFormers 0.x: LoRA from pet_config
                if not given and not isinstance(pet, dict):
                    self.refuse("model.arch.type", kind, "needs LoRA settings: model.model_config.pet_config, "
                                "model.arch.pet or msllm's pet_config section (pet_type: lora)")
            elif kind != "LlamaForCausalLM":
                self.refuse("model.arch.type", kind, "msllm builds LlamaForCausalLM only (LoRA via "
                            "pet_config)")
            self.note("model.arch", f"{kind}: msllm's one model (LoRA comes from pet_config)")
            if isinstance(pet, dict):  # older layout: model.arch.pet -> msllm's pet_config section
                if given:
                    self.note("model.arch.pet", f"overridden by {given[0]}")
                else:
                    self.data["pet_config"] = {"pet_type": pet.get("pet_type", "lora"), **(pet.get("pet_config") or {})}
        if not isinstance(mc, dict):
            return
        where = "model.model_config"
        if "type" in mc and not _schema_has(f"{where}.type", self.schema):
            kind = mc.pop("type")
            if kind != "LlamaConfig":
                self.refuse(f"{where}.type", kind, "msllm's model config is LlamaConfig")
            self.note(f"{where}.type", "LlamaConfig: msllm's one model config")
            # MindFormers' LlamaConfig defaults where they differ from msllm's (llama_config.py)
            mc.setdefault("compute_dtype", "float16")
            mc.setdefault("param_init_type", "float16")
        self.rename(mc, "theta", "rope_theta", where)
        self.rename(mc, "layernorm_compute_dtype", "layernorm_compute_type", where)
        self.rename(mc, "softmax_compute_dtype", "softmax_compute_type", where)
        if "max_position_embedding" in mc:
            value = mc.pop("max_position_embedding")
            seq = mc.get("seq_length", 2048)
            if value is not None:
                if value < seq:  # FreqsMgr: max_position_embedding = seq_length if that is longer
                    self.note(f"{where}.max_position_embedding",
                              f"{value} < seq_length {seq}: MindFormers uses seq_length, and so does msllm")
                    value = seq
                self.put(mc, "max_position_embeddings", value, where, "max_position_embedding")
        self._rope_extension(mc, where)
        self._checkpoint_name(mc, where)
        self._family_keys(mc, where)
        pet = mc.get("pet_config")
        if isinstance(pet, dict):
            kind = pet.get("pet_type", "lora")
            if kind != "lora":
                self.refuse(f"{where}.pet_config.pet_type", kind, "msllm implements LoRA only (pet_type: lora)")

    def _rope_extension(self, mc: dict, where: str) -> None:
        """extend_method / scaling_factor (``FreqsMgr``: r1.0 llama_layer.py, later
        modules/layers.py): PI divides positions by the factor (= HF linear rope_scaling), NTK
        multiplies theta by it; LLAMA3 and YARN take a mapping of HF's ``rope_scaling`` keys
        (MindFormers' research/llama3_1 and qwen2_5 YAMLs, dev branch fd4deebc) and are HF's
        ``llama3`` / ``yarn`` rotary."""
        method = mc.pop("extend_method", None)
        factor = mc.pop("scaling_factor", None)
        if method in (None, "None"):
            if method is not None:
                self.note(f"{where}.extend_method", "None: no sequence-length extension")
            if factor is not None:
                self.note(f"{where}.scaling_factor", "read only with extend_method PI, NTK, LLAMA3 or YARN")
            return
        kinds = {"LLAMA3": "llama3", "YARN": "yarn"}
        if method in kinds:
            if not isinstance(factor, dict):
                self.refuse(f"{where}.scaling_factor", factor, f"extend_method {method} needs a mapping "
                            "(factor, original_max_position_embeddings, ...) as in MindFormers' research YAMLs")
            self.put(mc, "rope_scaling", {"type": kinds[method], **factor}, where, "extend_method")
            return
        if isinstance(factor, dict):
            self.refuse(f"{where}.scaling_factor", factor, f"extend_method {method} takes one number")
        factor = 1.0 if factor is None else float(factor)
        if method == "PI":
            self.put(mc, "rope_scaling", {"type": "linear", "factor": factor}, where, "extend_method")
        elif method == "NTK":
            mc["rope_theta"] = float(mc.get("rope_theta", 10000.0)) * factor
        else:
            self.refuse(f"{where}.extend_method", method, 'expected "None", "PI", "NTK", "LLAMA3" or "YARN" '
                        "(DYNAMIC_NTK has no formula in MindFormers' FreqsMgr)")

    def _family_keys(self, mc: dict, where: str) -> None:
        """MindFormers runs Qwen2 / Qwen2.5 as its LlamaForCausalLM with ``qkv_has_bias`` (and
        InternLM with ``attn_proj_has_bias`` too, research/internlm): msllm's family is then
        ``qwen2`` (q/k/v biases) or LLaMA with ``attention_bias`` (all four). A list
        ``eos_token_id`` (Qwen2.5-Instruct: [151645, 151643]) keeps its first id in the model and the
        whole list as generation's stop ids; ``temperature`` is a generation setting."""
        out_bias = mc.pop("attn_proj_has_bias", None)
        if out_bias and mc.get("qkv_has_bias"):
            mc.pop("qkv_has_bias")
            self.put(mc, "attention_bias", True, where, "qkv_has_bias + attn_proj_has_bias")
        elif out_bias:
            self.refuse(f"{where}.attn_proj_has_bias", out_bias, "a bias on the output projection alone is no "
                        "family msllm has; with qkv_has_bias it is attention_bias")
        elif out_bias is not None:
            self.note(f"{where}.attn_proj_has_bias", "False: no output-projection bias")
        if mc.get("qkv_has_bias") and "model_type" not in mc:
            mc["model_type"] = "qwen2"
        eos = mc.get("eos_token_id")
        gen = self.data.get("generation_config")
        if isinstance(eos, list) and eos:
            mc["eos_token_id"] = eos[0]
            gen = self.data.setdefault("generation_config", {}) if gen is None else gen
            if isinstance(gen, dict):
                gen.setdefault("eos_token_id", list(eos))
        if "temperature" in mc and not _schema_has(f"{where}.temperature", self.schema):
            gen = self.data.setdefault("generation_config", {}) if gen is None else gen
            value = mc.pop("temperature")
            if isinstance(gen, dict):
                self.put(gen, "temperature", value, "generation_config", f"{where}.temperature")

    def _checkpoint_name(self, mc: dict, where: str) -> None:
        """checkpoint_name_or_path (run_mindformer.py update_checkpoint_config): in train/finetune
        it is replaced by load_checkpoint unless resuming or auto-transforming with an empty
        load_checkpoint; in predict/eval it is loaded when load_checkpoint is empty."""
        if "checkpoint_name_or_path" not in mc or _schema_has(f"{where}.checkpoint_name_or_path", self.schema):
            return
        value = mc.pop("checkpoint_name_or_path")
        d = self.data
        used = (not d.get("load_checkpoint")) and (
            d.get("run_mode", "train") in ("predict", "eval") or d.get("resume_training") or d.get("auto_trans_ckpt"))
        path = f"{where}.checkpoint_name_or_path"
        if not value:
            self.note(path, "empty: nothing to load")
        elif not used:
            self.note(path, "MindFormers replaces it with load_checkpoint in this run (run_mindformer.py)")
        elif os.path.exists(str(value)) or os.sep in str(value) or str(value).endswith((".ckpt", ".safetensors")):
            d["load_checkpoint"] = value
        else:
            self.note(path, f"{value!r} names a MindFormers model-zoo checkpoint (downloaded from Huawei OBS); "
                      "msllm has no model zoo: set load_checkpoint to converted weights (tools/convert_weight.py)")

    def _generic(self) -> None:
        """The table-driven rest: NO_EFFECT keys removed and listed, NEUTRAL keys checked."""
        for pattern, reason in NO_EFFECT.items():
            for path in _expand(pattern):
                if self._has_key(path) and not _schema_has(path, self.schema):
                    self.pop(path)
                    self.note(path, reason)
        for pattern, (neutral, reason, refused) in NEUTRAL.items():
            for path in _expand(pattern):
                if not self._has_key(path) or _schema_has(path, self.schema):
                    continue
                value = self.get(path)
                if value not in neutral:
                    self.refuse(path, value, refused)
                self.pop(path)
                self.note(path, reason)
        self.notes.sort(key=lambda n: self._order(n[0]))

    def _has_key(self, path: str) -> bool:
        parent, _, key = path.rpartition(".")
        node = self.get(parent) if parent else self.data
        return isinstance(node, dict) and key in node

    def _order(self, path: str) -> int:
        """Notes in YAML order: by the position of their top-level section in the file."""
        head = path.split(".")[0].split("[")[0]
        return self.order.index(head) if head in self.order else len(self.order)
