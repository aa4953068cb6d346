"""A/B of decode speed between two checkouts of msllm (e.g. main and a branch), alternating: each
round runs ``benchmarks/decode_speed.py --rounds 1`` of checkout A, then of B (B first in odd
rounds), so the machine's background load hits both alike. Each checkout runs its own worker
(``decode_msllm.py``) on its own ``msllm`` and kernel library (``common.use_repo`` puts the
checkout first on ``sys.path``).

    .venv/bin/python benchmarks/ab_decode_checkouts.py --a /work/wt-decode-base --b /work/wt-decode \\
        --rounds 3 -- --shapes smollm2 --batches 1 8 --prompt 512 --new 64 \\
        --frameworks msllm,msllm-bf16,msllm-int8

Arguments after ``--`` go to decode_speed.py. Prints, per (framework, batch), the median ms per decode
step of A and of B over the rounds, each round's pair, the median of the paired ratios B / A, and
whether row 0's greedy tokens are the same in A and B; writes the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(checkout: str, extra: list[str], out: str) -> dict:
    cmd = [sys.executable, os.path.join(checkout, "benchmarks", "decode_speed.py"), "--rounds", "1", "--out", out,
           *extra]
    print("#", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=checkout)
    with open(out) as fh:
        return json.load(fh)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "ab_decode_checkouts.json"))
    a = p.parse_args(argv)
    runs = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            order = [("A", a.a), ("B", a.b)] if rnd % 2 == 0 else [("B", a.b), ("A", a.a)]
            for label, checkout in order:
                res = run(checkout, extra, os.path.join(tmp, f"{label}{rnd}.json"))
                for r in res["runs"]:
                    r["round"] = rnd
                runs[label] += res["runs"]
    summary = []
    for name, batch in sorted({(r["framework"], r["batch"]) for r in runs["A"] + runs["B"] if "error" not in r}):
        pick = {lab: {r["round"]: r for r in runs[lab] if "error" not in r and r["framework"] == name
                      and r["batch"] == batch} for lab in "AB"}
        rounds = sorted(set(pick["A"]) & set(pick["B"]))
        pairs = [(pick["A"][k]["decode_step_ms"], pick["B"][k]["decode_step_ms"]) for k in rounds]
        same = [pick["A"][k]["tokens_row0"] == pick["B"][k]["tokens_row0"] for k in rounds]
        if not pairs:
            continue
        row = {"framework": name, "batch": batch, "A_ms": statistics.median(x for x, _ in pairs),
               "B_ms": statistics.median(y for _, y in pairs), "pairs": pairs,
               "ratio_B_over_A": statistics.median(y / x for x, y in pairs), "tokens_same": all(same)}
        summary.append(row)
        print(f"{name:12s} b{batch}: A {row['A_ms']:.1f} ms/step, B {row['B_ms']:.1f} ms/step, "
              f"B/A {row['ratio_B_over_A']:.3f} (pairs {[(round(x, 1), round(y, 1)) for x, y in pairs]}), "
              f"row-0 tokens same: {row['tokens_same']}", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"a": a.a, "b": a.b, "extra": extra, "summary": summary, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
