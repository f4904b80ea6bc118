"""Regenerate ``layout_oracle.json``: the exhaustive search's best layout for every configuration of the sweep
in ``test_layout_sweep.py`` (the heuristic is held to these; the exhaustive search itself takes minutes on the
largest cases, too long to run for all of them in CI).

    python tests/planning/make_layout_oracle.py [--jobs 2]

Run it after any change to the estimator or the profile that changes step times; the test re-checks a sample
of the cheap cases against a fresh exhaustive search, so a stale file fails CI rather than passing silently.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from layout_sweep import exhaustive_best, sweep  # noqa: E402

OUT = HERE / "layout_oracle.json"


def solve(case: tuple[int, int, int, int, int]) -> dict:
    t0 = time.perf_counter()
    step_s, shape = exhaustive_best(*case)
    return {"case": list(case), "step_s": step_s, "shape": shape, "search_s": round(time.perf_counter() - t0, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    cases = sweep()
    rows = []
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(solve, cases), 1):
            rows.append(row)
            print(f"[{i}/{len(cases)}] {row['case']} {row['step_s']:.6g} s/step ({row['search_s']} s)", flush=True)
    rows.sort(key=lambda r: r["case"])
    OUT.write_text(json.dumps(rows, indent=0) + "\n")
    print(f"wrote {OUT} ({len(rows)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
