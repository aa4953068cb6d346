"""Test worker for the cluster launcher: join the MindSpore cluster, AllReduce(sum) the rank.

Invoked exactly like ``run_msllm.py`` (``--config C --run_mode M [extra]``) by
``msllm.cluster.launch`` with ``MSLLM_ENTRY`` pointing here. Extra flags it understands:

* ``--result_dir DIR``: each worker writes ``DIR/rank_{RANK_ID}.json`` with its rank info and the
  AllReduce result (the scheduler process, ``MS_ROLE=MS_SCHED``, writes nothing).
* ``--fail_rank R``: the worker whose ``RANK_ID`` is R exits with status 3 before joining,
  after ``--fail_delay`` seconds (default 0; the other ranks are then inside ``init()``).
* ``--env_only``: write the environment and exit without touching MindSpore.
* ``--destroy``: leave the cluster with ``mindspore.mint.distributed.destroy_process_group()`` after the
  AllReduce (benchmarks/cluster_teardown_crash.py: whether that avoids MindSpore's crash at exit).
* ``--crash_after_done R``: the worker whose ``RANK_ID`` is R marks its work done
  (:func:`msllm.cluster.rank_done.mark_done`) and then kills itself with SIGSEGV while the interpreter
  exits (an ``atexit`` handler), as MindSpore 2.10 sometimes does on its own: the launcher must count it
  as finished if the other processes end well.
* ``--gather_bytes N``: after the AllReduce, each rank all-gathers ``N + 7 * rank`` pseudo-random
  bytes (seeded by its rank) with :func:`msllm.cluster.gather.all_gather_bytes` and records the
  length and SHA-256 of every blob it received.
"""

import argparse
import json
import os
import sys
import time


def main() -> int:
    """Parse the launcher's flags, join the cluster, AllReduce, write the result file."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--run_mode", required=True)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--fail_rank", type=int, default=-1)
    parser.add_argument("--fail_delay", type=float, default=0.0)
    parser.add_argument("--env_only", action="store_true")
    parser.add_argument("--gather_bytes", type=int, default=0)
    parser.add_argument("--destroy", action="store_true")
    parser.add_argument("--crash_after_done", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to stay alive after the AllReduce")
    args = parser.parse_args()

    role = os.environ.get("MS_ROLE", "")
    rank_env = os.environ.get("RANK_ID", "")
    keys = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID",
            "RANK_ID", "RANK_SIZE", "DEVICE_ID", "DEVICE_NUM", "RANK_TABLE_FILE")
    info = {
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in keys},
    }
    print(f"worker start role={role} rank={rank_env}", flush=True)
    if role != "MS_SCHED" and args.fail_rank >= 0 and rank_env == str(args.fail_rank):
        time.sleep(args.fail_delay)
        print(f"rank {rank_env} failing on purpose", flush=True)
        return 3
    if args.env_only:
        name = "scheduler" if role == "MS_SCHED" else f"rank_{rank_env}"
        _write(os.path.join(args.result_dir, f"{name}.json"), info)
        return 0

    import mindspore as ms
    from mindspore import Tensor, ops
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(device_target="CPU")
    init()
    if role == "MS_SCHED":
        return 0
    rank = get_rank()
    total = ops.AllReduce()(Tensor([float(rank)], ms.float32))
    info.update(rank=rank, group_size=get_group_size(), allreduce=float(total.asnumpy()[0]))
    if args.gather_bytes:
        import hashlib

        import numpy as np

        from msllm.cluster.gather import all_gather_bytes

        mine = np.random.default_rng(rank).bytes(args.gather_bytes + 7 * rank)
        got = all_gather_bytes(mine, get_group_size())
        info["gathered"] = [[len(b), hashlib.sha256(b).hexdigest()] for b in got]
    _write(os.path.join(args.result_dir, f"rank_{rank}.json"), info)
    time.sleep(args.sleep)
    print(f"rank {rank} allreduce {info['allreduce']}", flush=True)
    if args.destroy:
        from mindspore.mint.distributed import destroy_process_group

        destroy_process_group()
        print(f"rank {rank} left the cluster", flush=True)
    if rank == args.crash_after_done:
        import atexit
        import signal

        atexit.register(lambda: os.kill(os.getpid(), signal.SIGSEGV))
        print(f"rank {rank} will crash while exiting", flush=True)
    return 0


def _write(path: str, obj: dict) -> None:
    """Write ``obj`` as JSON via a temporary name, so a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


if __name__ == "__main__":
    code = main()
    if code == 0:   # as run_msllm.py does (msllm/cli.py)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from msllm.cluster.rank_done import mark_done

        mark_done()
    sys.exit(code)
