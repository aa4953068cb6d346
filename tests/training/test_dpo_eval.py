"""DPO's held-out evaluation (``do_eval``) and precomputed reference log-probs (``dpo.precompute_ref``)
through ``run_msllm.py``, in graph mode, on the tiny LLaMA (pairs from the bundled Alpaca data, the real LLaMA
tokenizer, vicuna_v1.1, as tests/training/test_dpo_run.py).

* The ``eval:`` line's numbers (kept in the run summary) equal a direct computation: each pair's summed
  completion log-probs from the model's logits in numpy float64 (the checkpoint saved at that step for the
  policy, the starting weights for the reference), then the module's formulas in float64.
* A run with ``dpo.precompute_ref`` (no reference model in the network) has the same step losses, metrics,
  updated parameters and held-out metrics as the run with the reference in the step (1e-6), and resumed after
  step 1 it recomputes the reference from the starting weights and ends where the uninterrupted run ends.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import DATA, REPO, TINY_YAML, TOKENIZER
from helpers.distributed import train_summary
from msllm.data.preference import preprocess_preference
from msllm.training import checkpoint as ckpt

# graph_mode (tests/conftest.py) sets the CPU device before this module's in-process MindSpore calls: MindSpore fixes
# the device at the first kernel, and the modules after this one set it again
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("graph_mode")]

SEQ, STEPS, SEED, BETA, FTX = 64, 2, 0, 0.1, 0.1
ARGS = [f"--model.model_config.seq_length={SEQ}", "--model.model_config.hidden_size=64",
        "--model.model_config.num_layers=2", "--model.model_config.num_heads=2", "--model.model_config.n_kv_heads=1",
        f"--runner_config.train_steps={STEPS}", "--callbacks.loss_monitor.per_print_times=1", "--deterministic=True",
        "--lr_schedule.learning_rate=1e-3", "--lr_schedule.warmup_ratio=0.0", f"--seed={SEED}",
        "--train_dataset.shuffle=False", f"--dpo.beta={BETA}", f"--dpo.ftx={FTX}", "--runner_config.batch_size=2",
        "--parallel_config.data_parallel=1", "--callbacks.checkpoint.save_checkpoint_steps=1",
        "--callbacks.checkpoint.keep_checkpoint_max=5", "--do_eval=True", "--eval_step_interval=1",
        "--eval_dataset.batch_size=2"]


def alpaca_pairs(path, first, n):
    """n pairs: record k's answer chosen, record k+1's rejected (short, input-free Alpaca records)."""
    with open(os.path.join(DATA, "alpaca_en_demo.json"), encoding="utf-8") as fh:
        recs = [r for r in json.load(fh) if not r.get("input") and len(r["instruction"]) + len(r["output"]) < 120]
    recs = recs[first:first + n + 1]
    path.write_text("\n".join(json.dumps({"instruction": a["instruction"], "chosen": a["output"],
                                          "rejected": b["output"]}) for a, b in zip(recs, recs[1:])) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import mindspore as ms

    from msllm.config import load_config
    from msllm.formats.manifest import write_sidecar
    from msllm.models.llama.model import LlamaForCausalLM

    d = tmp_path_factory.mktemp("dpo_eval")
    alpaca_pairs(d / "train.jsonl", 0, 4)
    alpaca_pairs(d / "held.jsonl", 10, 3)     # 3 held-out pairs: the eval's last batch is a partial one
    train, held = str(d / "train.mindrecord"), str(d / "held.mindrecord")
    assert preprocess_preference(str(d / "train.jsonl"), TOKENIZER, SEQ, train, shuffle=False)["pairs_written"] == 4
    assert preprocess_preference(str(d / "held.jsonl"), TOKENIZER, SEQ, held, shuffle=False)["pairs_written"] == 3
    print("seed", SEED)
    ms.set_seed(SEED)
    mc = load_config(TINY_YAML, ARGS).model_config
    base = str(d / "base.ckpt")
    ms.save_checkpoint(LlamaForCausalLM(mc), base)
    write_sidecar(base, mc)
    return train, held, base


def run(out, data, *extra, start=True):
    """run_msllm.py finetune on the pairs (from the base weights unless ``start`` is False: a resume, whose
    reference then comes from the checkpoint's manifest)."""
    train, held, base = data
    r = subprocess.run([sys.executable, os.path.join(REPO, "run_msllm.py"), "--config", TINY_YAML, "--run_mode",
                        "finetune", f"--train_dataset_dir={train}", f"--eval_dataset_dir={held}",
                        *([f"--load_checkpoint={base}"] if start else []), *ARGS, *extra, f"--output_dir={out}"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr + r.stdout


@pytest.fixture(scope="module")
def in_step(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("in_step") / "out"
    return out, run(out, data)


@pytest.fixture(scope="module")
def precomputed(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("precomputed") / "out"
    return out, run(out, data, "--dpo.precompute_ref=True")


def checkpoints(out):
    return ckpt.list_checkpoints(str(out / "checkpoint" / "rank_0"))


def params_of(path):
    return {k: v.asnumpy() for k, v in ckpt.load_params(path).items() if not k.startswith(("epoch_num", "step_num"))}


def logps_float64(weights, ids, labels):
    """(N, 2) summed completion log-probs of pairs ids/labels (N, 2, L), from the logits of the tiny model
    holding ``weights``, log-softmax in numpy float64; and the (N, 2) completion counts."""
    import mindspore as ms

    from msllm.config import load_config
    from msllm.models.llama.model import LlamaForCausalLM

    model = LlamaForCausalLM(load_config(TINY_YAML, ARGS).model_config)
    ms.load_param_into_net(model, {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in params_of(weights).items()
                                   if not k.startswith(("adam_", "reference."))})
    n, _, length = ids.shape
    tokens, targets = ids[:, :, :-1].reshape(2 * n, length - 1), labels[:, :, 1:].reshape(2 * n, length - 1)
    z = model.logits_of(model.model(ms.Tensor(tokens))).asnumpy().astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    mask = targets != -100
    picked = np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0] * mask
    return picked.sum(-1).reshape(n, 2), mask.sum(-1).reshape(n, 2).astype(np.float64)


def expected_eval(policy, reference, held):
    """The held-out loss (sigmoid, ftx) and TRL's eval metrics in float64 from the formulas of msllm.training.dpo."""
    from msllm.training.dpo_values import read_pairs

    ids, labels = read_pairs(held, SEQ)
    lp, n = logps_float64(policy, ids, labels)
    ref, _ = logps_float64(reference, ids, labels)
    rc, rr = BETA * (lp[:, 0] - ref[:, 0]), BETA * (lp[:, 1] - ref[:, 1])
    loss = np.mean(np.logaddexp(0.0, -(rc - rr))) + FTX * np.mean(-lp[:, 0] / n[:, 0])
    return {"loss": loss, "eval_rewards/chosen": rc.mean(), "eval_rewards/rejected": rr.mean(),
            "eval_rewards/margins": (rc - rr).mean(), "eval_rewards/accuracies": (rc > rr).mean(),
            "eval_logps/chosen": lp[:, 0].mean(), "eval_logps/rejected": lp[:, 1].mean()}


def test_eval_metrics_equal_a_float64_computation_from_the_saved_weights(data, in_step):
    out, text = in_step
    _, held, base = data
    evals = train_summary(out, 0)["eval"]
    assert [e["step"] for e in evals] == [1, 2] and all(e["pairs"] == 3 for e in evals)
    lines = [ln for ln in text.splitlines() if "eval: step" in ln]
    assert len(lines) == 2 and "eval_rewards/margins: " in lines[0] and "3 pairs" in lines[0]
    for e, path in zip(evals, checkpoints(out)):
        assert path.endswith(f"_{e['step']}.ckpt")
        want = expected_eval(path, base, held)
        got = {"loss": e["loss"], **e["metrics"]}
        assert got.keys() == want.keys()
        for k in want:
            assert abs(got[k] - want[k]) <= 2e-4 * max(1.0, abs(want[k])), (e["step"], k, got[k], want[k])
        # the logged line carries the same numbers (4 decimals)
        line = lines[e["step"] - 1]
        assert float(re.search(r"eval_loss (-?\d+\.\d+)", line).group(1)) == pytest.approx(e["loss"], abs=1e-4)
    # training on different pairs moves the held-out margin away from 0 (policy = reference before step 1)
    assert evals[0]["metrics"]["eval_rewards/margins"] != 0.0


def test_precomputed_reference_run_equals_the_in_step_reference_run(in_step, precomputed):
    (a, _), (b, text) = in_step, precomputed
    assert "precomputed once before the first step with the starting weights" in text
    assert "dpo.precompute_ref: reference log-probs of 4 training and 3 held-out pairs" in text
    sa, sb = train_summary(a, 0), train_summary(b, 0)
    assert sa["steps"] == sb["steps"] == STEPS
    for k in range(STEPS):
        assert abs(sa["losses"][k] - sb["losses"][k]) <= 1e-6, k
        for name, v in sa["metrics"][k].items():
            assert abs(sb["metrics"][k][name] - v) <= 1e-6, (k, name)
    for ea, eb in zip(sa["eval"], sb["eval"]):
        assert abs(ea["loss"] - eb["loss"]) <= 1e-6
        for name, v in ea["metrics"].items():
            assert abs(eb["metrics"][name] - v) <= 1e-6, (ea["step"], name)
    for pa, pb in zip(checkpoints(a), checkpoints(b)):   # the updates after steps 1 and 2
        wa, wb = params_of(pa), params_of(pb)
        assert wa.keys() == wb.keys() and not any(k.startswith("reference.") for k in wb)
        for k in wa:
            np.testing.assert_allclose(wb[k], wa[k], atol=1e-6, rtol=0, err_msg=k)


def test_precompute_ref_network_holds_no_reference_parameters():
    from types import SimpleNamespace

    from msllm.config import load_config
    from msllm.models.llama.model import LlamaForCausalLM
    from msllm.training.dpo import DPOPrecomputedNetwork, build_dpo_network

    mc = load_config(TINY_YAML, ARGS).model_config
    cfg = SimpleNamespace(beta=BETA, loss_type="sigmoid", label_smoothing=0.0, ftx=0.0, precompute_ref=True)
    net = build_dpo_network(LlamaForCausalLM(mc), cfg, lora=False, fast_paths=True, device="CPU")
    assert isinstance(net, DPOPrecomputedNetwork) and net.ref_logps is None
    names = [p.name for p in net.get_parameters()]
    assert names and not any(n.startswith("reference.") for n in names)
    cfg.precompute_ref = False   # the negative control: the in-step reference holds its frozen copies
    names = [p.name for p in build_dpo_network(LlamaForCausalLM(mc), cfg, False, True, "CPU").get_parameters()]
    assert sum(n.startswith("reference.") for n in names) == len(names) // 2


def test_precompute_ref_resume_uses_the_starting_weights(data, precomputed, tmp_path):
    b, _ = precomputed
    out = tmp_path / "out"
    shutil.copytree(b / "checkpoint", out / "checkpoint")
    last = checkpoints(b)[-1]
    for suffix in ("", ".json"):   # as if stopped after step 1
        os.unlink(str(out / "checkpoint" / "rank_0" / os.path.basename(last)) + suffix)
    text = run(out, data, "--dpo.precompute_ref=True", "--resume_training=True", start=False)
    assert "dpo.precompute_ref: reference log-probs of 4 training" in text
    s = train_summary(out, 0)
    assert s["start_step"] == 1 and s["steps"] == 1
    assert abs(s["losses"][0] - train_summary(b, 0)["losses"][1]) <= 1e-6
    assert abs(s["eval"][0]["metrics"]["eval_rewards/margins"]
               - train_summary(b, 0)["eval"][1]["metrics"]["eval_rewards/margins"]) <= 1e-6
    want, got = params_of(last), params_of(checkpoints(out)[-1])
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)


def test_lora_precomputed_reference_equals_the_shared_base_in_the_step(data, tmp_path):
    """LoRA: the precomputed reference (the base without adapters, before step 1) gives the in-step run's losses,
    metrics, held-out metrics and adapters (1e-6)."""
    pet = ["--pet_config.pet_type=lora", "--pet_config.lora_rank=4", "--pet_config.lora_alpha=8",
           "--pet_config.target_modules=.*wq|.*wv"]
    a, b = tmp_path / "in_step", tmp_path / "precomputed"
    run(a, data, *pet)
    text = run(b, data, *pet, "--dpo.precompute_ref=True")
    assert "precomputed once before the first step with the base without adapters" in text
    sa, sb = train_summary(a, 0), train_summary(b, 0)
    assert sa["metrics"][1]["rewards/margins"] != 0.0    # the adapters moved the policy off the reference
    for k in range(STEPS):
        assert abs(sa["losses"][k] - sb["losses"][k]) <= 1e-6, k
        for name, v in sa["metrics"][k].items():
            assert abs(sb["metrics"][k][name] - v) <= 1e-6, (k, name)
    for ea, eb in zip(sa["eval"], sb["eval"]):
        for name, v in ea["metrics"].items():
            assert abs(eb["metrics"][name] - v) <= 1e-6, (ea["step"], name)
    wa, wb = params_of(checkpoints(a)[-1]), params_of(checkpoints(b)[-1])
    assert wa.keys() == wb.keys() and any(".lora_B." in k for k in wa)
    for k in wa:
        np.testing.assert_allclose(wb[k], wa[k], atol=1e-6, rtol=0, err_msg=k)
