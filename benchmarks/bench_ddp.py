"""Training throughput with 1 vs 2 DDP processes: ``python benchmarks/bench_ddp.py [--quick]``."""

from __future__ import annotations

import argparse

from gpukit.bench import ddp

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    results = ddp.run(quick=parser.parse_args().quick)
    for r in results:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "n/a"
        print(
            f"{r.name:<28} {r.value:>10.0f} {r.unit}   {r.baseline_name}: "
            f"{r.baseline_value:>10.0f} {r.unit}   ratio {ratio}"
        )
        print(f"  {r.note}")
