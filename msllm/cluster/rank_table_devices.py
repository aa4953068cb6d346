"""Which devices go into a server's rank table, and their device IPs.

The device range and visible-device flags of MindFormers ``mindformers/tools/hccl_tools.py``
(``--device_num "[START,END)"``, ``--visible_devices 0,1,...``), and its sources of device IPs:
``hccn_tool -i ID -ip -g``, else the ``address_ID=IP`` lines of ``/etc/hccn.conf``. When no real
address is known, placeholders (CPU/simulation only). :func:`parse_device_range` also parses the
launcher's rank range (``[START,END]`` of ``scripts/run_distribute.sh``). The table format itself
is in :mod:`msllm.cluster.rank_table_format`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

from msllm.cluster.rank_table_format import MAX_DEVICE_ID, validate_ipv4
from msllm.errors import MsllmError

DEFAULT_HCCN_CONF = "/etc/hccn.conf"
#: Placeholder device IPs used when no real ones are known: ``10.C.D.(100+ID)`` for a server
#: ``A.B.C.D`` and device ID. Unique across servers whose last two octets differ. They are never
#: used on CPU, and are wrong for HCCL on Ascend (a WARNING says so when they are used).
PLACEHOLDER_IP_FORMAT = "10.{c}.{d}.{host}"


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
