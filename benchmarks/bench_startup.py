"""Start-up time of `gpukit list` vs `import torch`, nvitop and gpustat.

Run: python benchmarks/bench_startup.py [--quick]
"""

from __future__ import annotations

import sys

from gpukit.bench.startup import run


def main() -> None:
    results = run(quick="--quick" in sys.argv)
    print(f"{'command':42} {'seconds':>8}  {'vs':28} {'seconds':>8} {'ratio':>6}  target")
    for r in results:
        print(
            f"{r.name:42} {r.value:8.3f}  {r.baseline_name or '':28} "
            f"{r.baseline_value or 0:8.3f} {r.ratio or 0:6.2f}  {r.target}  ({r.note})"
        )
    if results:
        print("all medians (s):", {k: round(v, 3) for k, v in results[0].extra["seconds"].items()})


if __name__ == "__main__":
    main()
