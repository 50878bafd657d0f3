"""Each launcher is one record that detects and reads itself, tried in the documented order."""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Mapping
from types import MappingProxyType

import pytest

from gpukit.distributed.environment import _LAUNCHERS, _Launcher, environment
from gpukit.errors import DistributedError
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "environments"

# How the module's documentation names each launcher's ``Environment.source``.
DOCUMENTED = {"torchrun": "torchrun", "Open MPI": "mpi", "Slurm": "slurm", "SkyPilot": "skypilot"}

# Rank 1 of 2 as each launcher alone says it; together they agree, so any of them may win.
RANK_1_OF_2 = {
    "torchrun": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
    "mpi": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    "slurm": {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    },
    "skypilot": {
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6",
    },
}
RENDEZVOUS = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}


def _documented_order() -> list[str]:
    # The module, not the function gpukit.distributed exports under the same name.
    doc = importlib.import_module("gpukit.distributed.environment").__doc__ or ""
    return [DOCUMENTED[name] for name in re.findall(r"^- \*\*(.+?)\*\*", doc, re.MULTILINE)]


def test_launchers_are_tried_in_the_order_the_module_documents() -> None:
    order = _documented_order()
    assert [launcher.name for launcher in _LAUNCHERS] == order
    assert sorted(order) == sorted(RANK_1_OF_2)
    for first, name in enumerate(order):
        # Every launcher from this one on has set its variables: this one wins.
        env = dict(RENDEZVOUS)
        for later in order[first:]:
            env.update(RANK_1_OF_2[later])
        assert environment(env).source == name, f"with {order[first:]} set"


def _every_environment() -> list[dict[str, str]]:
    files = sorted(FIXTURES.glob("*.json"))
    fixtures = [json.loads(path.read_text()) for path in files]
    alone = [{**RENDEZVOUS, **variables} for variables in RANK_1_OF_2.values()]
    together = {key: value for env in fixtures for key, value in env.items()}
    return [*fixtures, *alone, together]


@pytest.mark.parametrize("launcher", _LAUNCHERS, ids=lambda launcher: launcher.name)
def test_detecting_and_reading_a_launcher_changes_neither_the_mapping_nor_os_environ(
    launcher: _Launcher,
) -> None:
    before = dict(os.environ)
    detected = 0
    for env in _every_environment():
        frozen: Mapping[str, str] = MappingProxyType(dict(env))  # a write raises TypeError
        if not launcher.detect(frozen):
            continue
        detected += 1
        try:
            found = launcher.read(frozen)
        except DistributedError:
            continue  # a refusal is a reading too; it must still write nothing
        assert found.source in (launcher.name, None)
        assert dict(frozen) == env
    assert detected > 0, f"no environment shows {launcher.name}"
    assert dict(os.environ) == before
