"""Run the accumulation table: the references, then 1, 2 and 3 processes; write JSON to argv[1]."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accumulate_workloads as work

from gpukit import distributed as dist

if __name__ == "__main__":
    references = {repr(case): work.reference(case[0], case[2], case[3]) for case in work.cases()}
    worlds = {"1": [work.table()]}
    for n in (2, 3):
        worlds[str(n)] = dist.launch(work.table, n)
    Path(sys.argv[1]).write_text(json.dumps({"references": references, "worlds": worlds}))
