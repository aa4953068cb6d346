"""Tests of scripts/run_distribute.sh and msllm.cluster.launch (real processes, MindSpore on CPU).

The program the launcher runs is tests/cluster/cluster_allreduce_worker.py (env MSLLM_ENTRY):
it joins the MindSpore cluster, AllReduces its rank and writes result_dir/rank_{i}.json.
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from msllm.cluster.launch import make_plan
from msllm.cluster.rank_table import make_rank_table, merge_rank_tables, placeholder_device_ips, save_rank_table
from msllm.errors import MsllmError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_distribute.sh"
WORKER = Path(__file__).resolve().with_name("cluster_allreduce_worker.py")
CLEARED = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_NODE_ID", "RANK_ID", "RANK_SIZE",
           "DEVICE_ID", "DEVICE_NUM", "RANK_TABLE_FILE", "MSLLM_OUTPUT_DIR", "MSLLM_DEVICE_TARGET",
           "MSLLM_NO_WAIT", "MSLLM_KILL_TIMEOUT")


def free_port() -> int:
    """A TCP port nothing listens on right now (for MS_SCHED_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_table(path, servers):
    """Write a merged table for ``servers`` = [(ip, [device ids]), ...]; return its path as str."""
    tables = [make_rank_table(ip, ids, [placeholder_device_ips(ip, ids)[i] for i in ids]) for ip, ids in servers]
    save_rank_table(merge_rank_tables(tables), str(path))
    return str(path)


def launcher_env(**extra):
    """The test's environment for the launcher: cluster variables cleared, the test worker as entry."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(MSLLM_ENTRY=str(WORKER), GLOG_v="3", MS_SCHED_PORT=str(free_port()))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_launcher(args, cwd, env, timeout=240):
    """Run ``bash scripts/run_distribute.sh ARGS`` to completion; return the CompletedProcess."""
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def start_launcher(args, cwd, env, name):
    """Start ``bash scripts/run_distribute.sh ARGS`` in the background, output to cwd/name.out/.err."""
    out = open(Path(cwd) / f"{name}.out", "w")
    err = open(Path(cwd) / f"{name}.err", "w")
    proc = subprocess.Popen(["bash", str(SCRIPT), *map(str, args)], cwd=cwd, env=env, stdout=out, stderr=err)
    out.close()
    err.close()
    return proc


def read_pid_file(path):
    """Lines of a pid file as (role, rank, pid, log) tuples."""
    rows = []
    for line in Path(path).read_text().splitlines():
        role, rank, pid, log = line.split(" ", 3)
        rows.append((role, rank, int(pid), log))
    return rows


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("context:\n  device_target: CPU\n")
    return path


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("args, needle", [
    (["{table}", "{cfg}", "[0,2]", "train", "5"], "rank table {table} has 4 devices but RANK_SIZE is 5"),
    (["{table}", "{cfg}", "[2,6]", "train", "4"], "DEVICE_RANGE '[2,6]' selects ranks 2..5, outside the ranks 0..3"),
    (["{table}", "{cfg}", "[3,1]", "train", "4"], "START (3) must be less than END (1)"),
    (["{table}", "{cfg}", "0-2", "train", "4"], "DEVICE_RANGE '0-2' is not of the form [START,END]"),
    (["{table}", "{tmp}/missing.yaml", "[0,2]", "train", "4"], "config file {tmp}/missing.yaml does not exist"),
    (["{table}", "{cfg}", "[0,2]", "fly", "4"], "MODE 'fly' must be one of train, finetune, eval, predict"),
    (["{table}", "{cfg}", "[0,2]", "train", "four"], "RANK_SIZE 'four' must be a positive integer"),
    (["{table}", "{cfg}"], "expected at least 4 arguments"),
    (["{tmp}/nope.json", "{cfg}", "[0,2]", "train", "4"], "rank table {tmp}/nope.json: no such file"),
    (["{cfg}", "{cfg}", "[0,2]", "train", "4"], "rank table {cfg}: not valid JSON"),
])
def test_launcher_argument_errors(tmp_path, cfg, args, needle):
    table = write_table(tmp_path / "hccl_2s_4p.json", [("127.0.0.1", [0, 1]), ("127.0.0.2", [0, 1])])
    fill = dict(table=table, cfg=cfg, tmp=tmp_path)
    res = run_launcher([a.format(**fill) for a in args], tmp_path, launcher_env(), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert needle.format(**fill) in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "output").exists()  # nothing started


def test_launcher_missing_entry_and_bad_target(tmp_path, cfg):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0])])
    res = run_launcher([table, cfg, "[0,1]", "train", "1"], tmp_path,
                       launcher_env(MSLLM_ENTRY=tmp_path / "absent.py"), timeout=60)
    assert res.returncode == 2
    assert f"entry program {tmp_path}/absent.py does not exist" in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("context:\n  device_target: TPU\n")
    res = run_launcher([table, bad, "[0,1]", "train", "1"], tmp_path, launcher_env(), timeout=60)
    assert res.returncode == 2
    assert f"config {bad}: context.device_target is 'TPU'" in res.stderr


def test_scheduler_host_must_be_local(tmp_path, cfg):
    # 203.0.113.0/24 is TEST-NET-3: never an address of this machine
    table = write_table(tmp_path / "t.json", [("203.0.113.7", [0, 1])])
    res = run_launcher([table, cfg, "[0,2]", "train", "2"], tmp_path, launcher_env(), timeout=60)
    assert res.returncode == 2
    assert "203.0.113.7" in res.stderr and "not an address of this machine" in res.stderr
    assert not (tmp_path / "output" / "log" / "scheduler").exists()


def test_scheduler_port_in_use(tmp_path, cfg):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0])])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_launcher([table, cfg, "[0,1]", "train", "1"], tmp_path, launcher_env(MS_SCHED_PORT=port),
                           timeout=60)
    assert res.returncode == 2
    assert f"MS_SCHED_PORT {port} is already in use on 127.0.0.1" in res.stderr


# --------------------------------------------------------------------------- per-rank environment


def test_cpu_environment_logs_and_pid_file(tmp_path, cfg):
    table = write_table(tmp_path / "hccl_2s_4p.json", [("127.0.0.1", [0, 1]), ("127.0.0.2", [2, 3])])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = launcher_env(MSLLM_OUTPUT_DIR="out", RANK_TABLE_FILE="/inherited.json")
    port = env["MS_SCHED_PORT"]
    res = run_launcher([table, cfg, "[0,2]", "finetune", "4", "--result_dir", tmp_path / "res", "--env_only"],
                       run_dir, env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    out = run_dir / "out"
    for rank in (0, 1):
        info = json.loads((tmp_path / "res" / f"rank_{rank}.json").read_text())
        assert info["env"] == {
            "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "4", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": port,
            "MS_NODE_ID": str(rank), "RANK_ID": str(rank), "RANK_SIZE": "4", "DEVICE_ID": str(rank),
            "DEVICE_NUM": "2", "RANK_TABLE_FILE": None,
        }
        assert info["cwd"] == str(run_dir)
        assert info["argv"] == ["--config", str(cfg), "--run_mode", "finetune", f"--output_dir={out}",
                                "--result_dir", str(tmp_path / "res"), "--env_only"]
        assert f"rank {rank}: device {rank}, pid" in res.stdout
    sched = json.loads((tmp_path / "res" / "scheduler.json").read_text())["env"]
    assert sched["MS_ROLE"] == "MS_SCHED" and sched["MS_SCHED_HOST"] == "127.0.0.1"
    assert sched["MS_WORKER_NUM"] == "4" and sched["MS_SCHED_PORT"] == port
    assert sched["MS_NODE_ID"] is None and sched["RANK_ID"] is None
    rows = read_pid_file(out / "log" / "pids_0_2.txt")
    assert [(r[0], r[1]) for r in rows] == [("scheduler", "-"), ("worker", "0"), ("worker", "1")]
    assert [r[3] for r in rows] == [str(out / "log" / "scheduler" / "msllm.log"),
                                    str(out / "log" / "rank_0" / "msllm.log"),
                                    str(out / "log" / "rank_1" / "msllm.log")]
    assert "worker start role=MS_WORKER rank=1" in (out / "log" / "rank_1" / "msllm.log").read_text()
    assert "worker start role=MS_SCHED" in (out / "log" / "scheduler" / "msllm.log").read_text()

    # second server's invocation: no scheduler, DEVICE_ID from the table (2, 3), default ./output
    res = run_launcher([table, cfg, "[2,4]", "train", "4", "--result_dir", tmp_path / "res2", "--env_only"],
                       run_dir, launcher_env(MS_SCHED_PORT=port), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    info = json.loads((tmp_path / "res2" / "rank_3.json").read_text())
    assert info["env"]["DEVICE_ID"] == "3" and info["env"]["MS_NODE_ID"] == "3"
    assert info["env"]["MS_SCHED_HOST"] == "127.0.0.1"
    assert "--output_dir" not in " ".join(info["argv"])
    assert not (tmp_path / "res2" / "scheduler.json").exists()
    assert [r[1] for r in read_pid_file(run_dir / "output" / "log" / "pids_2_4.txt")] == ["2", "3"]


def test_ascend_environment(tmp_path):
    cfg = tmp_path / "ascend.yaml"
    cfg.write_text("context:\n  device_target: Ascend\n  mode: 0\n")
    table = write_table(tmp_path / "hccl_2s_4p.json", [("127.0.0.1", [0, 1]), ("127.0.0.2", [4, 5])])
    env = launcher_env(MS_ROLE="MS_WORKER", MS_SCHED_HOST="1.2.3.4")  # inherited: must not reach the ranks
    res = run_launcher([table, cfg, "[2,4]", "train", "4", "--result_dir", tmp_path / "res", "--env_only"],
                       tmp_path, env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank, device in ((2, 4), (3, 5)):
        info = json.loads((tmp_path / "res" / f"rank_{rank}.json").read_text())
        assert info["env"] == {
            "MS_ROLE": None, "MS_WORKER_NUM": None, "MS_SCHED_HOST": None, "MS_SCHED_PORT": None,
            "MS_NODE_ID": None, "RANK_ID": str(rank), "RANK_SIZE": "4", "DEVICE_ID": str(device),
            "DEVICE_NUM": "2", "RANK_TABLE_FILE": table,
        }
    assert not (tmp_path / "output" / "log" / "scheduler").exists()

    # MSLLM_DEVICE_TARGET overrides the config (in-process plan, no processes started)
    plan = make_plan([table, str(cfg), "[0,2]", "train", "4"], launcher_env(MSLLM_DEVICE_TARGET="CPU"),
                     str(tmp_path))
    assert plan.device_target == "CPU" and [p.role for p in plan.processes] == ["scheduler", "worker", "worker"]
    with pytest.raises(MsllmError, match="MSLLM_DEVICE_TARGET is 'npu'"):
        make_plan([table, str(cfg), "[0,2]", "train", "4"], launcher_env(MSLLM_DEVICE_TARGET="npu"), str(tmp_path))


def test_rank_size_defaults_to_range_length(tmp_path, cfg):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0, 1])])
    plan = make_plan([table, str(cfg), "[0,2]", "eval", "--flag", "x"], launcher_env(), str(tmp_path))
    assert plan.rank_size == 2
    assert plan.command[-2:] == ["--flag", "x"]
    with pytest.raises(MsllmError, match="has 2 devices but RANK_SIZE is 1"):
        make_plan([table, str(cfg), "[1,2]", "eval"], launcher_env(), str(tmp_path))


# --------------------------------------------------------------------------- real MindSpore clusters


def test_two_invocations_form_one_four_rank_cluster(tmp_path, cfg):
    """Two 'servers' (127.0.0.1 and 127.0.0.2), one launch each, one 4-rank cluster: AllReduce = 6."""
    tables = tmp_path / "tables"
    tables.mkdir()
    for ip in ("127.0.0.1", "127.0.0.2"):
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "tools" / "hccl_tools.py"),
                        "--device_num", "[0,2)", "--server_ip", ip, "--output_dir", tables],
                       check=True, capture_output=True)
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "tools" / "merge_hccl.py"),
                    tables / "hccl_2p_01_127.0.0.1.json", tables / "hccl_2p_01_127.0.0.2.json",
                    "--output", tables], check=True, capture_output=True)
    table = tables / "hccl_2s_4p.json"
    env = launcher_env()
    res_dir = tmp_path / "res"
    started = time.monotonic()
    procs = [start_launcher([table, cfg, rng, "train", "4", "--result_dir", res_dir], tmp_path, env, name)
             for rng, name in (("[2,4]", "server2"), ("[0,2]", "server1"))]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    elapsed = time.monotonic() - started
    logs = {n: (tmp_path / f"{n}.out").read_text() + (tmp_path / f"{n}.err").read_text()
            for n in ("server1", "server2")}
    assert codes == [0, 0], logs
    for rank in range(4):
        info = json.loads((res_dir / f"rank_{rank}.json").read_text())
        assert info["allreduce"] == 6.0
        assert info["rank"] == rank and info["group_size"] == 4
        assert info["env"]["RANK_ID"] == str(rank) and info["env"]["MS_SCHED_HOST"] == "127.0.0.1"
        assert info["env"]["DEVICE_ID"] == str(rank % 2)
    assert "all 3 processes of this invocation finished successfully" in logs["server1"]
    assert "all 2 processes of this invocation finished successfully" in logs["server2"]
    print(f"4-rank cluster from two launches: {elapsed:.1f} s")


def test_failing_rank_stops_the_others(tmp_path, cfg):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0, 1, 2])])
    env = launcher_env(MSLLM_KILL_TIMEOUT="20")
    started = time.monotonic()
    res = run_launcher([table, cfg, "[0,3]", "train", "3", "--result_dir", tmp_path / "res", "--fail_rank", "1",
                        "--fail_delay", "6"],
                       tmp_path, env, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    log1 = tmp_path / "output" / "log" / "rank_1" / "msllm.log"
    assert "error: rank 1 (pid" in res.stderr
    assert f"failed: exit code 3; log: {log1}" in res.stderr
    assert "rank 1 failing on purpose" in res.stderr  # the log's tail is shown
    assert "stopping" in res.stderr and "scheduler" in res.stderr
    rows = read_pid_file(tmp_path / "output" / "log" / "pids_0_3.txt")
    assert len(rows) == 4
    assert not any(alive(pid) for _, _, pid, _ in rows)
    # the others were inside MindSpore's init(): SIGTERM stopped them, not the 20 s SIGKILL fallback
    assert time.monotonic() - started < 6 + 15
    assert not (tmp_path / "res").exists()  # nobody reached the AllReduce


def test_sigterm_to_launcher_is_forwarded(tmp_path, cfg):
    # ranks 0,1 of a 4-rank job whose ranks 2,3 never start: they wait in init() until stopped
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0, 1]), ("127.0.0.2", [0, 1])])
    proc = start_launcher([table, cfg, "[0,2]", "train", "4", "--result_dir", tmp_path / "res"], tmp_path,
                          launcher_env(), "launcher")
    pid_file = tmp_path / "output" / "log" / "pids_0_2.txt"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists()
    time.sleep(6)  # the workers are inside MindSpore's init() by now
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    rows = read_pid_file(pid_file)
    assert not any(alive(pid) for _, _, pid, _ in rows)
    assert "launcher got SIGTERM" in (tmp_path / "launcher.err").read_text()


def test_no_wait_returns_at_once(tmp_path, cfg):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0])])
    res = run_launcher([table, cfg, "[0,1]", "predict", "1", "--result_dir", tmp_path / "res", "--env_only"],
                       tmp_path, launcher_env(MSLLM_NO_WAIT="1"), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "MSLLM_NO_WAIT" in res.stdout
    rows = read_pid_file(tmp_path / "output" / "log" / "pids_0_1.txt")
    deadline = time.monotonic() + 30
    while any(alive(pid) for _, _, pid, _ in rows) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (tmp_path / "res" / "rank_0.json").exists()
