"""DPO through the ordinary entry points, in graph mode, on the tiny LLaMA (the numbers against TRL on the real
model are tests/training/test_dpo_trl.py): pairs preprocessed with the real LLaMA tokenizer (MindSpeed-LLM's
string records, vicuna_v1.1), trained by ``scripts/run_distribute.sh`` on 2 data-parallel ranks (2 pairs each)
and by ``run_msllm.py`` in one process on the whole batch (4 pairs): every step's loss (mean of the ranks'
losses) and every parameter at the end agree (float32 all-reduce order: 1e-5); each step line carries TRL's
metric names; the checkpoint holds no reference copies; a run resumed after step 1 rebuilds its reference from the
manifest and ends where the uninterrupted run ends; with LoRA the reference is the shared base and the
checkpoint holds the adapters only."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import DATA, REPO, TINY_YAML, TOKENIZER
from helpers.distributed import rank_log, run_two_ranks, successful_run, train_summary, two_rank_table
from msllm.data.preference import preprocess_preference
from msllm.training import checkpoint as ckpt

pytestmark = pytest.mark.slow

SEQ, STEPS, SEED = 256, 2, 0   # 256: the pairs (65-128 tokens) are cut to 128 (msllm.training.dpo.cut_pair_batch)
ARGS = [f"--model.model_config.seq_length={SEQ}", "--model.model_config.hidden_size=64",
        "--model.model_config.num_layers=2", "--model.model_config.num_heads=2", "--model.model_config.n_kv_heads=1",
        f"--runner_config.train_steps={STEPS}", "--callbacks.loss_monitor.per_print_times=1", "--deterministic=True",
        "--lr_schedule.learning_rate=1e-3", "--lr_schedule.warmup_ratio=0.0", f"--seed={SEED}",
        "--train_dataset.shuffle=False", "--dpo.beta=0.1", "--dpo.ftx=0.1",
        "--callbacks.checkpoint.save_checkpoint_steps=1", "--callbacks.checkpoint.keep_checkpoint_max=5"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    with open(os.path.join(DATA, "alpaca_en_demo.json"), encoding="utf-8") as fh:
        recs = [r for r in json.load(fh) if not r.get("input") and len(r["instruction"]) + len(r["output"]) < 120][:5]
    d = tmp_path_factory.mktemp("dpo_run")
    src = d / "pairs.jsonl"
    src.write_text("\n".join(json.dumps({"instruction": a["instruction"], "chosen": a["output"],
                                         "rejected": b["output"]}) for a, b in zip(recs, recs[1:])) + "\n")
    out = str(d / "pairs.mindrecord")
    assert preprocess_preference(str(src), TOKENIZER, SEQ, out, shuffle=False)["pairs_written"] == 4
    return out, two_rank_table(d), base_checkpoint(str(d / "base.ckpt"))


def base_checkpoint(path: str) -> str:
    """The starting weights (DPO fine-tunes a model): the tiny model of ARGS, seeded, saved with its manifest."""
    import mindspore as ms

    from msllm.config import load_config
    from msllm.formats.manifest import write_sidecar
    from msllm.models.llama.model import LlamaForCausalLM

    ms.set_seed(SEED)
    mc = load_config(TINY_YAML, ARGS).model_config
    net = LlamaForCausalLM(mc)
    ms.save_checkpoint(net, path)
    write_sidecar(path, mc)
    return path


def params_of(path):
    return {k: v.asnumpy() for k, v in ckpt.load_params(path).items() if not k.startswith(("epoch_num", "step_num"))}


def last_checkpoint(out, rank=0):
    return ckpt.list_checkpoints(str(out / "checkpoint" / f"rank_{rank}"))[-1]


@pytest.fixture(scope="module")
def two_ranks(pairs, tmp_path_factory):
    data, table, base = pairs
    args = [f"--train_dataset_dir={data}", "--runner_config.batch_size=2", f"--load_checkpoint={base}", *ARGS]
    return successful_run(tmp_path_factory.mktemp("dp2") / "out",
                          lambda out: run_two_ranks(table, TINY_YAML, "finetune", out, args, timeout=900))


@pytest.fixture(scope="module")
def one_rank(pairs, tmp_path_factory):
    data, _, base = pairs
    out = tmp_path_factory.mktemp("dp1") / "out"
    r = subprocess.run([sys.executable, os.path.join(REPO, "run_msllm.py"), "--config", TINY_YAML, "--run_mode",
                        "finetune", f"--train_dataset_dir={data}", "--runner_config.batch_size=4",
                        "--parallel_config.data_parallel=1", f"--load_checkpoint={base}", *ARGS,
                        f"--output_dir={out}"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stderr + r.stdout


def test_two_ranks_equal_one_rank_on_the_whole_batch(two_ranks, one_rank):
    one, _ = one_rank
    s0, s1, s = train_summary(two_ranks, 0), train_summary(two_ranks, 1), train_summary(one, 0)
    assert s0["steps"] == s["steps"] == STEPS and s0["world_size"] == 2
    assert s0["losses"][0] != s1["losses"][0]           # the ranks read different pairs
    for k in range(STEPS):                                # equal batch halves: the mean of the means
        assert abs((s0["losses"][k] + s1["losses"][k]) / 2 - s["losses"][k]) <= 1e-5, k
    p2, p1 = params_of(last_checkpoint(two_ranks)), params_of(last_checkpoint(one))
    assert p2.keys() == p1.keys() and not any(k.startswith("reference.") for k in p1)
    moved = max(float(np.abs(p1[k] - p2[k]).max()) for k in p1)
    assert moved <= 1e-5, moved


def test_step_lines_carry_trls_metric_names(two_ranks, one_rank):
    _, text = one_rank
    lines = [ln for ln in rank_log(two_ranks, 0).splitlines() if "step:[" in ln]
    assert len(lines) == STEPS
    for ln in lines:
        for name in METRICS:
            assert re.search(re.escape(name) + r": -?\d+\.\d{4}", ln), (name, ln)
    assert "dpo: loss sigmoid, beta 0.1" in text and "frozen copy of the starting weights" in text
    first = train_summary(one_rank[0], 0)["metrics"][0]
    assert first["rewards/chosen"] == 0.0 and first["rewards/margins"] == 0.0   # policy = reference at step 1


def test_resume_from_step_1_ends_where_the_uninterrupted_run_ends(pairs, one_rank, tmp_path):
    import shutil

    data, _, base = pairs
    one, _ = one_rank
    out = tmp_path / "out"
    shutil.copytree(one / "checkpoint", out / "checkpoint")
    last = last_checkpoint(one)
    for suffix in ("", ".json"):   # as if stopped after step 1
        os.unlink(str(out / "checkpoint" / "rank_0" / os.path.basename(last)) + suffix)
    # load_checkpoint empty: resume looks in output_dir/checkpoint; the reference comes from the manifest
    r = subprocess.run([sys.executable, os.path.join(REPO, "run_msllm.py"), "--config", TINY_YAML, "--run_mode",
                        "finetune", f"--train_dataset_dir={data}", "--runner_config.batch_size=4",
                        "--parallel_config.data_parallel=1", *ARGS, f"--output_dir={out}", "--resume_training=True"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = train_summary(out, 0)
    assert s["start_step"] == 1 and s["steps"] == 1
    assert abs(s["losses"][0] - train_summary(one, 0)["losses"][1]) <= 1e-6
    manifest = json.loads(open(last_checkpoint(out) + ".json").read())
    assert manifest["dpo_reference"] == os.path.abspath(base)
    want, got = params_of(last), params_of(last_checkpoint(out))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)


def test_lora_dpo_trains_adapters_only_against_the_shared_base(pairs, tmp_path):
    data, _, base = pairs
    out = tmp_path / "out"
    pet = ["--model.model_config.pet_config.pet_type=lora", "--model.model_config.pet_config.lora_rank=4",
           "--model.model_config.pet_config.lora_alpha=8", "--model.model_config.pet_config.target_modules=.*wq|.*wv"]
    r = subprocess.run([sys.executable, os.path.join(REPO, "run_msllm.py"), "--config", TINY_YAML, "--run_mode",
                        "finetune", f"--train_dataset_dir={data}", "--runner_config.batch_size=4",
                        "--parallel_config.data_parallel=1", f"--load_checkpoint={base}", *ARGS, *pet,
                        f"--output_dir={out}"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reference = the base without adapters (shared weights)" in r.stderr + r.stdout
    s = train_summary(out, 0)
    assert s["steps"] == STEPS and s["metrics"][0]["rewards/margins"] == 0.0 and s["metrics"][1]["rewards/margins"] != 0
    saved = params_of(last_checkpoint(out))
    counters = ("adam_", "global_step", "beta", "learning_rate", "loss_scale", "current_iterator_step",
                "last_overflow_iterator_step")   # optimizer and loss-scale state
    weights = [k for k in saved if not k.startswith(counters)]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), [k for k in weights if "lora_" not in k]
