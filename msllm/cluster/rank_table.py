"""HCCL rank tables (version 1.0): read, check, build, merge and write them.

Format (HCCL rank table v1.0, as written by MindFormers ``mindformers/tools/hccl_tools.py`` and
merged by ``mindformers/tools/merge_hccl.py``; every value is a JSON *string*)::

    {"version": "1.0",
     "server_count": "1",
     "server_list": [{"server_id": "90.90.3.1",
                      "device": [{"device_id": "0", "device_ip": "192.98.92.100", "rank_id": "0"},
                                 ...],
                      "host_nic_ip": "reserve"}],
     "status": "completed"}

``server_id`` is the host's IP address, ``device_id`` the Ascend chip index on that host,
``device_ip`` the chip's RoCE address (from ``hccn_tool -i ID -ip -g`` or ``/etc/hccn.conf``
``address_ID=IP`` lines) and ``rank_id`` the global rank, numbered consecutively in server order.

The command-line fronts are ``tools/hccl_tools.py`` (:func:`write_server_rank_table`) and
``tools/merge_hccl.py`` (:func:`merge_rank_table_files`); the launcher
(:mod:`msllm.cluster.launch`) reads tables with :func:`load_rank_table`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from msllm.errors import MsllmError
from msllm.fileio import write_json_atomic

RANK_TABLE_VERSION = "1.0"
STATUS_COMPLETED = "completed"
HOST_NIC_IP_RESERVED = "reserve"
#: Highest device id accepted for one server (Ascend servers have 8 or 16 chips).
MAX_DEVICE_ID = 15
DEFAULT_HCCN_CONF = "/etc/hccn.conf"
#: Placeholder device IPs used when no real ones are known: ``10.C.D.(100+ID)`` for a server
#: ``A.B.C.D`` and device ID. Unique across servers whose last two octets differ. They are never
#: used on CPU, and are wrong for HCCL on Ascend (a WARNING says so when they are used).
PLACEHOLDER_IP_FORMAT = "10.{c}.{d}.{host}"


@dataclass(frozen=True)
class Device:
    """One accelerator in a rank table.

    ``device_id``: chip index on its server (0..15); ``device_ip``: the chip's network address
    (a string, as in the table); ``rank_id``: global rank (0..rank_size-1).
    """

    device_id: int
    device_ip: str
    rank_id: int


@dataclass(frozen=True)
class Server:
    """One host in a rank table: its IP (``server_id``) and its devices in table order."""

    server_id: str
    devices: Tuple[Device, ...]
    host_nic_ip: str = HOST_NIC_IP_RESERVED


@dataclass(frozen=True)
class RankTable:
    """A whole HCCL v1.0 rank table: servers in table order (ranks are numbered in this order)."""

    servers: Tuple[Server, ...]
    version: str = RANK_TABLE_VERSION
    status: str = STATUS_COMPLETED

    @property
    def server_count(self) -> int:
        """Number of servers (hosts)."""
        return len(self.servers)

    @property
    def rank_size(self) -> int:
        """Total number of devices, i.e. ranks, over all servers."""
        return sum(len(s.devices) for s in self.servers)

    def locate(self, rank_id: int) -> Tuple[Server, Device]:
        """The (server, device) holding global rank ``rank_id``.

        Raises :class:`MsllmError` if no device has that rank id.
        """
        for server in self.servers:
            for device in server.devices:
                if device.rank_id == rank_id:
                    return server, device
        raise MsllmError(f"rank table has no rank_id {rank_id} (its ranks are 0..{self.rank_size - 1})")

    def server_of_rank(self, rank_id: int) -> Server:
        """The server holding global rank ``rank_id`` (see :meth:`locate`)."""
        return self.locate(rank_id)[0]

    def device_of_rank(self, rank_id: int) -> Device:
        """The device entry of global rank ``rank_id`` (see :meth:`locate`)."""
        return self.locate(rank_id)[1]

    def to_dict(self) -> dict:
        """The JSON object of the table, every value a string (MindFormers hccl_tools layout)."""
        return {
            "version": self.version,
            "server_count": str(self.server_count),
            "server_list": [
                {
                    "server_id": s.server_id,
                    "device": [
                        {"device_id": str(d.device_id), "device_ip": d.device_ip, "rank_id": str(d.rank_id)}
                        for d in s.devices
                    ],
                    "host_nic_ip": s.host_nic_ip,
                }
                for s in self.servers
            ],
            "status": self.status,
        }


# --------------------------------------------------------------------------- reading / checking


def _require(obj: dict, key: str, where: str, source: str):
    """``obj[key]``, or :class:`MsllmError` naming the file, the place and the missing key."""
    if not isinstance(obj, dict):
        raise MsllmError(f"rank table {source}: {where} must be a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise MsllmError(f"rank table {source}: {where} has no key '{key}'")
    return obj[key]


def _int_string(value, key: str, where: str, source: str) -> int:
    """Parse a non-negative integer stored as a string (an int is accepted too)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not re.fullmatch(r"\d+", str(value).strip()):
        raise MsllmError(
            f"rank table {source}: {where} '{key}' must be a non-negative integer string, got {value!r}"
        )
    return int(str(value).strip())


def _check_unique(table: RankTable, source: str) -> None:
    """Reject duplicate server ids, duplicate device ips and duplicate device ids in a server."""
    seen_servers: Dict[str, int] = {}
    seen_ips: Dict[str, str] = {}
    for index, server in enumerate(table.servers):
        if server.server_id in seen_servers:
            raise MsllmError(
                f"rank table {source}: server_id {server.server_id} appears twice "
                f"(server_list[{seen_servers[server.server_id]}] and server_list[{index}])"
            )
        seen_servers[server.server_id] = index
        seen_ids: Dict[int, int] = {}
        for d in server.devices:
            if d.device_id in seen_ids:
                raise MsllmError(
                    f"rank table {source}: server {server.server_id} lists device_id {d.device_id} twice"
                )
            seen_ids[d.device_id] = 1
            if d.device_ip in seen_ips:
                raise MsllmError(
                    f"rank table {source}: device_ip {d.device_ip} appears twice "
                    f"({seen_ips[d.device_ip]} and server {server.server_id} device {d.device_id})"
                )
            seen_ips[d.device_ip] = f"server {server.server_id} device {d.device_id}"


def rank_table_from_dict(obj, source: str = "<memory>", check_ranks: bool = True) -> RankTable:
    """Build and check a :class:`RankTable` from the parsed JSON object of a v1.0 table.

    Checks: the keys ``version`` (must be "1.0"), ``server_count``, ``server_list``, ``status``
    (must be "completed"), and per server ``server_id`` / ``device`` and per device ``device_id``
    (0..15), ``device_ip``, ``rank_id``; ``server_count`` equals the number of servers; no
    duplicate server_id, device_ip, or device_id within a server; with ``check_ranks`` the rank
    ids are exactly 0..N-1, each once. Raises :class:`MsllmError` naming ``source`` and the key.
    """
    version = _require(obj, "version", "the top level", source)
    if str(version) != RANK_TABLE_VERSION:
        raise MsllmError(f"rank table {source}: 'version' is {version!r}; only \"1.0\" tables are supported")
    status = _require(obj, "status", "the top level", source)
    if status != STATUS_COMPLETED:
        raise MsllmError(f"rank table {source}: 'status' is {status!r}, expected \"completed\"")
    count = _int_string(_require(obj, "server_count", "the top level", source), "server_count", "the top level", source)
    server_list = _require(obj, "server_list", "the top level", source)
    if not isinstance(server_list, list) or not server_list:
        raise MsllmError(f"rank table {source}: 'server_list' must be a non-empty list")
    if count != len(server_list):
        raise MsllmError(
            f"rank table {source}: 'server_count' is {count} but 'server_list' has {len(server_list)} servers"
        )
    servers: List[Server] = []
    for si, raw_server in enumerate(server_list):
        where = f"server_list[{si}]"
        server_id = _require(raw_server, "server_id", where, source)
        if not isinstance(server_id, str) or not server_id.strip():
            raise MsllmError(f"rank table {source}: {where} 'server_id' must be a non-empty string")
        raw_devices = _require(raw_server, "device", where, source)
        if not isinstance(raw_devices, list) or not raw_devices:
            raise MsllmError(f"rank table {source}: {where} 'device' must be a non-empty list")
        devices = []
        for di, raw in enumerate(raw_devices):
            dwhere = f"{where}.device[{di}]"
            device_id = _int_string(_require(raw, "device_id", dwhere, source), "device_id", dwhere, source)
            if device_id > MAX_DEVICE_ID:
                raise MsllmError(
                    f"rank table {source}: {dwhere} 'device_id' is {device_id}; expected 0..{MAX_DEVICE_ID}"
                )
            device_ip = _require(raw, "device_ip", dwhere, source)
            if not isinstance(device_ip, str) or not device_ip.strip():
                raise MsllmError(f"rank table {source}: {dwhere} 'device_ip' must be a non-empty string")
            rank_id = _int_string(_require(raw, "rank_id", dwhere, source), "rank_id", dwhere, source)
            devices.append(Device(device_id=device_id, device_ip=device_ip.strip(), rank_id=rank_id))
        host_nic_ip = raw_server.get("host_nic_ip", HOST_NIC_IP_RESERVED)
        servers.append(Server(server_id=server_id.strip(), devices=tuple(devices), host_nic_ip=str(host_nic_ip)))
    table = RankTable(servers=tuple(servers), version=str(version), status=status)
    _check_unique(table, source)
    if check_ranks:
        ranks = sorted(d.rank_id for s in table.servers for d in s.devices)
        if ranks != list(range(table.rank_size)):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            detail = f"duplicated: {dup}" if dup else f"got {ranks}"
            raise MsllmError(
                f"rank table {source}: rank_id values must be 0..{table.rank_size - 1}, each once ({detail})"
            )
    return table


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


# --------------------------------------------------------------------------- building


def validate_ipv4(text: str, what: str) -> str:
    """Return ``text`` stripped if it is a dotted IPv4 address, else :class:`MsllmError` naming ``what``."""
    value = str(text).strip()
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise MsllmError(f"{what}: '{text}' is not a valid IPv4 address (expected e.g. 90.90.3.1)") from None
    return value


RANGE_FORM = '"[START,END)" (e.g. "[0,8)": devices 0..7)'


def parse_device_range(text: str, flag: str = "--device_num", form: str = RANGE_FORM) -> Tuple[int, int]:
    """Parse a MindFormers range ``"[START,END)"`` into ``(START, END)``, END exclusive: the one
    parser of device ranges (``hccl_tools --device_num``) and rank ranges (``run_distribute.sh``).

    ``"[START,END]"`` is read the same way (END exclusive too), as MindFormers' ``hccl_tools.py``
    and ``run_distribute.sh`` do. Raises :class:`MsllmError` naming ``flag`` (and the expected
    ``form``) if the text is not of that form or START >= END.
    """
    match = re.fullmatch(r"\s*\[\s*(\d+)\s*,\s*(\d+)\s*[\])]\s*", str(text))
    if not match:
        raise MsllmError(f"{flag} '{text}' is not of the form {form}")
    start, end = int(match.group(1)), int(match.group(2))
    if start >= end:
        raise MsllmError(f"{flag} '{text}': START ({start}) must be less than END ({end})")
    return start, end


def parse_id_list(text: str, flag: str) -> List[int]:
    """Parse ``"0,1,2"`` into ``[0, 1, 2]``: non-negative, unique, each <= :data:`MAX_DEVICE_ID`."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not re.fullmatch(r"\d+", p) for p in parts):
        raise MsllmError(f"{flag} '{text}' must be comma-separated device ids, e.g. 0,1,2,3")
    ids = [int(p) for p in parts]
    for i in ids:
        if i > MAX_DEVICE_ID:
            raise MsllmError(f"{flag} '{text}': device id {i} is out of range 0..{MAX_DEVICE_ID}")
    if len(set(ids)) != len(ids):
        raise MsllmError(f"{flag} '{text}' lists a device id twice")
    return ids


def read_hccn_conf(path: str = DEFAULT_HCCN_CONF) -> Optional[Dict[int, str]]:
    """Device IPs from an hccn.conf file: ``{device_id: ip}`` from its ``address_ID=IP`` lines.

    Source of the format: MindFormers ``hccl_tools.py`` (reads ``/etc/hccn.conf`` when
    ``hccn_tool`` fails). Returns None if the file does not exist; :class:`MsllmError` naming
    the file and line if an ``address_`` line is malformed.
    """
    if not os.path.isfile(path):
        return None
    result: Dict[int, str] = {}
    with open(path, "r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            item = line.strip()
            if not item.startswith("address_"):
                continue
            match = re.fullmatch(r"address_(\d+)\s*=\s*(\S+)", item)
            if not match:
                raise MsllmError(f"{path} line {lineno}: expected 'address_ID=IP', got '{item}'")
            result[int(match.group(1))] = validate_ipv4(match.group(2), f"{path} line {lineno}")
    return result


def query_hccn_tool(device_ids: Sequence[int], tool: str = "hccn_tool") -> Optional[Dict[int, str]]:
    """Device IPs from ``hccn_tool -i ID -ip -g`` (output line ``ipaddr:IP``), as MindFormers does.

    Returns None if the tool is not on PATH or any query gives no address (then the caller
    falls back to hccn.conf).
    """
    exe = shutil.which(tool)
    if exe is None:
        return None
    result: Dict[int, str] = {}
    for device_id in device_ids:
        try:
            out = subprocess.run([exe, "-i", str(device_id), "-ip", "-g"], capture_output=True,
                                 text=True, timeout=30, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        match = re.search(r"ipaddr\s*:\s*(\S+)", out)
        if not match:
            return None
        result[device_id] = match.group(1)
    return result


def placeholder_device_ips(server_ip: str, device_ids: Sequence[int]) -> Dict[int, str]:
    """Placeholder device IPs ``10.C.D.(100+ID)`` for server ``A.B.C.D`` (CPU/simulation only)."""
    octets = server_ip.split(".")
    return {
        i: PLACEHOLDER_IP_FORMAT.format(c=octets[2], d=octets[3], host=100 + i) for i in device_ids
    }


def make_rank_table(server_ip: str, device_ids: Sequence[int], device_ips: Sequence[str]) -> RankTable:
    """A one-server table: ``device_ids[k]`` with ``device_ips[k]`` gets rank ``k``.

    Raises :class:`MsllmError` if the server IP is not IPv4, the lists differ in length, or a
    device id / ip repeats.
    """
    server_ip = validate_ipv4(server_ip, "server_ip")
    if len(device_ids) != len(device_ips):
        raise MsllmError(f"{len(device_ids)} device ids but {len(device_ips)} device ips")
    devices = tuple(Device(device_id=int(d), device_ip=str(ip), rank_id=k)
                    for k, (d, ip) in enumerate(zip(device_ids, device_ips)))
    table = RankTable(servers=(Server(server_id=server_ip, devices=devices),))
    _check_unique(table, f"for server {server_ip}")
    return table


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


# --------------------------------------------------------------------------- merging


def merge_rank_tables(tables: Sequence[RankTable], sources: Optional[Sequence[str]] = None) -> RankTable:
    """Concatenate the servers of ``tables`` in the order given; renumber ranks 0..N-1 in that order.

    Within a server the device order is kept. Raises :class:`MsllmError` (naming the source
    files) if a server_id or a device_ip appears twice across the inputs.
    """
    if not tables:
        raise MsllmError("nothing to merge: give at least one rank table")
    names = list(sources) if sources is not None else [f"table #{k}" for k in range(len(tables))]
    server_seen: Dict[str, str] = {}
    ip_seen: Dict[str, str] = {}
    servers: List[Server] = []
    rank = 0
    for table, name in zip(tables, names):
        for server in table.servers:
            if server.server_id in server_seen:
                raise MsllmError(
                    f"server_id {server.server_id} appears twice: in {server_seen[server.server_id]} and in {name}"
                )
            server_seen[server.server_id] = name
            devices = []
            for d in server.devices:
                if d.device_ip in ip_seen:
                    raise MsllmError(
                        f"device_ip {d.device_ip} appears twice: in {ip_seen[d.device_ip]} and in {name} "
                        f"(server {server.server_id}, device {d.device_id})"
                    )
                ip_seen[d.device_ip] = f"{name} (server {server.server_id}, device {d.device_id})"
                devices.append(Device(device_id=d.device_id, device_ip=d.device_ip, rank_id=rank))
                rank += 1
            servers.append(Server(server_id=server.server_id, devices=tuple(devices), host_nic_ip=server.host_nic_ip))
    return RankTable(servers=tuple(servers))


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
