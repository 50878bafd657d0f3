"""Run the transfer benchmark and print its table: ``python benchmarks/bench_transfer.py``."""

from __future__ import annotations

import sys

from gpukit.bench import transfer
from gpukit.cli.bench import print_results

if __name__ == "__main__":
    print_results(transfer.run(quick="--quick" in sys.argv))
