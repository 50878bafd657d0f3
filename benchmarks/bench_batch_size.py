"""Batch-size search vs accelerate on a simulated memory limit.

Run: python benchmarks/bench_batch_size.py [--quick]
"""

from __future__ import annotations

import argparse

from gpukit.bench.batch_size import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two limits instead of six")
    args = parser.parse_args()
    print(f"{'figure':<24} {'gpukit':>8} {'accelerate':>11} {'ratio':>7}  elements tried (gk/acc)")
    for r in run(quick=args.quick):
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "n/a"
        elements = f"{r.extra['gpukit_elements']}/{r.extra['accelerate_elements']}"
        print(f"{r.name:<24} {r.value:>8.0f} {r.baseline_value or 0:>11.0f} {ratio:>7}  {elements}")


if __name__ == "__main__":
    main()
