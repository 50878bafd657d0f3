"""Exact accumulation vs a hand-written no_sync loop, bf16 vs fp32 step time (``--quick``)."""

from __future__ import annotations

import argparse

from gpukit.bench import train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one process only")
    for r in train.run(quick=parser.parse_args().quick):
        ratio = f"{r.ratio:.3f}x" if r.ratio is not None else "n/a"
        print(
            f"{r.name:<52} {r.value:>9.2f} {r.unit}   {r.baseline_name}: "
            f"{r.baseline_value:>9.2f} {r.unit}   ratio {ratio}"
        )
        print(f"  {r.note}")
