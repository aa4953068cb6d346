"""Checkpoint files never cost data: atomic save with manifest, corrupt/incomplete newest
checkpoint falls back to the previous good one, retention never deletes the only good one,
a full disk leaves no partial file."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import mindspore as ms

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


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest"])
def test_damaged_newest_checkpoint_falls_back_with_warning(tmp_path, caplog, damage):
    net = tiny()
    good, newest = save_steps(net, str(tmp_path), [10, 20])
    if damage == "truncate":
        with open(newest, "r+b") as fh:
            fh.truncate(os.path.getsize(newest) // 2)
    elif damage == "flip":
        os.chmod(newest, 0o600)
        with open(newest, "r+b") as fh:
            fh.seek(os.path.getsize(newest) // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    else:
        os.remove(ckpt.sidecar_path(newest))
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
