"""A checkpoint written by msllm's trainer (a short real run on the bundled Alpaca data) exports
to an HF directory that transformers loads, with the same logits as msllm, and converts back to
the trained weights bit for bit."""

import os
import subprocess
import sys

import numpy as np
import pytest

from msllm.convert import hf
from msllm.data.tokenizer import load_tokenizer
from msllm.training import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "convert_weight.py")
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
EX = os.path.join(ROOT, "examples", "data")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(output_dir, last checkpoint) of 3 training steps of the tiny config at seq_length 64."""
    from msllm.data.conversation import convert_alpaca_file
    from msllm.data.preprocess import preprocess_to_mindrecord

    d = tmp_path_factory.mktemp("trained")
    convert_alpaca_file(os.path.join(EX, "alpaca_en_demo.json"), str(d / "conv.json"))
    data = str(d / "alpaca_64.mindrecord")
    preprocess_to_mindrecord(str(d / "conv.json"), "qa", os.path.join(EX, "tokenizer.model"), 64, data, progress=False)
    env = dict(os.environ, GLOG_v="3")
    for k in ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE"):
        env.pop(k, None)
    out = d / "run"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), "--config", TINY,
                        "--parallel_config.data_parallel=1", "--runner_config.train_steps=3",
                        "--model.model_config.seq_length=64", "--train_dataset_dir", data, "--output_dir", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    found = ckpt.list_checkpoints(str(out / "checkpoint" / "rank_0"))
    assert found, os.listdir(out)
    return out, found[-1]


@pytest.mark.slow
def test_trained_checkpoint_exports_to_hf_with_logits_parity(trained, tmp_path):
    from msllm.convert.verify import check_parity

    out, last = trained
    names = set(hf.scan_ckpt(last))
    assert {"adam_m.lm_head.weight", "global_step", "loss_scale", "step_num"} <= names  # trainer entries
    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, TOOL, "--reversed", "--mindspore_ckpt_path", last, "--torch_ckpt_dir",
                        str(hf_dir), "--max_shard_size", "10MB", "--no_progress"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, GLOG_v="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(os.listdir(hf_dir))
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert sum(f.endswith(".safetensors") for f in files) == 3  # 35.7 MB in <= 10 MB shards (+ a 16 MB one)
    # the data's tokenizer (recorded in the checkpoint's manifest) is written beside the weights, and
    # transformers' AutoTokenizer reads it as the LLaMA tokenizer it is
    assert "tokenizer.model" in files
    import transformers

    text = "Give three tips for staying healthy. Ça va? 123"
    sp = load_tokenizer(os.path.join(EX, "tokenizer.model"))
    assert transformers.AutoTokenizer.from_pretrained(str(hf_dir))(text)["input_ids"] == [sp.bos_id] + sp.encode(text)

    cfg = hf.msllm_model_config(last, None)  # from the manifest the trainer wrote
    report = check_parity(cfg, last, hf_dir=str(hf_dir), n_new=3)  # transformers.from_pretrained(hf_dir)
    print("\n".join(report.lines()))
    assert report.max_abs_diff < 1e-4 and report.hf_next == report.msllm_next
    assert report.max_abs_diff < 1e-3 * report.reference_std  # small against the logits' own spread

    # and back: HF -> msllm gives the trained weights bit for bit
    back = str(tmp_path / "back.ckpt")
    hf.convert_hf_to_msllm(str(hf_dir), back, progress=False)
    trained_w = hf.read_msllm_tensors(last)
    for name, (data, dtype) in hf.read_msllm_tensors(back).items():
        assert dtype == trained_w[name][1] == "float32"
        np.testing.assert_array_equal(data, trained_w[name][0], err_msg=name)
