"""A /metrics scrape of gpukit serve and gpukit list --hosts over 8 fake hosts.

Run: python benchmarks/bench_serve.py [--quick]
"""

from __future__ import annotations

import sys

from gpukit.bench.serve import run


def main() -> None:
    for r in run(quick="--quick" in sys.argv):
        print(
            f"{r.name}: {r.value:.4g} {r.unit} (target {r.target}); {r.baseline_name}: "
            f"{r.baseline_value:.4g} {r.unit}; ratio {r.ratio:.3f}"
        )


if __name__ == "__main__":
    main()
