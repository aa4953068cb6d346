"""msllm/settings.py: every setting whose effect depends on the device or mode is refused with one
message, or named in the start-up line, per run mode (issue #13); and run_distribute.sh's check
refuses the same settings before any rank starts. Configs are the tiny YAML with overrides."""

import os

import pytest

from msllm.cluster.context import check_device_support
from msllm.cluster.launch_plan import check_entry_accepts
from msllm.config import load_config
from msllm.errors import MsllmError
from msllm.settings import NO_EFFECT, check_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")


def cfg(*overrides):
    return load_config(TINY, list(overrides))


def test_defaults_need_no_note():
    for mode in ("train", "finetune", "predict", "eval"):
        assert check_settings(cfg(), mode) == [], mode


@pytest.mark.parametrize("key", ["--parallel_config.optimizer_shard=True", "--parallel.enable_parallel_optimizer=True"])
def test_optimizer_sharding_in_data_parallel_mode_is_refused_for_training(key):
    with pytest.raises(MsllmError, match="semi_auto_parallel"):
        check_settings(cfg(key), "train")
    assert check_settings(cfg(key), "predict") == []  # nothing to shard when not training


def test_fp32_state_adamw_with_fp16_parameters_is_accepted_on_ascend_and_cpu_refuses_the_fp16_parameters():
    # msllm's AdamW keeps float32 moments for fp16 parameters (MindFormers' FP32StateAdamWeightDecay,
    # tests/training/test_adamw.py); CPU training refuses fp16 parameters themselves, in one message
    fp16 = ("--optimizer.type=FP32StateAdamWeightDecay", "--model.model_config.param_init_type=float16",
            "--model.model_config.compute_dtype=float16")
    assert check_settings(cfg(*fp16, "--context.device_target=Ascend"), "train") == []
    with pytest.raises(MsllmError, match="use float32 on CPU"):
        check_device_support(cfg(*fp16))
    assert check_settings(cfg("--optimizer.type=FP32StateAdamWeightDecay"), "train") == []


@pytest.mark.parametrize("key,value", [("parallel_config.gradient_aggregation_group", "8"),
                                       ("parallel.search_mode", "sharding_propagation"),
                                       ("eval_dataset.shuffle", "True"),
                                       ("eval_dataset.drop_remainder", "True"),
                                       ("eval_dataset.num_parallel_workers", "4"),
                                       ("eval_dataset.prefetch_size", "8")])
def test_keys_without_effect_are_named_when_set(key, value):
    assert key in NO_EFFECT
    notes = check_settings(cfg(f"--{key}={value}"), "train")
    assert len(notes) == 1 and notes[0].startswith(f"{key}=") and NO_EFFECT[key] in notes[0], notes


def test_eval_dataset_defaults_are_its_own():
    """eval_dataset's defaults (shuffle False, drop_remainder False) are not notes; train_dataset's
    values of the same keys are not either (they act)."""
    assert check_settings(cfg("--train_dataset.shuffle=False", "--train_dataset.drop_remainder=False"), "train") == []
    assert check_settings(cfg("--eval_dataset.shuffle=False"), "train") == []


def test_device_and_mode_notes():
    notes = check_settings(cfg("--runner_config.sink_size=4"), "train")
    assert notes == ["runner_config.sink_size=4 (used only with sink_mode: True)"]
    notes = check_settings(cfg("--runner_config.sink_mode=True"), "train")
    assert len(notes) == 1 and "no data sinking on CPU" in notes[0]
    notes = check_settings(cfg("--recompute_config.mp_comm_recompute=False"), "train")
    assert len(notes) == 1 and notes[0].startswith("recompute_config.mp_comm_recompute")
    notes = check_settings(cfg("--recompute_config.recompute=True"), "predict")
    assert len(notes) == 1 and "keeps no activations" in notes[0]
    notes = check_settings(cfg("--context.max_device_memory=58GB"), "train")
    assert notes == ["context.max_device_memory (Ascend/GPU device memory; CPU has none)"]


def test_strategy_file_setting_is_named_where_its_path_is_not_used():
    notes = check_settings(cfg("--parallel.strategy_ckpt_save_file=./my_strategy.ckpt"), "train")
    assert len(notes) == 1 and "no parallel strategy to save" in notes[0]
    # writing strategies: the extension picks the format, the path itself is not used
    notes = check_settings(cfg("--parallel.strategy_ckpt_save_file=/elsewhere/s.json", "--only_save_strategy=True"),
                           "train")
    assert len(notes) == 1 and "only its extension is used" in notes[0]
    assert check_settings(cfg("--parallel.strategy_ckpt_save_file=./ckpt_strategy.json", "--only_save_strategy=True"),
                          "train") == []


def test_predict_refuses_a_sharded_layout_and_eval_names_it():
    sharded = ("--parallel_config.model_parallel=2",)
    with pytest.raises(MsllmError, match="Predict on CPU is data parallel only"):
        check_settings(cfg(*sharded), "predict")
    notes = check_settings(cfg(*sharded), "eval")
    assert len(notes) == 1 and "evaluation runs data parallel only" in notes[0]


def test_the_launcher_refuses_what_the_entry_would_before_starting_ranks():
    with pytest.raises(MsllmError, match=r"run\.yaml: parallel_config asks for model_parallel=2.*Predict on CPU"):
        check_entry_accepts(cfg("--parallel_config.model_parallel=2", "--run_mode=predict"), "run.yaml", 2)
    with pytest.raises(MsllmError, match=r"run\.yaml: parallel_config.optimizer_shard"):
        check_entry_accepts(cfg("--parallel_config.optimizer_shard=True"), "run.yaml", 2)
    check_entry_accepts(cfg("--run_mode=eval", "--parallel_config.model_parallel=2"), "run.yaml", 2)  # a note only


def test_more_reader_workers_than_cores_are_clamped_and_named(alpaca_mindrecord):
    """MindFormers' YAMLs ask for 8 reader workers; MindDataset refuses more than the machine's
    cores with a traceback at the first epoch. msllm names the clamp at start and reads with as
    many workers as there are cores."""
    cores = os.cpu_count()
    many = cores + 6
    notes = check_settings(cfg(f"--train_dataset.num_parallel_workers={many}"), "train")
    assert notes == [f"train_dataset.num_parallel_workers={many} (this machine has {cores} CPU cores and "
                     f"MindDataset accepts 1..{cores}: {cores} are used)"]
    from msllm.data.dataset import build_train_data

    data = build_train_data(alpaca_mindrecord, 64, 4, True, True, 0, 1, num_parallel_workers=many)
    ids, labels = next(iter(data.epoch_batches(0)))
    assert tuple(ids.shape) == (4, 65) and tuple(labels.shape) == (4, 65)
