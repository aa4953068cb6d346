"""HCCL rank table files: read and write them, and the logic of the rank table tools.

:func:`load_rank_table` reads and checks a table file (format and checks:
:mod:`msllm.cluster.rank_table_format`); :func:`save_rank_table` writes one atomically, indent 4
as MindFormers. The command-line fronts are ``tools/hccl_tools.py`` (:func:`write_server_rank_table`,
as MindFormers ``mindformers/tools/hccl_tools.py``) and ``tools/merge_hccl.py``
(:func:`merge_rank_table_files`, as MindFormers ``mindformers/tools/merge_hccl.py``), with
MindFormers' output file names; the launcher (:mod:`msllm.cluster.launch_plan`) reads tables
with :func:`load_rank_table`. :func:`make_rank_table` is importable from here too (callers build
a table in memory, then :func:`save_rank_table` it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, Iterable, Optional, Sequence

from msllm.cluster.rank_table_devices import (
    DEFAULT_HCCN_CONF,
    parse_device_range,
    parse_id_list,
    placeholder_device_ips,
    query_hccn_tool,
    read_hccn_conf,
)
from msllm.cluster.rank_table_format import (
    MAX_DEVICE_ID,
    RankTable,
    make_rank_table,
    merge_rank_tables,
    rank_table_from_dict,
    validate_ipv4,
)
from msllm.errors import MsllmError
from msllm.fileio import write_json_atomic

__all__ = [
    "DEFAULT_HCCN_CONF",
    "load_rank_table",
    "make_rank_table",
    "merge_rank_table_files",
    "merged_table_name",
    "save_rank_table",
    "server_table_name",
    "write_server_rank_table",
]


def load_rank_table(path: str) -> RankTable:
    """Read and check the HCCL v1.0 rank table JSON file ``path`` (see :func:`rank_table_from_dict`).

    Raises :class:`MsllmError` if the file is missing, not JSON, or fails a check; the message
    names the file and the key.
    """
    try:
        with open(path, "r", encoding="utf-8") as fh:
            obj = json.load(fh)
    except FileNotFoundError:
        raise MsllmError(f"rank table {path}: no such file") from None
    except IsADirectoryError:
        raise MsllmError(f"rank table {path}: is a directory, expected a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MsllmError(f"rank table {path}: not valid JSON ({exc})") from None
    return rank_table_from_dict(obj, source=path)


def save_rank_table(table: RankTable, path: str) -> str:
    """Write ``table`` to ``path`` atomically (JSON, indent 4 as MindFormers); return ``path``."""
    write_json_atomic(path, table.to_dict(), indent=4)
    return path


def server_table_name(device_indices: Sequence[int], server_ip: str) -> str:
    """MindFormers file name ``hccl_{N}p_{indices joined}_{server_ip}.json``."""
    return f"hccl_{len(device_indices)}p_{''.join(map(str, device_indices))}_{server_ip}.json"


def write_server_rank_table(device_num: str, server_ip: str, visible_devices: Optional[str] = None,
                            device_ips: Optional[str] = None, output_dir: str = ".",
                            hccn_conf: str = DEFAULT_HCCN_CONF,
                            log: Callable[[str], None] = print,
                            warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> str:
    """Write the rank table of one server, as MindFormers ``hccl_tools.py``; return its path.

    ``device_num``: ``"[START,END)"`` indices into ``visible_devices`` (comma-separated physical
    device ids, default the identity ``0..15``); ``server_ip``: this host's IPv4 address.
    Device IPs, first source that has them: ``device_ips`` (comma-separated, one per device,
    the explicit flag wins); ``hccn_tool -i ID -ip -g``; the ``address_ID=IP`` lines of
    ``hccn_conf``; else placeholders (:func:`placeholder_device_ips`) with a WARNING that the table
    is only good for CPU/simulation. Output: ``output_dir/hccl_{N}p_{indices}_{server_ip}.json``,
    written atomically. Raises :class:`MsllmError` naming the flag for any bad value.
    """
    server_ip = validate_ipv4(server_ip, "--server_ip")
    start, end = parse_device_range(device_num, "--device_num")
    if end > MAX_DEVICE_ID + 1:
        raise MsllmError(
            f"--device_num '{device_num}': END {end} is beyond the {MAX_DEVICE_ID + 1} devices a server can have"
        )
    visible = parse_id_list(visible_devices, "--visible_devices") if visible_devices else list(range(MAX_DEVICE_ID + 1))
    if len(visible) < end:
        raise MsllmError(
            f"--device_num '{device_num}' needs {end} visible devices but --visible_devices "
            f"'{visible_devices}' lists {len(visible)}"
        )
    indices = list(range(start, end))
    ids = [visible[i] for i in indices]

    ips: Optional[Dict[int, str]] = None
    if device_ips:
        given = [p.strip() for p in device_ips.split(",")]
        if len(given) != len(ids):
            raise MsllmError(
                f"--device_ips lists {len(given)} addresses but --device_num '{device_num}' selects {len(ids)} devices"
            )
        ips = {i: validate_ipv4(ip, "--device_ips") for i, ip in zip(ids, given)}
        source = "--device_ips"
    if ips is None:
        ips = query_hccn_tool(ids)
        source = "hccn_tool"
    if ips is None:
        conf = read_hccn_conf(hccn_conf)
        if conf is not None:
            missing = [i for i in ids if i not in conf]
            if missing:
                raise MsllmError(f"{hccn_conf} has no address_{missing[0]}=IP line (device {missing[0]})")
            ips = conf
            source = hccn_conf
    if ips is None:
        ips = placeholder_device_ips(server_ip, ids)
        source = "placeholders"
        warn(
            f"WARNING: no device IPs found (no --device_ips, no hccn_tool, no {hccn_conf}); using placeholder "
            f"addresses 10.C.D.(100+device_id): this rank table is only good for CPU/simulation, "
            f"not for HCCL on Ascend"
        )
    table = make_rank_table(server_ip, ids, [ips[i] for i in ids])
    path = os.path.join(output_dir, server_table_name(indices, server_ip))
    save_rank_table(table, path)
    for d in table.servers[0].devices:
        log(f"rank_id:{d.rank_id}, device_id:{d.device_id}, device_ip:{d.device_ip}")
    log(f"device ips from {source}")
    log(f"Completed: hccl file was saved in: {os.path.abspath(path)}")
    return path


def merged_table_name(table: RankTable) -> str:
    """MindFormers ``merge_hccl.py`` file name ``hccl_{S}s_{N}p.json``."""
    return f"hccl_{table.server_count}s_{table.rank_size}p.json"


def merge_rank_table_files(paths: Iterable[str], output: Optional[str] = None,
                           log: Callable[[str], None] = print) -> str:
    """Load and merge rank table files (see :func:`merge_rank_tables`); write the result; return its path.

    ``output``: the file to write; an existing directory means that directory with the default
    name; None means ``./hccl_{S}s_{N}p.json`` (as MindFormers ``merge_hccl.py``). Written
    atomically.
    """
    paths = list(paths)
    tables = [load_rank_table(p) for p in paths]
    merged = merge_rank_tables(tables, paths)
    if output is None:
        output = merged_table_name(merged)
    elif os.path.isdir(output):
        output = os.path.join(output, merged_table_name(merged))
    save_rank_table(merged, output)
    for server in merged.servers:
        ranks = [d.rank_id for d in server.devices]
        log(f"server {server.server_id}: {len(ranks)} devices, ranks {ranks[0]}..{ranks[-1]}")
    log(f"Completed: merged {merged.server_count} servers, {merged.rank_size} devices into: {os.path.abspath(output)}")
    return output
