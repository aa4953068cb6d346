"""Tests of scripts/run_distribute.sh and msllm.cluster.launch* (real processes, MindSpore on CPU).

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

from msllm.cluster.launch_plan import make_plan
from msllm.cluster.rank_table import save_rank_table
from msllm.cluster.rank_table_devices import placeholder_device_ips
from msllm.cluster.rank_table_format import make_rank_table, merge_rank_tables
from msllm.config import RUN_MODES
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
    (["{table}", "{cfg}", "[0,2]", "fly", "4"], f"MODE 'fly' must be one of {', '.join(RUN_MODES)}"),
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
    plan = make_plan([table, str(cfg), "[0,2]", "finetune", "--flag", "x"], launcher_env(), str(tmp_path))
    assert plan.rank_size == 2
    assert plan.command[-2:] == ["--flag", "x"]
    with pytest.raises(MsllmError, match="has 2 devices but RANK_SIZE is 1"):
        make_plan([table, str(cfg), "[1,2]", "train"], launcher_env(), str(tmp_path))


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


# serial: the bound below is this test's own wall time (6.5 s alone), which a graph compile on the
# other pytest-xdist worker would stretch (tests/run_parts.sh runs it after the workers, alone)
@pytest.mark.serial
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
    res = run_launcher([table, cfg, "[0,1]", "finetune", "1", "--result_dir", tmp_path / "res", "--env_only"],
                       tmp_path, launcher_env(MSLLM_NO_WAIT="1"), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "MSLLM_NO_WAIT" in res.stdout
    rows = read_pid_file(tmp_path / "output" / "log" / "pids_0_1.txt")
    deadline = time.monotonic() + 30
    while any(alive(pid) for _, _, pid, _ in rows) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (tmp_path / "res" / "rank_0.json").exists()


# --------------------------------------------------------------------------- the config, checked before starting


def msllm_env(**extra):
    """The launcher's environment with run_msllm.py as the entry (no MSLLM_ENTRY)."""
    env = launcher_env(**extra)
    env.pop("MSLLM_ENTRY")
    return env


def test_the_config_and_mode_are_checked_before_anything_starts(tmp_path, cfg):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0, 1])])
    bad = tmp_path / "bad.yaml"
    bad.write_text("context:\n  device_target: CPU\nrunner_config:\n  batchsize: 4\n")
    res = run_launcher([table, bad, "[0,2]", "train", "2"], tmp_path, launcher_env(), timeout=60)
    assert res.returncode == 2 and "unknown config key 'runner_config.batchsize'" in res.stderr, res.stderr
    assert not (tmp_path / "output").exists()
    for mode in RUN_MODES:  # every mode the entry accepts is accepted
        assert make_plan([table, str(cfg), "[0,2]", mode], launcher_env(), str(tmp_path)).run_mode == mode
    tiny = REPO / "configs" / "llama" / "run_llama_tiny.yaml"
    cases = [(["[0,2]", "train", "2", "--parallel_config.data_parallel=1"], r"= 1 rank\(s\), but RANK_SIZE is 2"),
             (["[0,2]", "finetune", "2"], "run_mode finetune needs load_checkpoint"),
             (["[0,2]", "train", "2", "--parallel_config.data_parallel=1", "--parallel_config.model_parallel=2",
               "--parallel.parallel_mode=1"], "cannot compile operator sharding"),
             (["[0,2]", "train", "2", "--runner_config.batchsize=2"], "unknown config key 'runner_config.batchsize'")]
    for args, needle in cases:  # what run_msllm.py would refuse on every rank
        with pytest.raises(MsllmError, match=needle):
            make_plan([table, str(tiny), *args], msllm_env(), str(tmp_path))
    plan = make_plan([table, str(tiny), "[0,2]", "train", "2"], msllm_env(), str(tmp_path))
    assert [p.role for p in plan.processes] == ["scheduler", "worker", "worker"]


def test_logs_go_to_the_configs_output_dir_unless_msllm_output_dir(tmp_path):
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0])])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("output_dir: runs/a\ncontext:\n  device_target: CPU\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    res = run_launcher([table, cfg, "[0,1]", "train", "1", "--result_dir", tmp_path / "res", "--env_only"],
                       run_dir, launcher_env(), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    out = run_dir / "runs" / "a"
    assert f"logs: {out / 'log'} (output_dir from the config)" in res.stdout
    assert (out / "log" / "rank_0" / "msllm.log").exists() and (out / "log" / "pids_0_1.txt").exists()
    assert not (run_dir / "output").exists()
    res = run_launcher([table, cfg, "[0,1]", "train", "1", "--result_dir", tmp_path / "res2", "--env_only"],
                       run_dir, launcher_env(MSLLM_OUTPUT_DIR=tmp_path / "env_out"), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"logs: {tmp_path / 'env_out' / 'log'} (output_dir from MSLLM_OUTPUT_DIR)" in res.stdout
    assert (tmp_path / "env_out" / "log" / "rank_0" / "msllm.log").exists()


@pytest.mark.slow
def test_only_save_strategy_13b_on_two_servers_writes_each_ranks_own_file(tmp_path):
    """The blog's step, as a new user runs it: ``cd scripts; bash run_distribute.sh
    ../hccl_2s_16p.json ../configs/llama/run_llama_13b.yaml [0,8] train 16`` with
    ``only_save_strategy: True``, and the second server's ``[8,16]`` at the same time into the same
    directory (a shared file system). Every rank writes only its own file: 16 protobuf files,
    each MindSpore-readable and equal to the layout's."""
    import mindspore as ms

    from msllm.config import load_config
    from msllm.parallel.param_layout import param_layouts

    (tmp_path / "scripts").mkdir()
    (tmp_path / "configs" / "llama").mkdir(parents=True)
    yaml_13b = (REPO / "configs" / "llama" / "run_llama_13b.yaml").read_text()
    assert "only_save_strategy: False" in yaml_13b
    (tmp_path / "configs" / "llama" / "run_llama_13b.yaml").write_text(
        yaml_13b.replace("only_save_strategy: False", "only_save_strategy: True"))
    write_table(tmp_path / "hccl_2s_16p.json", [("127.0.0.1", list(range(8))), ("127.0.0.2", list(range(8)))])
    args = ["../hccl_2s_16p.json", "../configs/llama/run_llama_13b.yaml"]
    env = msllm_env()
    first = start_launcher(args + ["[0,8]", "train", "16"], tmp_path / "scripts", env, "server1")
    second = start_launcher(args + ["[8,16]", "train", "16"], tmp_path / "scripts", env, "server2")
    codes = [first.wait(timeout=600), second.wait(timeout=600)]
    logs = {n: (tmp_path / "scripts" / f"{n}.out").read_text() + (tmp_path / "scripts" / f"{n}.err").read_text()
            for n in ("server1", "server2")}
    assert codes == [0, 0], logs
    out = tmp_path / "scripts" / "output"
    strategy = out / "strategy"
    files = sorted(os.listdir(strategy))
    assert files == sorted([f"ckpt_strategy_rank_{i}.ckpt" for i in range(16)] + ["layout_summary.yaml"]), files
    assert not (out / "log" / "scheduler").exists()  # no cluster is formed for writing strategies
    cfg = load_config(str(tmp_path / "configs" / "llama" / "run_llama_13b.yaml"))
    layouts = param_layouts(cfg.model_config, cfg.parallel_config)
    for rank in (0, 7, 8, 15):
        assert (out / "log" / f"rank_{rank}" / "msllm.log").exists()
        parsed = ms.parallel.build_searched_strategy(str(strategy / f"ckpt_strategy_rank_{rank}.ckpt"))
        assert set(parsed) == set(layouts)
        q = parsed["model.layers.3.self_attn.q_proj.weight"]
        lay = layouts["model.layers.3.self_attn.q_proj.weight"]
        # -1: the whole repeat group, as MindSpore writes it (docs/dryrun.md)
        assert (list(q.dev_matrix[0].dim), list(q.tensor_map[0].dim), q.opt_weight_shard_size) == \
            (list(lay.dev_matrix), list(lay.tensor_map), -1 if lay.opt_shard_size else 0)


def test_exact_all_gather_of_more_than_16_mib_per_rank(tmp_path, cfg):
    """Two CPU ranks all-gather 17 MiB (+7 bytes on rank 1) each with msllm.cluster.gather: beyond
    2^24 bytes, where a float32 byte count would round. Every rank receives every blob bit-exact."""
    import hashlib

    import numpy as np

    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0, 1])])
    size = 17 * 2 ** 20 + 1   # odd: the last 16-bit word is half padding
    res_dir = tmp_path / "res"
    res = run_launcher([table, cfg, "[0,2]", "train", "2", "--result_dir", res_dir, "--gather_bytes", size],
                       tmp_path, launcher_env(), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    expect = [[size + 7 * r, hashlib.sha256(np.random.default_rng(r).bytes(size + 7 * r)).hexdigest()]
              for r in range(2)]
    for r in range(2):
        assert json.loads((res_dir / f"rank_{r}.json").read_text())["gathered"] == expect


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"   # a zombie has exited
    except OSError:
        return False


def test_ranks_end_with_a_launcher_killed_outright_and_a_second_launch_is_refused_meanwhile(tmp_path, cfg):
    """SIGKILL to the launcher (as the OOM killer sends it) must not leave its ranks running
    unsupervised: they get SIGTERM from the parent-death signal. While they still run, a second
    launch into the same output is refused with one error naming their pids."""
    table = write_table(tmp_path / "t.json", [("127.0.0.1", [0, 1])])
    res_dir = tmp_path / "res"
    args = [table, cfg, "[0,2]", "train", "2", "--result_dir", res_dir, "--sleep", "600"]
    proc = start_launcher(args, tmp_path, launcher_env(), "first")
    pid_file = tmp_path / "output" / "log" / "pids_0_2.txt"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all((res_dir / f"rank_{r}.json").exists() for r in range(2)):
        assert proc.poll() is None, (tmp_path / "first.err").read_text()
        time.sleep(1)
    rows = read_pid_file(pid_file)
    pids = [pid for _, _, pid, _ in rows]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    # a second launch while the first one's processes run: refused before starting anything
    second = run_launcher(args, tmp_path, launcher_env(), timeout=60)
    assert second.returncode == 2
    assert "the previous launch of these ranks still runs" in second.stderr and str(pids[1]) in second.stderr
    # the launcher (python, the parent of the ranks) killed outright
    launcher = int(open(f"/proc/{pids[1]}/stat").read().split(")")[-1].split()[1])
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids), "ranks outlived their launcher"
    proc.wait(timeout=60)
