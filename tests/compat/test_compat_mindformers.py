"""MindFormers run YAMLs -> msllm config (msllm.compat.mindformers): every mapped key, every
no-effect key, the refusals, unknown keys, idempotency on msllm YAMLs."""

from __future__ import annotations

import copy
import os

import pytest

import msllm.compat.mindformers as mf
from msllm.compat.mindformers import translate_mindformers_yaml
from msllm.compat.mindformers_keys import CALLBACK_ARGS_NEUTRAL, CALLBACK_ARGS_NO_EFFECT, NEUTRAL, NO_EFFECT
from msllm.config import RunConfig, from_dict, read_yaml
from msllm.errors import MsllmError

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BLOG = os.path.join(HERE, "fixtures", "mf_blog_llama_7b_finetune.yaml")
MF_LOADER = {"data_loader": {"type": "MindDataset", "dataset_dir": "/d.mindrecord", "shuffle": True}}


def run(data: dict) -> tuple[RunConfig, list[tuple[str, str]]]:
    out, notes = translate_mindformers_yaml(data, "run.yaml", RunConfig)
    cfg = from_dict(RunConfig, out)
    cfg.validate()
    return cfg, notes


def noted(notes) -> list[str]:
    return [path for path, _ in notes]


def setpath(d: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


# ---- the tutorial YAML, whole ------------------------------------------------------------------

def test_blog_yaml_loads_and_maps():
    data = read_yaml(BLOG)
    before = copy.deepcopy(data)
    cfg, notes = run(data)
    assert data == before  # the input (with its shared YAML anchors) is not modified
    td, ed = cfg.train_dataset, cfg.eval_dataset
    assert (td.dataset_dir, td.shuffle, td.drop_remainder, td.num_parallel_workers, td.prefetch_size, td.batch_size) \
        == ("/data/alpaca-fastchat2048.mindrecord", True, True, 6, 2, None)
    assert (ed.dataset_dir, ed.shuffle, ed.drop_remainder, ed.num_parallel_workers) == ("/data/eval.mindrecord", False, False, 3)
    assert (cfg.do_eval, cfg.eval_step_interval, cfg.eval_epoch_interval) == (False, -1, 50)
    assert (cfg.seed, cfg.run_mode, cfg.load_checkpoint) == (42, "finetune", "/data/llama_7b.ckpt")
    rc = cfg.runner_config
    assert (rc.epochs, rc.batch_size, rc.sink_mode, rc.sink_size) == (3, 2, True, 2)  # sink_mode kept
    o = cfg.optimizer
    assert (o.type, o.betas, o.eps, o.weight_decay) == ("FP32StateAdamWeightDecay", [0.9, 0.999], 1e-8, 0.01)
    lr = cfg.lr_schedule
    assert (lr.type, lr.learning_rate, lr.lr_end, lr.warmup_ratio, lr.total_steps) == \
        ("CosineWithWarmUpLR", 2e-5, 1e-6, 0.03, -1)
    rw = cfg.runner_wrapper
    assert (rw.loss_scale, rw.scale_sense, rw.scale_factor, rw.scale_window, rw.use_clip_grad) == \
        ("dynamic", 4294967296.0, 2.0, 1000, True)
    ck = cfg.callbacks.checkpoint
    assert (ck.prefix, ck.save_checkpoint_steps, ck.keep_checkpoint_max) == ("llama_7b_alpaca", 200, 2)
    assert cfg.callbacks.loss_monitor.per_print_times == 5
    assert cfg.tensorboard.tensorboard_dir == "./output/summary_7b"
    p = cfg.parallel
    assert (p.parallel_mode, p.full_batch, p.search_mode, p.strategy_ckpt_save_file) == \
        (1, True, "sharding_propagation", "./ckpt_strategy_7b.ckpt")
    assert cfg.context.max_device_memory == "31GB" and cfg.context.device_target == "Ascend"
    mc = cfg.model_config
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.vocab_size, mc.multiple_of, mc.rms_norm_eps) == \
        (4096, 32, 32, 32000, 256, 1e-6)
    assert (mc.max_position_embeddings, mc.compute_dtype, mc.softmax_compute_type, mc.param_init_type) == \
        (2048, "float16", "float16", "float16")
    g = cfg.generation_config   # MindFormers keeps these in model_config: moved to their own section
    assert (g.use_past, g.top_k, g.top_p, g.do_sample, g.repetition_penalty, g.max_decode_length) == \
        (True, 3, 0.9, False, 1.1, 512)
    assert not hasattr(mc, "top_k")
    assert (cfg.profile, cfg.profile_start_step, cfg.profile_stop_step) == (False, 2, 6)
    assert recompute_of(cfg) == (True, False, False, True, True)
    expected = [
        "trainer", "optimizer.learning_rate", "train_dataset.batch_size", "train_dataset.input_columns",
        "train_dataset.python_multiprocessing", "train_dataset.numa_enable", "train_dataset.seed",
        "train_dataset.repeat", "train_dataset_task", "eval_dataset.input_columns",
        "eval_dataset.python_multiprocessing", "eval_dataset.numa_enable", "eval_dataset.repeat",
        "eval_dataset_task", "use_parallel", "parallel.strategy_ckpt_config.only_trainable_params",
        "parallel.enable_alltoall", "parallel.parallel_optimizer_config", "micro_batch_interleave_num",
        "moe_config", "callbacks[CheckpointMonitor].integrated_save", "callbacks[CheckpointMonitor].async_save",
        "callbacks[ObsMonitor]", "callbacks[SummaryMonitor].collect_freq", "context.enable_graph_kernel",
        "context.graph_kernel_flags", "context.max_call_depth", "context.save_graphs", "context.save_graphs_path",
        "model.arch", "model.model_config.type", "model.model_config.extend_method",
        "model.model_config.checkpoint_name_or_path", "model.model_config.batch_size", "model.model_config.offset",
        "model.model_config.rotary_dtype", "processor", "metric",
        "eval_callbacks", "auto_tune", "filepath_prefix", "autotune_per_step", "init_start_profile",
        "profile_communication", "profile_memory", "layer_scale", "layer_decay", "lr_scale", "lr_scale_factor",
        "remote_save_url",
    ]
    # a key msllm's schema gains (e.g. train_dataset.input_columns) is mapped, no longer listed
    expected = [p for p in expected if "[" in p or p.endswith("dataset.batch_size") or not mf._schema_has(p, RunConfig)]
    assert noted(notes) == expected
    assert all(reason for _, reason in notes)


def recompute_of(cfg):
    r = cfg.recompute_config
    return (r.recompute, r.select_recompute, r.parallel_optimizer_comm_recompute, r.mp_comm_recompute,
            r.recompute_slice_activation)


# ---- one mapped key at a time -------------------------------------------------------------------

MAPPED = [
    # (MindFormers fragment, {msllm attribute path: value})
    ({"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dir": "/x", "shuffle": False}}},
     {"train_dataset.dataset_dir": "/x", "train_dataset.shuffle": False}),
    ({"eval_dataset": {"data_loader": {"dataset_dir": "/e", "shuffle": True}, "drop_remainder": True,
                       "num_parallel_workers": 2}},
     {"eval_dataset.dataset_dir": "/e", "eval_dataset.shuffle": True, "eval_dataset.drop_remainder": True,
      "eval_dataset.num_parallel_workers": 2}),
    ({"train_dataset": {**MF_LOADER, "batch_size": 8}, "runner_config": {"batch_size": 2}},
     {"train_dataset.batch_size": None, "runner_config.batch_size": 2}),
    ({"do_eval": True, "eval_step_interval": 10, "eval_epoch_interval": -1},
     {"do_eval": True, "eval_step_interval": 10, "eval_epoch_interval": -1}),
    ({"optimizer": {"type": "FP32StateAdamWeightDecay", "beta1": 0.8, "beta2": 0.99}},
     {"optimizer.betas": [0.8, 0.99], "optimizer.eps": 1e-6, "optimizer.weight_decay": 0.0,  # MindFormers' defaults
      "optimizer.type": "FP32StateAdamWeightDecay"}),
    ({"optimizer": {"type": "AdamWeightDecay", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}},
     {"optimizer.type": "AdamW", "optimizer.betas": [0.9, 0.95], "optimizer.eps": 1e-8}),
    ({"optimizer": {"beta1": 0.9, "learning_rate": 3e-4}},  # no lr_schedule: a constant rate
     {"lr_schedule.type": "constant", "lr_schedule.learning_rate": 3e-4}),
    ({"lr_schedule": {"type": "CosineWithWarmUpLR", "learning_rate": 1e-4, "warmup_ratio": 0.1, "total_steps": None,
                      "warmup_epochs": 1}},
     {"lr_schedule.total_steps": -1, "lr_schedule.warmup_ratio": 0.1}),
    ({"runner_wrapper": {"type": "MFTrainOneStepCell", "scale_sense": {"type": "DynamicLossScaleUpdateCell",
                         "loss_scale_value": 1024, "scale_factor": 4, "scale_window": 50}, "use_clip_grad": True,
                         "max_grad_norm": 0.5}},
     {"runner_wrapper.loss_scale": "dynamic", "runner_wrapper.scale_sense": 1024.0, "runner_wrapper.scale_factor": 4.0,
      "runner_wrapper.scale_window": 50, "runner_wrapper.use_clip_grad": True, "runner_wrapper.max_grad_norm": 0.5}),
    ({"runner_wrapper": {"type": "MFTrainOneStepCell", "scale_sense": {"type": "FixedLossScaleUpdateCell",
                                                                       "loss_scale_value": 128}}},
     {"runner_wrapper.loss_scale": "fixed", "runner_wrapper.scale_sense": 128.0,
      "runner_wrapper.use_clip_grad": False}),  # MFTrainOneStepCell's default
    ({"runner_wrapper": {"type": "MFTrainOneStepCell", "scale_sense": 512}},
     {"runner_wrapper.loss_scale": "fixed", "runner_wrapper.scale_sense": 512.0}),
    ({"runner_wrapper": {"type": "MFTrainOneStepCell"}},  # default scale_sense 1.0: a fixed scale of 1
     {"runner_wrapper.loss_scale": "fixed", "runner_wrapper.scale_sense": 1.0}),
    ({"trainer": {"type": "CausalLanguageModelingTrainer"}},  # MindFormers YAML without a wrapper
     {"runner_wrapper.loss_scale": "none", "runner_wrapper.use_clip_grad": False}),
    ({"callbacks": [{"type": "MFLossMonitor", "per_print_times": 7},
                    {"type": "CheckpointMointor", "prefix": "p", "save_checkpoint_steps": 9, "keep_checkpoint_max": 4,
                     "checkpoint_format": "safetensors"}]},
     {"callbacks.loss_monitor.per_print_times": 7, "callbacks.checkpoint.prefix": "p",
      "callbacks.checkpoint.save_checkpoint_steps": 9, "callbacks.checkpoint.keep_checkpoint_max": 4,
      "callbacks.checkpoint.format": "safetensors"}),
    ({"callbacks": [{"type": "CheckpointMonitor"}]},  # CheckpointMointor's defaults
     {"callbacks.checkpoint.prefix": "CKP", "callbacks.checkpoint.save_checkpoint_steps": 1,
      "callbacks.checkpoint.keep_checkpoint_max": 5}),
    ({"output_dir": "/o", "callbacks": [{"type": "SummaryMonitor"}]},
     {"tensorboard.tensorboard_dir": "/o/summary"}),
    ({"callbacks": [{"type": "ProfileMonitor", "start_step": 3, "stop_step": 5}]},
     {"profile": True, "profile_start_step": 3, "profile_stop_step": 5}),
    ({"profile": True, "profile_start_step": 4, "profile_stop_step": 8},
     {"profile": True, "profile_start_step": 4, "profile_stop_step": 8}),
    ({"context": {"jit_config": {"jit_level": "O1"}, "deterministic": "ON", "max_device_memory": "20GB"}},
     {"context.jit_level": "O1", "deterministic": True, "context.max_device_memory": "20GB"}),
    ({"parallel": {"strategy_ckpt_config": {"save_file": "./s.ckpt"}, "search_mode": "recursive_programming"}},
     {"parallel.strategy_ckpt_save_file": "./s.ckpt", "parallel.search_mode": "recursive_programming"}),
    ({"model": {"model_config": {"type": "LlamaConfig", "num_layers": 2, "seq_length": 64, "hidden_size": 64,
                                 "num_heads": 4, "theta": 500000.0, "max_position_embedding": 128}}},
     {"model.model_config.rope_theta": 500000.0, "model.model_config.max_position_embeddings": 128,
      "model.model_config.compute_dtype": "float16", "model.model_config.param_init_type": "float16"}),
    ({"model": {"model_config": {"seq_length": 4096, "max_position_embedding": 2048}}},  # FreqsMgr takes the larger
     {"model.model_config.max_position_embeddings": 4096}),
    ({"model": {"model_config": {"extend_method": "PI", "scaling_factor": 4.0}}},
     {"model.model_config.rope_scaling": {"type": "linear", "factor": 4.0}}),
    ({"model": {"model_config": {"extend_method": "NTK", "scaling_factor": 8.0, "theta": 10000.0}}},
     {"model.model_config.rope_theta": 80000.0, "model.model_config.rope_scaling": None}),
    ({"model": {"model_config": {"layernorm_compute_dtype": "float32", "softmax_compute_dtype": "float16"}}},
     {"model.model_config.layernorm_compute_type": "float32", "model.model_config.softmax_compute_type": "float16"}),
    ({"model": {"model_config": {"use_past": True, "do_sample": True, "top_k": 5, "top_p": 0.8,
                                 "repetition_penalty": 1.2, "max_decode_length": 100}}},
     {"generation_config.use_past": True, "generation_config.do_sample": True, "generation_config.top_k": 5,
      "generation_config.top_p": 0.8, "generation_config.repetition_penalty": 1.2,
      "generation_config.max_decode_length": 100}),
    ({"model": {"model_config": {"pet_config": {"pet_type": "lora", "lora_rank": 16, "lora_alpha": 32,
                                                "lora_dropout": 0.05, "target_modules": ".*wq|.*wv",
                                                "in_channels": 4096, "out_channels": 4096}}}},
     {"pet_config.lora_rank": 16, "pet_config.lora_alpha": 32.0,  # moved to msllm's own section
      "pet_config.target_modules": ".*wq|.*wv"}),
    ({"model": {"model_config": {"pet_config": {"pet_type": "lora", "lora_rank": 8}},
                "arch": {"type": "LlamaForCausalLMWithLora"}}},
     {"pet_config.lora_rank": 8}),
    ({"model": {"model_config": {"num_layers": 2},   # MindFormers 0.x: model.arch.pet
                "arch": {"type": "LlamaForCausalLMWithLora",
                         "pet": {"pet_type": "lora", "pet_config": {"lora_rank": 4, "lora_alpha": 8}}}}},
     {"pet_config.lora_rank": 4, "pet_config.lora_alpha": 8.0, "model.model_config.num_layers": 2}),
    ({"run_mode": "predict", "model": {"model_config": {"checkpoint_name_or_path": "/w/llama.ckpt"}}},
     {"load_checkpoint": "/w/llama.ckpt"}),
    ({"resume_or_finetune_checkpoint": "/w/old.ckpt"}, {"load_checkpoint": "/w/old.ckpt"}),
]


def attr(cfg, path):
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("fragment, expected", MAPPED, ids=[str(list(e)[0]) for _, e in MAPPED])
def test_each_mapped_key(fragment, expected):
    cfg, _ = run(copy.deepcopy(fragment))
    for path, value in expected.items():
        assert attr(cfg, path) == value, path


def test_msllm_name_wins_over_mindformers_name():
    """A --train_dataset.dataset_dir override on a MindFormers YAML (both keys present)."""
    data = {"train_dataset": {**copy.deepcopy(MF_LOADER), "dataset_dir": "/cli"},
            "model": {"model_config": {"theta": 1.0, "rope_theta": 2.0}}}
    cfg, notes = run(data)
    assert cfg.train_dataset.dataset_dir == "/cli" and cfg.model_config.rope_theta == 2.0
    assert ("train_dataset.data_loader.dataset_dir", "overridden by train_dataset.dataset_dir") in notes
    assert ("model.model_config.theta", "overridden by model.model_config.rope_theta") in notes


# ---- no-effect keys -----------------------------------------------------------------------------

def _no_effect_cases():
    special = {"trainer": {"model_name": "m"}, "train_dataset_task": {"type": "CausalLanguageModelDataset"},
               "eval_dataset_task": {"type": "CausalLanguageModelDataset"}}
    for pattern in NO_EFFECT:
        for path in mf._expand(pattern):
            yield path, special.get(path, True)


@pytest.mark.parametrize("path, value", list(_no_effect_cases()))
def test_each_no_effect_key_is_listed_with_its_reason(path, value):
    data = setpath({"train_dataset": copy.deepcopy(MF_LOADER), "eval_dataset": copy.deepcopy(MF_LOADER)}, path, value)
    if path.startswith("model.model_config.pet_config"):
        data["model"]["model_config"]["pet_config"]["pet_type"] = "lora"
    if path.startswith("runner_wrapper"):
        data["runner_wrapper"]["type"] = "MFTrainOneStepCell"
    out, notes = translate_mindformers_yaml(data, "run.yaml", RunConfig)
    # a key msllm implements is left alone -- except a MindFormers dataset section's batch_size,
    # which MindFormers itself overwrites with runner_config.batch_size (check_dataset_config)
    if mf._schema_has(path, RunConfig) and not path.endswith("dataset.batch_size"):
        assert path not in noted(notes)
        return
    pattern = path.replace("train_dataset", "{ds}").replace("eval_dataset", "{ds}")
    assert (path, NO_EFFECT.get(path, NO_EFFECT.get(pattern))) in notes
    from_dict(RunConfig, out)  # and the key is gone: the schema accepts the rest


@pytest.mark.parametrize("path", [p for pat in NEUTRAL for p in mf._expand(pat)])
def test_neutral_keys_listed_when_off_refused_when_on(path):
    neutral, reason, refused = NEUTRAL[path if path in NEUTRAL else path.replace("train_dataset", "{ds}").replace(
        "eval_dataset", "{ds}")]
    base = {"train_dataset": copy.deepcopy(MF_LOADER), "eval_dataset": copy.deepcopy(MF_LOADER)}
    out, notes = translate_mindformers_yaml(setpath(copy.deepcopy(base), path, neutral[0]), "run.yaml", RunConfig)
    assert (path, reason) in notes
    from_dict(RunConfig, out)
    with pytest.raises(MsllmError) as info:
        translate_mindformers_yaml(setpath(copy.deepcopy(base), path, "on" if neutral[0] != "on" else 2), "run.yaml", RunConfig)
    assert "run.yaml" in str(info.value) and path in str(info.value) and refused in str(info.value)


@pytest.mark.parametrize("key", list(CALLBACK_ARGS_NO_EFFECT) + list(CALLBACK_ARGS_NEUTRAL))
def test_callback_arguments(key):
    name, arg = key.split(".")
    kind = "CheckpointMointor" if name == "CheckpointMonitor" else name
    entry = {"type": kind} if arg == "*" else {"type": kind, arg: CALLBACK_ARGS_NEUTRAL.get(key, ((0,),))[0][0]}
    out, notes = translate_mindformers_yaml({"callbacks": [{"type": "CheckpointMonitor"}, entry]}, "run.yaml", RunConfig)
    where = f"callbacks[{kind}]" + ("" if arg == "*" else f".{arg}")
    reason = CALLBACK_ARGS_NO_EFFECT.get(key) or CALLBACK_ARGS_NEUTRAL[key][1]
    assert (where, reason) in notes
    from_dict(RunConfig, out)
    if key in CALLBACK_ARGS_NEUTRAL:
        with pytest.raises(MsllmError, match=arg):
            translate_mindformers_yaml({"callbacks": [{"type": kind, arg: 30}]}, "run.yaml", RunConfig)


def test_other_noted_situations():
    _, notes = run({"callbacks": [{"type": "MFLossMonitor"}],
                    "metric": {"type": "ADGENMetric"},
                    "model": {"model_config": {"checkpoint_name_or_path": "llama_7b", "extend_method": "None"}},
                    "run_mode": "predict"})
    paths = dict(notes)
    assert "no CheckpointMonitor" in paths["callbacks"]
    assert "ADGENMetric not computed" in paths["metric"]
    assert "model-zoo" in paths["model.model_config.checkpoint_name_or_path"]


# ---- refusals and unknown keys ------------------------------------------------------------------

REFUSED = [
    ({"trainer": {"type": "ImageClassificationTrainer"}}, "trainer.type"),
    ({"train_dataset": {"data_loader": {"type": "ADGenDataLoader"}}}, "train_dataset.data_loader.type"),
    ({"train_dataset_task": {"type": "KeyWordGenDataset"}}, "train_dataset_task.type"),
    ({"model": {"arch": {"type": "GLMForPreTraining"}}}, "model.arch.type"),
    ({"model": {"model_config": {"type": "GPT2Config"}}}, "model.model_config.type"),
    ({"model": {"model_config": {"extend_method": "YaRN"}}}, "model.model_config.extend_method"),
    ({"model": {"model_config": {"pet_config": {"pet_type": "prefixtuning"}}}}, "pet_type"),
    ({"runner_wrapper": {"type": "MyWrapper"}}, "runner_wrapper.type"),
    ({"runner_wrapper": {"scale_sense": {"type": "DynamicLossScaleUpdateCell"}}}, "loss_scale_value"),
    ({"lr_schedule": {"warmup_epochs": 2}}, "lr_schedule.warmup_epochs"),
    ({"recompute_config": {"select_recompute": [4, 2]}}, "recompute_config.select_recompute"),
    ({"context": {"deterministic": "MAYBE"}}, "context.deterministic"),
    ({"callbacks": [{"type": "CheckpointMonitor", "enc_key": "secret"}]}, "enc_key"),
    ({"callbacks": ["MFLossMonitor"]}, "callbacks[0]"),
]


@pytest.mark.parametrize("fragment, fragment_in_message", REFUSED, ids=[r[1] for r in REFUSED])
def test_values_msllm_cannot_honour_are_refused(fragment, fragment_in_message):
    with pytest.raises(MsllmError) as info:
        translate_mindformers_yaml(fragment, "run.yaml", RunConfig)
    assert "run.yaml" in str(info.value) and fragment_in_message in str(info.value)


@pytest.mark.parametrize("fragment, message", [
    ({"trainer": {"type": "CausalLanguageModelingTrainer"}, "runner_config": {"batchsize": 2}},
     "unknown config key 'runner_config.batchsize'; did you mean 'batch_size'?"),
    ({"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dri": "/x"}}},
     "unknown config key 'train_dataset.dataset_dri'; did you mean 'dataset_dir'?"),
    ({"callbacks": [{"type": "CheckpointMonitor", "save_checkpoint_step": 5}]},
     "unknown config key 'callbacks.checkpoint.save_checkpoint_step'; did you mean 'save_checkpoint_steps'?"),
    ({"use_parallel": True, "profle": True}, "unknown config key 'profle'; did you mean 'profile'?"),
])
def test_unknown_keys_still_fail_with_the_nearest_name(fragment, message):
    out, _ = translate_mindformers_yaml(fragment, "run.yaml", RunConfig)
    with pytest.raises(MsllmError, match=message.replace("?", r"\?")):
        from_dict(RunConfig, out)


def test_unknown_callback_type_names_the_nearest():
    with pytest.raises(MsllmError, match="unknown callback type 'CheckpointMoniter'.*did you mean 'CheckpointMonitor'"):
        translate_mindformers_yaml({"callbacks": [{"type": "CheckpointMoniter"}]}, "run.yaml", RunConfig)


# ---- idempotency --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "7b", "13b", "70b"])
def test_msllm_yaml_is_left_unchanged(name):
    data = read_yaml(os.path.join(REPO, "configs", "llama", f"run_llama_{name}.yaml"))
    out, notes = translate_mindformers_yaml(data, "x.yaml", RunConfig)
    assert out == data and notes == []
    again, notes2 = translate_mindformers_yaml(translate_mindformers_yaml(read_yaml(BLOG), "b.yaml", RunConfig)[0], "b.yaml", RunConfig)
    assert again == translate_mindformers_yaml(read_yaml(BLOG), "b.yaml", RunConfig)[0] and notes2 == []


# ---- input_columns (needs train_dataset.input_columns in the schema to map ["input_ids"]) -------

def test_input_columns_with_and_without_the_schema_key(monkeypatch):
    both = {"train_dataset": {**copy.deepcopy(MF_LOADER), "input_columns": ["input_ids", "labels"]}}
    only = {"train_dataset": {**copy.deepcopy(MF_LOADER), "input_columns": ["input_ids"]}}
    real = mf._schema_has
    monkeypatch.setattr(mf, "_schema_has", lambda p, schema: False if p.endswith("input_columns") else real(p, schema))
    out, notes = translate_mindformers_yaml(copy.deepcopy(both), "r.yaml", RunConfig)
    assert "input_columns" not in out["train_dataset"] and "train_dataset.input_columns" in noted(notes)
    with pytest.raises(MsllmError, match=r"train_dataset.input_columns=\['input_ids'\]"):
        translate_mindformers_yaml(copy.deepcopy(only), "r.yaml", RunConfig)
    monkeypatch.setattr(mf, "_schema_has", lambda p, schema: True if p.endswith("input_columns") else real(p, schema))
    out, notes = translate_mindformers_yaml(copy.deepcopy(only), "r.yaml", RunConfig)
    assert out["train_dataset"]["input_columns"] == ["input_ids"] and "train_dataset.input_columns" not in noted(notes)


def test_docs_list_every_key_with_its_reason():
    """docs/mindformers_compat.md carries the tables: every key and reason is there."""
    with open(os.path.join(REPO, "docs", "mindformers_compat.md"), encoding="utf-8") as fh:
        doc = fh.read()
    for table in (NO_EFFECT, CALLBACK_ARGS_NO_EFFECT):
        for key, reason in table.items():
            assert f"| `{key}` | {reason} |" in doc, key
    for key, (_, reason, refused) in {**NEUTRAL, **CALLBACK_ARGS_NEUTRAL}.items():
        assert f"| `{key}` |" in doc and reason in doc and refused in doc, key


def test_overrides_in_msllm_names_after_translation():
    """The order load_config uses: translate the YAML as read, then apply --key=value overrides."""
    from msllm.config import apply_overrides

    data, _ = translate_mindformers_yaml(read_yaml(BLOG), BLOG, RunConfig)
    data = apply_overrides(data, ["--train_dataset.dataset_dir=/cli.mindrecord", "--runner_config.batch_size=8",
                                  "--callbacks.checkpoint.prefix=cli", "--runner_wrapper.loss_scale=none"])
    cfg = from_dict(RunConfig, data)
    assert (cfg.train_dataset.dataset_dir, cfg.runner_config.batch_size, cfg.callbacks.checkpoint.prefix,
            cfg.runner_wrapper.loss_scale) == ("/cli.mindrecord", 8, "cli", "none")
