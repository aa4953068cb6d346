"""Checkpoint files never cost data: atomic save with manifest, corrupt/incomplete newest
checkpoint falls back to the previous good one, a checkpoint that disagrees with its manifest is
never loaded, overwritten or pruned, checkpoints present but none usable is one error naming
each, retention never deletes the only good one, a full disk leaves no partial file."""

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mindspore as ms

from msllm.errors import MsllmError
from msllm.models.llama.config import LlamaConfig
from msllm.models.llama.model import LlamaForCausalLM
from msllm.training import checkpoint as ckpt

ms.set_device("CPU")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny():
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, seq_length=8))


def save_steps(net, directory, steps):
    return [ckpt.save_checkpoint(net, os.path.join(directory, ckpt.checkpoint_name("checkpoint", 0, 1, s)), 1, s,
                                 model_config=net.config) for s in steps]


def test_manifest_records_size_hash_and_model_config(tmp_path):
    net = tiny()
    [path] = save_steps(net, str(tmp_path), [5])
    m = ckpt.read_sidecar(path)
    assert m["size"] == os.path.getsize(path) and m["sha256"] == ckpt.file_sha256(path)
    assert m["model_config"]["hidden_size"] == 16 and m["step"] == 5
    assert ckpt.verify_checkpoint(path) is None
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no temp files left


def damage(path, how):
    """Truncate the file, flip one byte in its middle, or remove its manifest."""
    if how == "truncate":
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    elif how == "flip":
        os.chmod(path, 0o600)
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    else:
        os.remove(ckpt.sidecar_path(path))


@pytest.mark.parametrize("how", ["truncate", "flip", "no_manifest"])
def test_damaged_newest_checkpoint_falls_back_with_warning(tmp_path, caplog, how):
    net = tiny()
    good, newest = save_steps(net, str(tmp_path), [10, 20])
    damage(newest, how)
    with caplog.at_level(logging.WARNING, logger="msllm"):
        found = ckpt.good_checkpoints(str(tmp_path))
    assert found == {10: good}
    assert newest in caplog.text and good in caplog.text  # the warning names both
    assert ckpt.resolve_checkpoint(str(tmp_path), 0) == good


def test_retention_keeps_newest_good_and_never_the_only_good_one(tmp_path):
    net = tiny()
    paths = save_steps(net, str(tmp_path), [1, 2, 3, 4])
    deleted = ckpt.prune_checkpoints(str(tmp_path), "checkpoint", 2)
    assert deleted == paths[:2]
    assert ckpt.list_checkpoints(str(tmp_path)) == paths[2:]
    # the two newest become unusable: the older good one must survive any pruning
    for p in paths[2:]:
        os.remove(ckpt.sidecar_path(p))
    [p5] = save_steps(net, str(tmp_path), [5])
    os.remove(ckpt.sidecar_path(p5))  # a save that "died" before its manifest
    assert ckpt.prune_checkpoints(str(tmp_path), "checkpoint", 1) == []
    assert ckpt.good_checkpoints(str(tmp_path)) == {}


def test_keep_one_with_only_good_checkpoint_older_than_broken_ones(tmp_path):
    net = tiny()
    p1, p2 = save_steps(net, str(tmp_path), [1, 2])
    os.remove(ckpt.sidecar_path(p2))
    assert ckpt.prune_checkpoints(str(tmp_path), "checkpoint", 1) == []
    assert os.path.exists(p1)


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_all_corrupt_is_one_error_naming_every_file(tmp_path, how):
    net = tiny()
    paths = save_steps(net, str(tmp_path), [10, 20])
    for p in paths:
        damage(p, how)
    with pytest.raises(MsllmError) as err:
        ckpt.resolve_checkpoint(str(tmp_path), 0)
    msg = str(err.value)
    assert all(p in msg for p in paths) and ("SHA-256" in msg or "truncated" in msg)
    with pytest.raises(MsllmError) as err:
        ckpt.resolve_checkpoint(paths[0], 0)  # a file named directly: refused as well
    assert paths[0] in str(err.value)
    calls = []
    with pytest.raises(MsllmError) as err:
        ckpt.find_resume_checkpoint(str(tmp_path), 0, lambda steps: calls.append(steps) or max(steps, default=None))
    assert calls == [[]]  # the collective ran once (other ranks are not left waiting)
    assert all(p in str(err.value) for p in paths)
    with pytest.raises(MsllmError, match="does not match its manifest"):
        ckpt.load_params(paths[0])


def test_resume_picks_the_newest_step_good_everywhere_and_fresh_without_checkpoints(tmp_path, caplog):
    net = tiny()
    p10, p20, p30 = save_steps(net, str(tmp_path), [10, 20, 30])
    damage(p30, "flip")
    with caplog.at_level(logging.WARNING, logger="msllm"):
        assert ckpt.find_resume_checkpoint(str(tmp_path), 0, lambda s: max(s, default=None)) == (p20, 20)
    assert p30 in caplog.text
    # another rank lacks step 20: the agreement picks 10
    assert ckpt.find_resume_checkpoint(str(tmp_path), 0, lambda s: 10 if 10 in s else None) == (p10, 10)
    with pytest.raises(MsllmError, match="no step is usable on every rank"):
        ckpt.find_resume_checkpoint(str(tmp_path), 0, lambda s: None)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckpt.find_resume_checkpoint(str(empty), 0, lambda s: max(s, default=None)) is None
    assert ckpt.find_resume_checkpoint(str(tmp_path / "missing"), 0, lambda s: max(s, default=None)) is None


def test_save_refuses_to_overwrite_a_checkpoint_that_disagrees_with_its_manifest(tmp_path):
    net = tiny()
    [path] = save_steps(net, str(tmp_path), [10])
    ckpt.save_checkpoint(net, path, 1, 10)  # a good one may be replaced (same step saved again)
    damage(path, "flip")
    before = open(path, "rb").read()
    with pytest.raises(MsllmError, match="refusing to overwrite checkpoint .*does not match its manifest"):
        ckpt.save_checkpoint(net, path, 1, 10)
    assert open(path, "rb").read() == before
    # retention keeps it too (evidence), while pruning good older ones
    save_steps(net, str(tmp_path), [20, 30, 40])
    [p5] = save_steps(net, str(tmp_path), [5])
    deleted = ckpt.prune_checkpoints(str(tmp_path), "checkpoint", 1)
    assert p5 in deleted and path not in deleted and os.path.exists(path)


def test_foreign_checkpoint_without_manifest_loads_with_an_unverified_warning(tmp_path, caplog):
    net = tiny()
    foreign = tmp_path / "rank_0"
    foreign.mkdir()
    path = str(foreign / "llama_converted.ckpt")  # not msllm's name pattern, no manifest
    ms.save_checkpoint(net, path)
    with caplog.at_level(logging.WARNING, logger="msllm"):
        assert ckpt.resolve_checkpoint(str(tmp_path), 0) == path
        assert ckpt.resolve_checkpoint(path, 0) == path
    assert "unverified" in caplog.text and path in caplog.text
    fresh = tiny()
    ckpt.load_into(fresh, ckpt.load_params(path), path)
    np.testing.assert_array_equal(fresh.model.norm.weight.asnumpy(), net.model.norm.weight.asnumpy())
    with pytest.raises(MsllmError, match="step is unknown"):  # resume needs a step
        ckpt.find_resume_checkpoint(str(tmp_path), 0, lambda s: max(s, default=None))


def test_load_into_strict_after_compile_names_what_is_left_unloaded(tmp_path):
    net = tiny()
    params = {p.name: ms.Parameter(p.asnumpy() + 1, name=p.name) for p in net.get_parameters()}
    ckpt.load_into_strict_after_compile(net, dict(params), "x.ckpt")
    np.testing.assert_array_equal(net.model.norm.weight.asnumpy(), params["model.norm.weight"].asnumpy())
    partial = {k: v for k, v in params.items() if "layers.0.mlp.up_proj" not in k}
    with pytest.raises(MsllmError, match=r"x\.ckpt' lacks 1 parameter.*up_proj"):
        ckpt.load_into_strict_after_compile(net, partial, "x.ckpt")
    wrong = dict(params, **{"model.norm.weight": ms.Parameter(np.ones(8, np.float32), name="model.norm.weight")})
    with pytest.raises(MsllmError, match=r"model.norm.weight \(8,\) vs \(16,\)"):
        ckpt.load_into_strict_after_compile(net, wrong, "x.ckpt")


def test_disk_full_while_saving_leaves_no_partial_checkpoint(tmp_path):
    """RLIMIT_FSIZE makes every write past 64 KiB fail (EFBIG), as a full disk would."""
    script = textwrap.dedent(f"""
        import os, resource, signal, sys
        sys.path.insert(0, {ROOT!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        import mindspore as ms
        ms.set_device("CPU")
        from msllm.models.llama.config import LlamaConfig
        from msllm.models.llama.model import LlamaForCausalLM
        from msllm.training import checkpoint as ckpt
        net = LlamaForCausalLM(LlamaConfig(vocab_size=4000, hidden_size=32, num_layers=1, num_heads=2, seq_length=8))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        ckpt.save_checkpoint(net, os.path.join({str(tmp_path)!r}, "checkpoint_0-1_1.ckpt"), 1, 1)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, GLOG_v="3"))
    assert r.returncode != 0
    assert os.listdir(tmp_path) == []  # neither the checkpoint, its manifest nor a temp file


def test_no_code_path_unpickles():
    """torch.load only with weights_only=True; yaml only with safe_load; no pickle/np allow_pickle."""
    offenders = []
    for top in ("msllm", "tools", "scripts", "data_preprocess", "benchmarks", "run_msllm.py"):
        base = os.path.join(ROOT, top)
        files = [base] if base.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs
            if f.endswith(".py") and "/." not in d.replace(ROOT, "")]  # skip .venv* folders
        for path in files:
            src = open(path, encoding="utf-8").read()
            for i, line in enumerate(src.splitlines(), 1):
                code = line.split("#")[0]
                bad = ("pickle.load" in code or "yaml.load(" in code or "allow_pickle=True" in code
                       or ("torch.load(" in code and "weights_only=True" not in code)
                       or "yaml.unsafe_load" in code)
                if bad:
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert offenders == []


def run_msllm(args):
    env = dict(os.environ, GLOG_v="3")
    for k in ("MS_WORKER_NUM", "RANK_SIZE", "MS_ROLE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "run_msllm.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_resume_and_finetune_refuse_a_directory_of_corrupt_checkpoints(tmp_path, alpaca_mindrecord):
    """Two checkpoints, one byte flipped in each: resume and finetune fail with one error naming
    both files (exit 2), train no step, and leave the files as they were.

    The resume half needs the trainer to call ``checkpoint.find_resume_checkpoint`` (before
    that wiring the run starts from step 0 and stops at its first save, naming one file)."""
    tiny_yaml = os.path.join(ROOT, "configs", "llama", "run_llama_tiny.yaml")
    out = tmp_path / "out"
    base = ["--config", tiny_yaml, "--parallel_config.data_parallel=1", "--model.model_config.seq_length=64",
            "--model.model_config.num_layers=1", f"--train_dataset_dir={alpaca_mindrecord}", f"--output_dir={out}",
            "--callbacks.checkpoint.save_checkpoint_steps=2", "--callbacks.checkpoint.keep_checkpoint_max=2",
            "--callbacks.loss_monitor.per_print_times=1"]
    r = run_msllm(base + ["--runner_config.train_steps=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    rank0 = out / "checkpoint" / "rank_0"
    paths = ckpt.list_checkpoints(str(rank0))
    assert [os.path.basename(p) for p in paths] == ["checkpoint_0-1_2.ckpt", "checkpoint_0-1_4.ckpt"]
    for p in paths:
        damage(p, "flip")
    before = {p: open(p, "rb").read() for p in paths}
    r = run_msllm(base + ["--runner_config.train_steps=6", "--resume_training=True"])
    log = r.stdout + r.stderr
    assert r.returncode == 2, log[-3000:]
    assert all(p in r.stderr for p in paths) and "SHA-256" in r.stderr, r.stderr[-3000:]
    assert "step:[" not in log                                    # no step was trained
    assert {p: open(p, "rb").read() for p in paths} == before and ckpt.list_checkpoints(str(rank0)) == paths
    r = run_msllm(base + ["--runner_config.train_steps=2", "--run_mode=finetune", f"--load_checkpoint={rank0}",
                          f"--output_dir={tmp_path / 'ft'}"])
    assert r.returncode == 2 and all(p in r.stderr for p in paths), r.stderr[-3000:]
    assert "step:[" not in r.stdout + r.stderr
