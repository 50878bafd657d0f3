"""Launch 2 workers of which rank 1 fails (MODE: raise | kill); let the error end this script."""

from __future__ import annotations

import sys

import workloads

from gpukit import distributed as dist

if __name__ == "__main__":
    dist.launch(workloads.failing, 2, sys.argv[1], sys.argv[2])
