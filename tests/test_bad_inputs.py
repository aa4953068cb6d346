"""The bad-input corpus (tests/bad_inputs/ plus inputs built here): every command answers each
with one clear error line naming the file / record / key and what was expected, a non-zero
exit, no traceback, and no output left behind."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = os.path.join(ROOT, "tests", "bad_inputs")
EX = os.path.join(ROOT, "examples", "data")
TINY = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
PY = sys.executable


def run(cmd, cwd, env_extra=None, preexec_fn=None):
    env = dict(os.environ, GLOG_v="3", **(env_extra or {}))
    for k in ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE", "MSLLM_OUTPUT_DIR"):
        env.pop(k, None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=preexec_fn)


def assert_one_clear_error(r, *fragments):
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    for f in fragments:
        assert f in errors[0], errors[0]


CONVERTER_CASES = [
    ("malformed.json", ["malformed.json", "line 3"]),
    ("truncated.json", ["truncated.json", "invalid JSON", "truncated"]),
    ("empty.json", ["empty.json", "empty"]),
    ("not_a_list.json", ["not_a_list.json", "list"]),
    ("record_not_object.json", ["record_not_object.json", "record 1"]),
    ("missing_output.json", ["missing_output.json", "record 0", "output"]),
    ("missing_instruction.json", ["missing_instruction.json", "record 0", "instruction"]),
    ("nonstring_instruction.json", ["nonstring_instruction.json", "record 1", "instruction"]),
    ("nonstring_input.json", ["nonstring_input.json", "record 0", "input"]),
]


@pytest.mark.parametrize("name,fragments", CONVERTER_CASES)
def test_alpaca_converter_bad_input(tmp_path, name, fragments):
    out = tmp_path / "out.json"
    r = run([PY, "data_preprocess/alpaca_converter.py", "--data_path", os.path.join(BAD, name),
             "--output_path", str(out)], ROOT)
    assert_one_clear_error(r, *fragments)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name,input_name,fragments", [
    ("conversation_nonstring_value.json", None, ["conversation_nonstring_value.json", "value"]),
    ("conversation_not_list.json", None, ["conversation_not_list.json", "conversations"]),
    ("tokenizer", "not_sentencepiece.model", ["not_sentencepiece.model", "SentencePiece"]),
    ("seq_length", None, ["seq_length"]),
    ("glob", None, ["matches no file"]),
])
def test_llama_preprocess_bad_input(tmp_path, name, input_name, fragments):
    good_conv = tmp_path / "conv.json"
    good_conv.write_text('[{"id": "1", "conversations": [{"from": "human", "value": "Hi"}, '
                         '{"from": "gpt", "value": "Hello."}]}]')
    tokenizer = os.path.join(EX, "tokenizer.model")
    inputs, seq = str(good_conv), "64"
    if name == "tokenizer":
        tokenizer = os.path.join(BAD, input_name)
    elif name == "seq_length":
        seq = "1"
    elif name == "glob":
        inputs = str(tmp_path / "nothing*.json")
    else:
        inputs = os.path.join(BAD, name)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = run([PY, "data_preprocess/llama_preprocess.py", "--input_glob", inputs, "--dataset_type", "qa",
             "--model_file", tokenizer, "--seq_length", seq, "--output_file", str(out_dir / "x.mindrecord")], ROOT)
    assert_one_clear_error(r, *fragments)
    assert os.listdir(out_dir) == []


@pytest.fixture(scope="module")
def mindrecord_64(tmp_path_factory):
    from msllm.data.preprocess import preprocess_to_mindrecord
    d = tmp_path_factory.mktemp("mr")
    conv = d / "conv.json"
    conv.write_text('[{"id": "1", "conversations": [{"from": "human", "value": "Hi"}, '
                    '{"from": "gpt", "value": "Hello there."}]}]' )
    out = str(d / "data.mindrecord")
    preprocess_to_mindrecord(str(conv), "qa", os.path.join(EX, "tokenizer.model"), 64, out, repeat=8, progress=False)
    return out


def train_cmd(tmp_path, *extra):
    return [PY, "run_msllm.py", "--config", TINY, "--parallel_config.data_parallel=1",
            f"--output_dir={tmp_path / 'run'}", "--runner_config.train_steps=1", *extra]


def test_training_seq_length_differs_from_mindrecord(tmp_path, mindrecord_64):
    r = run(train_cmd(tmp_path, f"--train_dataset_dir={mindrecord_64}"), ROOT)  # tiny: seq_length 256
    assert_one_clear_error(r, "data.mindrecord", "seq_length 256", "seq_length 64")
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_training_mindrecord_missing_db(tmp_path, mindrecord_64):
    d = tmp_path / "copy"
    d.mkdir()
    shutil.copy(mindrecord_64, d / "data.mindrecord")  # the same name, without its .db
    r = run(train_cmd(tmp_path, f"--train_dataset_dir={d / 'data.mindrecord'}",
                      "--model.model_config.seq_length=64"), ROOT)
    assert_one_clear_error(r, "data.mindrecord", ".db")
    assert not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.parametrize("name,fragments", [
    ("config_unknown_key.yaml", ["config_unknown_key.yaml", "runner_config.learnin_rate"]),
    ("config_wrong_type.yaml", ["config_wrong_type.yaml", "runner_config.batch_size", "integer"]),
    ("config_wrong_type_nested.yaml", ["model.model_config.num_heads", "integer"]),
])
def test_training_bad_yaml(tmp_path, name, fragments):
    r = run([PY, "run_msllm.py", "--config", os.path.join(BAD, name), f"--output_dir={tmp_path / 'run'}"], ROOT)
    assert_one_clear_error(r, *fragments)
    assert not (tmp_path / "run").exists()


def test_training_checkpoint_with_wrong_shapes(tmp_path, mindrecord_64):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {ROOT!r})
        import mindspore as ms; ms.set_device("CPU")
        from msllm.models.llama.config import LlamaConfig
        from msllm.models.llama.model import LlamaForCausalLM
        from msllm.training.checkpoint import save_checkpoint
        net = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_layers=4, num_heads=4, seq_length=64))
        save_checkpoint(net, {str(tmp_path / 'other_0-1_1.ckpt')!r}, 1, 1)
    """)
    assert run([PY, "-c", script], ROOT).returncode == 0
    r = run(train_cmd(tmp_path, f"--train_dataset_dir={mindrecord_64}", "--model.model_config.seq_length=64",
                      f"--load_checkpoint={tmp_path / 'other_0-1_1.ckpt'}"), ROOT)
    assert_one_clear_error(r, "other_0-1_1.ckpt", "shape")
    assert not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.parametrize("table,rank_size,fragments", [
    ("rank_table_truncated.json", "1", ["rank_table_truncated.json"]),
    ("rank_table_missing_device_ip.json", "2", ["rank_table_missing_device_ip.json", "device_ip"]),
    ("rank_table_3_devices.json", "2", ["rank_table_3_devices.json", "3", "RANK_SIZE"]),
])
def test_run_distribute_bad_rank_table(tmp_path, table, rank_size, fragments):
    r = run(["bash", os.path.join(ROOT, "scripts", "run_distribute.sh"), os.path.join(BAD, table), TINY,
             f"[0,{rank_size}]", "train", rank_size], str(tmp_path), {"MSLLM_OUTPUT_DIR": str(tmp_path / "out")})
    assert_one_clear_error(r, *fragments)
    assert not (tmp_path / "out" / "log").exists() or not any((tmp_path / "out" / "log").iterdir())


def test_preprocess_disk_full_leaves_no_output(tmp_path):
    """RLIMIT_FSIZE of 64 KiB: every write past it fails with EFBIG, as on a full disk."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    conv = tmp_path / "conv.json"
    assert run([PY, "data_preprocess/alpaca_converter.py", "--data_path", os.path.join(EX, "alpaca_en_demo.json"),
                "--output_path", str(conv)], ROOT).returncode == 0
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = run([PY, "data_preprocess/llama_preprocess.py", "--input_glob", str(conv), "--dataset_type", "qa",
             "--model_file", os.path.join(EX, "tokenizer.model"), "--seq_length", "256",
             "--output_file", str(out_dir / "alpaca.mindrecord")], ROOT, preexec_fn=limit)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "error:" in r.stderr
    assert os.listdir(out_dir) == []
