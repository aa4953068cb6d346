"""HCCL rank tables (version 1.0) in memory: the format, its checks, and building and merging tables.

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

This module does no I/O. Files (reading, writing, the ``tools/hccl_tools.py`` and
``tools/merge_hccl.py`` fronts) are in :mod:`msllm.cluster.rank_table`; where device ids and
device IPs come from is in :mod:`msllm.cluster.rank_table_devices`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from msllm.errors import MsllmError

RANK_TABLE_VERSION = "1.0"
STATUS_COMPLETED = "completed"
HOST_NIC_IP_RESERVED = "reserve"
#: Highest device id accepted for one server (Ascend servers have 8 or 16 chips).
MAX_DEVICE_ID = 15


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


# --------------------------------------------------------------------------- checking


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


def check_unique(table: RankTable, source: str) -> None:
    """Reject duplicate server ids, duplicate device ips and duplicate device ids in a server.

    Raises :class:`MsllmError` naming ``source`` (a file, or e.g. "for server IP") and both places.
    """
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
    check_unique(table, source)
    if check_ranks:
        ranks = sorted(d.rank_id for s in table.servers for d in s.devices)
        if ranks != list(range(table.rank_size)):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            detail = f"duplicated: {dup}" if dup else f"got {ranks}"
            raise MsllmError(
                f"rank table {source}: rank_id values must be 0..{table.rank_size - 1}, each once ({detail})"
            )
    return table


# --------------------------------------------------------------------------- building and merging


def validate_ipv4(text: str, what: str) -> str:
    """Return ``text`` stripped if it is a dotted IPv4 address, else :class:`MsllmError` naming ``what``."""
    value = str(text).strip()
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise MsllmError(f"{what}: '{text}' is not a valid IPv4 address (expected e.g. 90.90.3.1)") from None
    return value


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
    check_unique(table, f"for server {server_ip}")
    return table


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
