"""Exact mode against the default mode: ``python benchmarks/bench_exact.py [--quick]``."""

from __future__ import annotations

import argparse

from gpukit.bench import exact

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    results = exact.run(quick=parser.parse_args().quick)
    for r in results:
        base = f"{r.baseline_value:.4g}" if r.baseline_value is not None else "n/a"
        print(f"{r.name:<52} {r.value:>10.4g} {r.unit}   {r.baseline_name}: {base}")
        print(f"  {r.note}")
    print(f"{'weights vs 1 process':<40} {'default mode':>24} {'exact mode':>24}")
    for row in results[0].extra["exactness"]:
        default = f"{row['default_max_difference']:.3g} " + (
            "yes" if row["default_bitwise"] else "no"
        )
        exact = f"{row['exact_max_difference']:.3g} " + ("yes" if row["exact_bitwise"] else "NO")
        print(f"{row['configuration']:<40} {default:>24} {exact:>24}")
