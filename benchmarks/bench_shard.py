"""Memory per process, sharded (FSDP2) vs DDP: ``python benchmarks/bench_shard.py [--quick]``."""

from __future__ import annotations

import argparse

from gpukit.bench import shard

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    results = shard.run(quick=parser.parse_args().quick)
    for r in results:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "n/a"
        print(
            f"{r.name:<70} {r.value:>9.1f} {r.unit}   {r.baseline_name}: "
            f"{r.baseline_value:>9.1f} {r.unit}   ratio {ratio}"
        )
    print(f"  {results[0].note}")
