"""The preemption check's cost per step: ``python benchmarks/bench_preempt.py [--quick]``."""

from __future__ import annotations

import argparse

from gpukit.bench import preempt

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    for r in preempt.run(quick=parser.parse_args().quick):
        ratio = f"{r.ratio:.4f}x" if r.ratio is not None else "n/a"
        print(
            f"{r.name:<56} {r.value:>9.3f} {r.unit}   {r.baseline_name}: "
            f"{r.baseline_value:>9.3f} {r.unit}   ratio {ratio}"
        )
        print(f"  {r.note}")
