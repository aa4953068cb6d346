"""Tests of HCCL rank tables: tools/hccl_tools.py, tools/merge_hccl.py, msllm.cluster.rank_table*."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from msllm.cluster.rank_table import load_rank_table, save_rank_table
from msllm.cluster.rank_table_devices import parse_device_range, placeholder_device_ips
from msllm.cluster.rank_table_format import (
    Device,
    RankTable,
    Server,
    make_rank_table,
    merge_rank_tables,
    rank_table_from_dict,
)
from msllm.errors import MsllmError

REPO = Path(__file__).resolve().parents[2]
HCCL_TOOLS = REPO / "tools" / "hccl_tools.py"
MERGE_HCCL = REPO / "tools" / "merge_hccl.py"


def run_tool(script, *args, cwd):
    """Run a tools/ script with the test interpreter; return the CompletedProcess."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def make_server_file(tmp_path, server_ip, n=8, ips=None):
    """Write one server's table with hccl_tools.py into tmp_path; return its path."""
    args = ["--device_num", f"[0,{n})", "--server_ip", server_ip, "--output_dir", tmp_path]
    if ips:
        args += ["--device_ips", ",".join(ips)]
    res = run_tool(HCCL_TOOLS, *args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return tmp_path / f"hccl_{n}p_{''.join(map(str, range(n)))}_{server_ip}.json"


# --------------------------------------------------------------------------- hccl_tools.py


def test_hccl_tools_exact_format_with_placeholder_ips(tmp_path):
    res = run_tool(HCCL_TOOLS, "--device_num", "[0,8)", "--server_ip", "90.90.3.1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    path = tmp_path / "hccl_8p_01234567_90.90.3.1.json"
    assert path.is_file()
    assert os.listdir(tmp_path) == [path.name]  # nothing else (no temporary file) left behind
    obj = json.loads(path.read_text())
    assert list(obj) == ["version", "server_count", "server_list", "status"]
    assert obj == {
        "version": "1.0",
        "server_count": "1",
        "server_list": [{
            "server_id": "90.90.3.1",
            "device": [{"device_id": str(i), "device_ip": f"10.3.1.{100 + i}", "rank_id": str(i)}
                       for i in range(8)],
            "host_nic_ip": "reserve",
        }],
        "status": "completed",
    }
    assert list(obj["server_list"][0]) == ["server_id", "device", "host_nic_ip"]
    assert list(obj["server_list"][0]["device"][0]) == ["device_id", "device_ip", "rank_id"]
    assert "WARNING" in res.stderr and "CPU/simulation" in res.stderr
    assert str(path) in res.stdout


def test_hccl_tools_device_ips_flag_and_visible_devices(tmp_path):
    ips = [f"192.98.92.{10 + i}" for i in range(4)]
    res = run_tool(HCCL_TOOLS, "--device_num", "[0,4)", "--server_ip", "10.0.0.7", "--visible_devices",
                   "4,5,6,7", "--device_ips", ",".join(ips), "--output_dir", tmp_path / "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "WARNING" not in res.stderr
    obj = json.loads((tmp_path / "out" / "hccl_4p_0123_10.0.0.7.json").read_text())
    devices = obj["server_list"][0]["device"]
    assert [d["device_id"] for d in devices] == ["4", "5", "6", "7"]
    assert [d["device_ip"] for d in devices] == ips
    assert [d["rank_id"] for d in devices] == ["0", "1", "2", "3"]


def test_hccl_tools_reads_hccn_conf(tmp_path):
    conf = tmp_path / "hccn.conf"
    conf.write_text("".join(f"address_{i}=192.98.{i}.1\nnetmask_{i}=255.255.255.0\n" for i in range(8)))
    res = run_tool(HCCL_TOOLS, "--device_num", "[4,8)", "--server_ip", "90.90.3.2", "--hccn_conf", conf,
                   cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "WARNING" not in res.stderr
    obj = json.loads((tmp_path / "hccl_4p_4567_90.90.3.2.json").read_text())
    assert [d["device_ip"] for d in obj["server_list"][0]["device"]] == [f"192.98.{i}.1" for i in range(4, 8)]

    conf.write_text("address_0=192.98.0.1\n")
    res = run_tool(HCCL_TOOLS, "--device_num", "[0,2)", "--server_ip", "90.90.3.2", "--hccn_conf", conf,
                   cwd=tmp_path)
    assert res.returncode == 2
    assert "address_1" in res.stderr and str(conf) in res.stderr


@pytest.mark.parametrize("flags, needle", [
    (["--device_num", "0,8", "--server_ip", "1.2.3.4"], "--device_num '0,8' is not of the form \"[START,END)\""),
    (["--device_num", "[4,2)", "--server_ip", "1.2.3.4"], "START (4) must be less than END (2)"),
    (["--device_num", "[0,17)", "--server_ip", "1.2.3.4"], "END 17"),
    (["--device_num", "[0,8)", "--server_ip", "1.2.3"], "--server_ip: '1.2.3' is not a valid IPv4"),
    (["--device_num", "[0,8)", "--server_ip", "1.2.3.4", "--device_ips", "1.1.1.1,1.1.1.2"],
     "--device_ips lists 2 addresses but --device_num '[0,8)' selects 8"),
    (["--device_num", "[0,2)", "--server_ip", "1.2.3.4", "--device_ips", "1.1.1.1,1.1.1.1"], "appears twice"),
    (["--device_num", "[0,4)", "--server_ip", "1.2.3.4", "--visible_devices", "0,1"], "needs 4 visible devices"),
    (["--device_num", "[0,2)", "--server_ip", "1.2.3.4", "--visible_devices", "0,x"], "--visible_devices '0,x'"),
])
def test_hccl_tools_bad_flags(tmp_path, flags, needle):
    res = run_tool(HCCL_TOOLS, *flags, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.startswith("error: ")
    assert needle in res.stderr
    assert "Traceback" not in res.stderr
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- merge_hccl.py


def test_merge_two_servers_renumbers_ranks(tmp_path):
    a = make_server_file(tmp_path, "90.90.3.1")
    b = make_server_file(tmp_path, "90.90.3.2", ips=[f"1.1.1.{i}" for i in range(8)])
    res = run_tool(MERGE_HCCL, a, b, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    obj = json.loads((tmp_path / "hccl_2s_16p.json").read_text())
    assert obj["version"] == "1.0" and obj["status"] == "completed" and obj["server_count"] == "2"
    assert [s["server_id"] for s in obj["server_list"]] == ["90.90.3.1", "90.90.3.2"]
    ranks = [d["rank_id"] for s in obj["server_list"] for d in s["device"]]
    assert ranks == [str(i) for i in range(16)]
    assert [d["device_id"] for d in obj["server_list"][1]["device"]] == [str(i) for i in range(8)]
    assert obj["server_list"][1]["device"][3]["device_ip"] == "1.1.1.3"
    table = load_rank_table(str(tmp_path / "hccl_2s_16p.json"))
    assert table.rank_size == 16 and table.server_of_rank(8).server_id == "90.90.3.2"

    # order given is the order kept; --output names the file
    res = run_tool(MERGE_HCCL, b, a, "--output", tmp_path / "rev.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rev = load_rank_table(str(tmp_path / "rev.json"))
    assert [s.server_id for s in rev.servers] == ["90.90.3.2", "90.90.3.1"]
    assert rev.device_of_rank(0).device_ip == "1.1.1.0"
    assert rev.device_of_rank(15).device_ip == "10.3.1.107"


def test_merge_rejects_duplicate_server(tmp_path):
    a = make_server_file(tmp_path, "90.90.3.1", n=2)
    res = run_tool(MERGE_HCCL, a, a, cwd=tmp_path)
    assert res.returncode == 2
    assert "server_id 90.90.3.1 appears twice" in res.stderr
    assert not (tmp_path / "hccl_2s_4p.json").exists()


def test_merge_rejects_duplicate_device_ip(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_server_file(tmp_path / "a", "90.90.3.1", n=2, ips=["5.5.5.1", "5.5.5.2"])
    b = make_server_file(tmp_path / "b", "90.90.3.2", n=2, ips=["5.5.5.3", "5.5.5.2"])
    res = run_tool(MERGE_HCCL, a, b, cwd=tmp_path)
    assert res.returncode == 2
    assert "device_ip 5.5.5.2 appears twice" in res.stderr
    assert str(a) in res.stderr and str(b) in res.stderr


@pytest.mark.parametrize("content, needles", [
    ("{not json", ["not valid JSON"]),
    (json.dumps({"version": "1.0", "server_count": "1", "status": "completed"}), ["no key 'server_list'"]),
    (json.dumps({"version": "1.0", "server_count": "1", "status": "completed",
                 "server_list": [{"server_id": "1.1.1.1", "device": [{"device_id": "0", "rank_id": "0"}]}]}),
     ["server_list[0].device[0] has no key 'device_ip'"]),
    (json.dumps({"version": "1.0", "server_count": "1", "status": "initializing",
                 "server_list": [{"server_id": "1.1.1.1",
                                  "device": [{"device_id": "0", "device_ip": "2.2.2.2", "rank_id": "0"}]}]}),
     ["'status' is 'initializing'", "completed"]),
])
def test_merge_rejects_malformed_file(tmp_path, content, needles):
    good = make_server_file(tmp_path, "90.90.3.1", n=2)
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    res = run_tool(MERGE_HCCL, good, bad, cwd=tmp_path)
    assert res.returncode == 2
    assert str(bad) in res.stderr
    for needle in needles:
        assert needle in res.stderr
    assert "Traceback" not in res.stderr


# --------------------------------------------------------------------------- rank_table module


def table_dict(**overrides):
    """A valid 1-server, 2-device table dict, with top-level overrides."""
    obj = {
        "version": "1.0",
        "server_count": "1",
        "server_list": [{"server_id": "10.0.0.1", "device": [
            {"device_id": "0", "device_ip": "192.168.0.1", "rank_id": "0"},
            {"device_id": "1", "device_ip": "192.168.0.2", "rank_id": "1"},
        ], "host_nic_ip": "reserve"}],
        "status": "completed",
    }
    obj.update(overrides)
    return obj


def write(tmp_path, obj, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def test_load_round_trip_and_lookup(tmp_path):
    path = write(tmp_path, table_dict())
    table = load_rank_table(path)
    assert table.rank_size == 2 and table.server_count == 1
    assert table.device_of_rank(1) == Device(device_id=1, device_ip="192.168.0.2", rank_id=1)
    assert table.server_of_rank(0).server_id == "10.0.0.1"
    with pytest.raises(MsllmError, match="no rank_id 2"):
        table.locate(2)
    out = tmp_path / "sub" / "copy.json"
    save_rank_table(table, str(out))
    assert json.loads(out.read_text()) == table_dict()
    assert load_rank_table(str(out)) == table


@pytest.mark.parametrize("mutate, needle", [
    (lambda o: o.update(server_count="2"), "'server_count' is 2 but 'server_list' has 1 servers"),
    (lambda o: o["server_list"][0]["device"][1].update(rank_id="0"), "rank_id values must be 0..1, each once"),
    (lambda o: o["server_list"][0]["device"][1].update(rank_id="5"), "rank_id values must be 0..1"),
    (lambda o: o["server_list"][0]["device"][1].update(rank_id="one"), "'rank_id' must be a non-negative integer"),
    (lambda o: o["server_list"][0]["device"][1].update(device_id="0"), "lists device_id 0 twice"),
    (lambda o: o["server_list"][0]["device"][1].update(device_id="16"), "'device_id' is 16; expected 0..15"),
    (lambda o: o["server_list"][0]["device"][1].update(device_ip="192.168.0.1"), "device_ip 192.168.0.1 appears twice"),
    (lambda o: o["server_list"][0].pop("server_id"), "server_list[0] has no key 'server_id'"),
    (lambda o: o.update(version="2.0"), "only \"1.0\" tables"),
    (lambda o: o.pop("status"), "has no key 'status'"),
    (lambda o: o.update(server_list=[]), "'server_list' must be a non-empty list"),
])
def test_load_rank_table_validation(tmp_path, mutate, needle):
    obj = table_dict()
    mutate(obj)
    path = write(tmp_path, obj)
    with pytest.raises(MsllmError) as info:
        load_rank_table(path)
    assert needle in str(info.value)
    assert path in str(info.value)


def test_load_rank_table_missing_and_not_json(tmp_path):
    with pytest.raises(MsllmError, match="no such file"):
        load_rank_table(str(tmp_path / "absent.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(MsllmError, match="not valid JSON"):
        load_rank_table(str(bad))
    with pytest.raises(MsllmError, match="the top level must be a JSON object"):
        rank_table_from_dict([1, 2], source="x")


def test_make_and_merge_in_memory():
    a = make_rank_table("127.0.0.1", [0, 1], list(placeholder_device_ips("127.0.0.1", [0, 1]).values()))
    b = make_rank_table("127.0.0.2", [0, 1], list(placeholder_device_ips("127.0.0.2", [0, 1]).values()))
    merged = merge_rank_tables([a, b])
    assert merged.rank_size == 4 and merged.server_count == 2
    assert [d.rank_id for s in merged.servers for d in s.devices] == [0, 1, 2, 3]
    assert merged.locate(3) == (merged.servers[1], Device(device_id=1, device_ip="10.0.2.101", rank_id=3))
    assert rank_table_from_dict(merged.to_dict()) == merged
    with pytest.raises(MsllmError, match="server_id 127.0.0.1 appears twice"):
        merge_rank_tables([a, a])
    with pytest.raises(MsllmError, match="not a valid IPv4"):
        make_rank_table("localhost", [0], ["1.1.1.1"])
    assert isinstance(merged, RankTable) and isinstance(merged.servers[0], Server)


def test_parse_device_range():
    assert parse_device_range("[0,8)") == (0, 8)
    assert parse_device_range("[4, 8]") == (4, 8)
    with pytest.raises(MsllmError, match="--device_num"):
        parse_device_range("(0,8)")
