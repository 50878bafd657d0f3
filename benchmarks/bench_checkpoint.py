"""Checkpoint save/load benchmark: ``python benchmarks/bench_checkpoint.py [--quick] [--json]``."""

from __future__ import annotations

import argparse
import json

from gpukit.bench.checkpoint import run
from gpukit.bench.core import machine_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="~50 MiB instead of ~1 GiB")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    results = run(quick=args.quick)
    if args.json:
        payload = {"machine": machine_description(), "results": [r.to_json() for r in results]}
        print(json.dumps(payload, indent=2))
        return
    print(f"{'measure':42} {'value':>11}  {'vs':34} {'value':>11} {'ratio':>6}")
    for r in results:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        base = "" if r.baseline_value is None else f"{r.baseline_value:7.3f} {r.unit:3}"
        value = f"{r.value:7.3f} {r.unit:3}"
        print(f"{r.name:42} {value}  {r.baseline_name or '':34} {base} {ratio:>6}")
    print(results[0].note)


if __name__ == "__main__":
    main()
