"""Write the HCCL rank table (v1.0) of one server.

Usage (flags of MindFormers ``mindformers/tools/hccl_tools.py``)::

    python tools/hccl_tools.py --device_num "[0,8)" --server_ip 90.90.3.1 \
        [--visible_devices 0,1,2,3,4,5,6,7] [--device_ips ip0,ip1,...] [--output_dir .]

Writes ``OUTPUT_DIR/hccl_{N}p_{devices}_{server_ip}.json``, e.g. ``hccl_8p_01234567_90.90.3.1.json``.
Device IPs come from ``--device_ips``, else ``hccn_tool``, else ``/etc/hccn.conf``, else
placeholders (with a WARNING: CPU/simulation only).

Logic: :func:`msllm.cluster.rank_table.write_server_rank_table`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msllm.cluster.rank_table import DEFAULT_HCCN_CONF, write_server_rank_table  # noqa: E402
from msllm.errors import cli_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device_num", default="[0,8)",
                        help='devices to use as "[START,END)": indices into --visible_devices (default "[0,8)")')
    parser.add_argument("--server_ip", required=True, help="this server's IPv4 address (the table's server_id)")
    parser.add_argument("--visible_devices", default=None,
                        help="comma-separated physical device ids that --device_num indexes (default 0..15)")
    parser.add_argument("--device_ips", default=None,
                        help="comma-separated device IPs, one per selected device (overrides hccn_tool/hccn.conf)")
    parser.add_argument("--hccn_conf", default=DEFAULT_HCCN_CONF,
                        help=f"hccn.conf to read address_ID=IP lines from (default {DEFAULT_HCCN_CONF})")
    parser.add_argument("--output_dir", default=".", help="directory to write the table into (default: current)")
    return parser.parse_args(argv)


@cli_main
def main(argv=None) -> None:
    """Build and write the table."""
    args = parse_args(argv)
    write_server_rank_table(args.device_num, args.server_ip, visible_devices=args.visible_devices,
                            device_ips=args.device_ips, output_dir=args.output_dir, hccn_conf=args.hccn_conf)


if __name__ == "__main__":
    main()
