"""Fine-tuning the real SmolLM2-135M-Instruct straight from its Hugging Face directory
(``--load_checkpoint HF_DIR``, configs/smollm2/run_smollm2_135m.yaml), and getting the result back
to the Hugging Face ecosystem:

1. LoRA through scripts/run_distribute.sh on 2 data-parallel CPU ranks -> the adapter exported with
   ``tools/convert_weight.py --reversed --lora`` loads with ``peft.PeftModel.from_pretrained`` on
   the transformers model of the same directory and gives msllm's logits (base + adapter);
2. a full fine-tune -> ``tools/convert_weight.py --reversed`` -> an HF directory (tied embeddings
   as transformers expects) that ``AutoModelForCausalLM.from_pretrained`` loads with msllm's logits;
3. a MindRecord tokenized with another tokenizer (the bundled LLaMA one) is refused before any step.

All runs are 2 steps at seq_length 64, batch 1 per rank, on the one MindRecord preprocessed from
the bundled Alpaca samples with the directory's own tokenizer and chat template.

Tolerance (``TOL`` = 3e-4, max |logit diff|): SmolLM2's logits reach |38| after 30 layers, and two
float32 implementations differ there by ~1.3e-4 (measured: transformers float32 vs transformers
float64 8.1e-5, msllm float32 vs float64 8.6e-5; msllm vs transformers 1.17e-4 (full) / 1.29e-4
(LoRA), ~3e-6 relative). 1e-4 is below that float32 noise floor; 3e-4 keeps a ~2x margin and is
far below what the fine-tunes change (max 6.5 LoRA, 17 full) or what a wrong export would show
(lora_alpha 9 instead of 8 in adapter_config.json: 0.69).
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, context_mode
from helpers.distributed import rank_log, run_two_ranks, successful_run, train_summary, two_rank_table
from lora_helpers import alpaca_rows, logits

torch = pytest.importorskip("torch")  # test references only; installed in CI (setup.py extras "dev")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

YAML = os.path.join(REPO, "configs", "smollm2", "run_smollm2_135m.yaml")
RUN = os.path.join(REPO, "run_msllm.py")
CONVERT = os.path.join(REPO, "tools", "convert_weight.py")
TOL = 3e-4       # see the module docstring
N_ROWS, T = 3, 64
SHORT = ["--model.model_config.seq_length=64", "--runner_config.batch_size=1", "--runner_config.train_steps=2",
         "--callbacks.loss_monitor.per_print_times=1"]
PET = ["--model.model_config.pet_config.pet_type=lora", "--model.model_config.pet_config.lora_rank=4",
       "--model.model_config.pet_config.lora_alpha=8", "--model.model_config.pet_config.lora_dropout=0.0",
       "--model.model_config.pet_config.target_modules=.*wq|.*wv"]
# a larger learning rate than the YAML's so that 2 steps move the adapters visibly
LORA = [*PET, "--lr_schedule.learning_rate=5e-3", "--lr_schedule.warmup_ratio=0.0"]


def run(cmd, cwd, timeout=900, **env):
    return subprocess.run([sys.executable, *cmd], cwd=str(cwd), capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, GLOG_v="3", **env))


@pytest.fixture(scope="module", autouse=True)
def pynative():
    """The in-process msllm forwards run in PYNATIVE_MODE (no compile); the runs are subprocesses."""
    yield from context_mode("pynative")


@pytest.fixture(scope="module")
def smollm2_data(tmp_path_factory, smollm2_dir, alpaca_path):
    """The bundled Alpaca samples through the user's two commands: alpaca_converter.py, then
    llama_preprocess.py with the HF directory as --model_file (its tokenizer.json and chat template)."""
    d = tmp_path_factory.mktemp("smollm2_data")
    r = run([os.path.join(REPO, "data_preprocess", "alpaca_converter.py"), "--data_path", alpaca_path,
             "--output_path", "conv.json"], d)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run([os.path.join(REPO, "data_preprocess", "llama_preprocess.py"), "--input_glob", "conv.json",
             "--dataset_type", "qa", "--model_file", smollm2_dir, "--seq_length", "64", "--output_file",
             "sm.mindrecord", "--no_progress", "--samples_num", "16"], d)
    assert r.returncode == 0, r.stderr[-2000:]
    out = str(d / "sm.mindrecord")
    with open(out + ".json") as fh:
        meta = json.load(fh)
    assert meta["tokenizer_file"] == os.path.join(smollm2_dir, "tokenizer.json")
    assert meta["num_samples"] >= 4  # 2 ranks x 2 steps x batch 1
    return out


@pytest.fixture(scope="module")
def rows(smollm2_data):
    """(3, 64) real token rows of the MindRecord (chat-template-formatted Alpaca turns)."""
    ids, _ = alpaca_rows(smollm2_data, N_ROWS)
    return ids[:, :T]


def torch_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids).long()).logits.numpy()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def msllm_logits(config, ids, overrides=(), adapter=None):
    """Logits of msllm's model loaded for inference as predict/chat do (``load_for_inference``)."""
    from msllm.config import load_config
    from msllm.generation.loading import load_for_inference

    net, _, _ = load_for_inference(load_config(config, list(overrides)), adapter=adapter)
    return logits(net, ids)


# ---------------------------------------------------------------------------------------------
# 3. data of another tokenizer is refused (first: it takes seconds)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_data_of_another_tokenizer_is_refused_before_any_step(smollm2_dir, alpaca_mindrecord, tmp_path, kind):
    from helpers import TOKENIZER

    out = tmp_path / "out"
    r = run([RUN, "--config", YAML, "--run_mode", "finetune", "--load_checkpoint", smollm2_dir,
             "--train_dataset_dir", alpaca_mindrecord, "--output_dir", str(out), *SHORT,
             *(PET if kind == "lora" else [])], tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    err = errors[0]
    assert alpaca_mindrecord in err  # the data file
    assert TOKENIZER in err and os.path.join(smollm2_dir, "tokenizer.json") in err  # both tokenizers
    assert f"--model_file {smollm2_dir}" in err  # what to do
    assert "Traceback" not in r.stderr
    assert not (out / "checkpoint").exists()  # no step ran, nothing saved


# ---------------------------------------------------------------------------------------------
# 1. LoRA on 2 data-parallel ranks -> PEFT


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, smollm2_dir, smollm2_data):
    d = tmp_path_factory.mktemp("smollm2_lora")
    table = two_rank_table(d)
    # the YAML has data_parallel: 1; the launcher refuses a layout of another size than RANK_SIZE
    args = [f"--load_checkpoint={smollm2_dir}", f"--train_dataset_dir={smollm2_data}", *SHORT, *LORA,
            "--parallel_config.data_parallel=2"]
    out = successful_run(d / "out", lambda o: run_two_ranks(table, YAML, "finetune", o, args, timeout=1500))
    yield out
    shutil.rmtree(d, ignore_errors=True)


def test_lora_on_two_ranks_exports_to_peft_with_msllm_logits(lora_run, smollm2_dir, rows, tmp_path):
    import mindspore as ms

    from msllm.lora.targets import is_adapter_param

    out = lora_run
    adapters = [train_summary(out, r)["checkpoints"][-1] for r in (0, 1)]
    for r in (0, 1):
        assert train_summary(out, r)["steps"] == 2, rank_log(out, r)[-2000:]
    assert "LoRA: " in rank_log(out, 0) and "60 module(s)" in rank_log(out, 0)  # 30 layers x q, v
    a, b = (ms.load_checkpoint(p) for p in adapters)
    names = sorted(k for k in a if is_adapter_param(k))
    assert len(names) == 2 * 60
    for k in names:  # data parallel: both ranks end with the same adapter
        np.testing.assert_array_equal(a[k].asnumpy(), b[k].asnumpy(), err_msg=k)
    adapter = adapters[0]

    peft_dir = tmp_path / "peft"
    r = run([CONVERT, "--reversed", "--lora", adapter, "--torch_ckpt_dir", str(peft_dir)], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == os.path.abspath(smollm2_dir)

    pm = peft.PeftModel.from_pretrained(hf_model(smollm2_dir), str(peft_dir)).eval()
    ref = torch_logits(pm, rows)
    with pm.disable_adapter():
        plain = torch_logits(pm, rows)  # the transformers base model
    del pm
    got = msllm_logits(YAML, rows, [f"--load_checkpoint={smollm2_dir}", "--model.model_config.seq_length=64"],
                       adapter=adapter)
    diff, effect = np.abs(ref - got).max(), np.abs(got - plain).max()
    print(f"LoRA: max |PEFT - msllm| {diff:.3e}, adapter effect {effect:.3f}, max |logit| {np.abs(ref).max():.1f}")
    assert effect > 0.1    # the fine-tuned adapter changes the model ...
    assert diff <= TOL     # ... and PEFT computes msllm's base + adapter


# ---------------------------------------------------------------------------------------------
# 2. full fine-tune -> HF directory


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, smollm2_dir, smollm2_data):
    """One process; PYNATIVE_MODE (--context.mode=1): the same checkpoint format, without the ~5 min
    GRAPH_MODE compile of the full backward pass on this CPU (LoRA above runs the YAML's GRAPH_MODE)."""
    d = tmp_path_factory.mktemp("smollm2_full")
    r = run([RUN, "--config", YAML, "--run_mode", "finetune", "--load_checkpoint", smollm2_dir,
             "--train_dataset_dir", smollm2_data, "--output_dir", str(d / "out"), *SHORT, "--context.mode=1"],
            d, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    yield d / "out"
    shutil.rmtree(d, ignore_errors=True)  # 1.6 GB of weights and AdamW moments


def test_full_finetune_converts_to_hf_with_msllm_logits(full_run, smollm2_dir, rows, tmp_path):
    from safetensors import safe_open

    summary = train_summary(full_run, 0)
    assert summary["steps"] == 2
    ckpt = summary["checkpoints"][-1]
    hf_dir = tmp_path / "hf"
    r = run([CONVERT, "--reversed", "--mindspore_ckpt_path", ckpt, "--torch_ckpt_dir", str(hf_dir), "--no_progress"],
            tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    # the tokenizer the training data was built with (recorded in the manifest) is written beside the
    # weights, and the configs carry its token ids, as the original directory does
    assert sorted(os.listdir(hf_dir)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                          "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((hf_dir / "config.json").read_text())
    original = json.loads(open(os.path.join(smollm2_dir, "config.json")).read())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == original[key], key
    text = "Fine-tuned 模型 answers 🙂"
    assert (transformers.AutoTokenizer.from_pretrained(str(hf_dir)).apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False) ==
        transformers.AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False))
    with safe_open(str(hf_dir / "model.safetensors"), "np") as f, \
            safe_open(os.path.join(smollm2_dir, "model.safetensors"), "np") as g:
        keys = set(f.keys())
        assert keys == set(g.keys())  # the original's names; tied: no lm_head.weight, as HF writes it
        assert "lm_head.weight" not in keys
        unchanged = [k for k in keys if np.array_equal(f.get_tensor(k), g.get_tensor(k))]
    assert not unchanged  # every weight was trained

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    ref = torch_logits(model.eval(), rows)
    del model
    orig = torch_logits(hf_model(smollm2_dir), rows)
    # the model of the run's resolved config (the HF directory's shape; the YAML alone has none)
    got = msllm_logits(str(full_run / "msllm_config.yaml"), rows, [f"--load_checkpoint={ckpt}"])
    diff, effect = np.abs(ref - got).max(), np.abs(ref - orig).max()
    print(f"full: max |transformers - msllm| {diff:.3e}, fine-tune effect {effect:.3f}")
    assert effect > 0.1    # the fine-tune changed the model ...
    assert diff <= TOL     # ... and transformers computes msllm's model from the converted directory
