"""gk.distributed.environment and torchrun_args: jobs of torchrun, Slurm, Open MPI, SkyPilot.

Each launcher is described by a fixture in ``fixtures/environments/``: the variables it sets,
as a plain mapping, for one process of a realistic job.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukit import distributed as dist
from gpukit.distributed import process_group
from gpukit.distributed.environment import Environment
from gpukit.distributed.hostlist import expand_hostlist
from gpukit.distributed.ports import job_port
from gpukit.errors import DistributedError
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "environments"


def fixture(name: str, **changes: str | None) -> dict[str, str]:
    env: dict[str, str] = json.loads((FIXTURES / f"{name}.json").read_text())
    env.pop("_what")
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _view(e: Environment) -> tuple[object, ...]:
    return (
        e.source,
        e.rank,
        e.world_size,
        e.local_rank,
        e.local_world_size,
        e.node_rank,
        e.num_nodes,
        e.master_addr,
        e.master_port,
    )


# -- each launcher -------------------------------------------------------------------------


def test_torchrun_inside_srun_reads_as_torchrun_with_its_own_rendezvous() -> None:
    e = dist.environment(fixture("torchrun-inside-srun"))
    assert _view(e) == ("torchrun", 5, 8, 1, 4, 1, 2, "gpu07", 41234)
    assert e.cuda_index == 1


def test_srun_one_task_per_gpu_on_two_nodes_derives_the_rendezvous_from_the_job() -> None:
    e = dist.environment(fixture("srun-task-per-gpu-2-nodes"))
    assert _view(e) == ("slurm", 5, 8, 1, 4, 1, 2, "gpu07", 15000 + 4242)
    assert (e.cuda_index, e.job_id) == (1, "4242.0")


def test_every_rank_of_a_slurm_job_agrees_on_the_rendezvous() -> None:
    ranks = [
        dist.environment(
            fixture(
                "srun-task-per-gpu-2-nodes",
                SLURM_PROCID=str(r),
                SLURM_LOCALID=str(r % 4),
                SLURM_NODEID=str(r // 4),
            )
        )
        for r in range(8)
    ]
    assert {(e.master_addr, e.master_port) for e in ranks} == {("gpu07", 19242)}
    assert [e.node_rank for e in ranks] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_two_slurm_jobs_on_the_same_nodes_use_different_ports() -> None:
    ports = {
        dist.environment(fixture("srun-task-per-gpu-2-nodes", SLURM_JOB_ID=str(job))).master_port
        for job in range(4242, 4242 + 100)
    }
    assert len(ports) == 100


def test_explicit_master_addr_and_port_win_over_the_slurm_job() -> None:
    env = fixture("srun-task-per-gpu-2-nodes", MASTER_ADDR="10.1.2.3", MASTER_PORT="29999")
    e = dist.environment(env)
    assert (e.master_addr, e.master_port) == ("10.1.2.3", 29999)


def test_gpus_per_task_binds_each_task_to_cuda_0_with_indices_or_uuids() -> None:
    for name in ("srun-gpus-per-task-indices", "srun-gpus-per-task-uuids"):
        e = dist.environment(fixture(name))
        assert (e.source, e.rank, e.local_rank, e.local_world_size, e.cuda_index) == (
            "slurm",
            1,
            1,
            2,
            0,
        )


def test_open_mpi_derives_nodes_from_the_local_size() -> None:
    e = dist.environment(fixture("openmpi"))
    assert _view(e) == ("mpi", 5, 8, 1, 4, 1, 2, "10.0.0.1", 29500)


def test_skypilot_is_one_process_per_node_with_the_first_ip_as_rendezvous() -> None:
    e = dist.environment(fixture("skypilot"))
    assert _view(e)[:8] == ("skypilot", 1, 2, 0, 1, 1, 2, "10.0.0.5")
    assert e.master_port == job_port("sky-2026-11-30-10-00-00-000000_train_1")


def test_no_launcher_is_rank_0_of_1_on_one_node() -> None:
    e = dist.environment(fixture("no-launcher"))
    assert _view(e) == (None, 0, 1, 0, 1, 0, 1, None, None)
    assert not e.launched


def test_a_single_slurm_task_is_a_single_process() -> None:
    env = fixture("srun-gpus-per-task-indices", SLURM_NTASKS="1", SLURM_PROCID="0")
    env.update(SLURM_LOCALID="0", SLURM_TASKS_PER_NODE="1")
    assert dist.environment(env).source is None


def test_the_batch_script_of_a_slurm_job_is_a_single_process_not_rank_0_of_n() -> None:
    # sbatch --ntasks-per-node=4 runs the script once; only srun starts the 4 tasks (a step).
    batch = fixture("srun-task-per-gpu-2-nodes", SLURM_STEP_ID=None, SLURM_PROCID="0")
    assert dist.environment(batch).source is None


def test_gpukit_run_ddp_in_the_batch_script_of_a_multi_node_job_says_to_use_srun() -> None:
    batch = fixture("srun-task-per-node-gpukit-run", SLURM_STEP_ID=None, SLURM_PROCID="0")
    with pytest.raises(DistributedError, match="1 of the job's 2 nodes") as info:
        dist.torchrun_args(4, batch)
    assert "srun --ntasks-per-node=1" in info.value.hint


def test_gpukit_run_ddp_in_the_batch_script_of_a_one_node_job_is_standalone() -> None:
    batch = fixture(
        "srun-gpus-per-task-indices", SLURM_STEP_ID=None, SLURM_PROCID="0", SLURM_LOCALID="0"
    )
    assert dist.torchrun_args(2, batch) == ["--standalone", "--nproc-per-node=2"]


def test_environment_is_frozen() -> None:
    e = dist.environment(fixture("openmpi"))
    with pytest.raises(AttributeError):
        e.rank = 0  # type: ignore[misc]


# -- inconsistent environments fail at once, naming the variables ------------------------------


@pytest.mark.parametrize(
    ("env", "names"),
    [
        (
            fixture("srun-task-per-gpu-2-nodes", CUDA_VISIBLE_DEVICES="0"),
            ("SLURM_LOCALID", "SLURM_TASKS_PER_NODE", "CUDA_VISIBLE_DEVICES=0"),
        ),
        (
            fixture("srun-task-per-gpu-2-nodes", SLURM_NTASKS="6"),
            ("SLURM_STEP_TASKS_PER_NODE=4(x2)", "SLURM_NTASKS=6"),
        ),
        (
            fixture(
                "srun-task-per-gpu-2-nodes", SLURM_JOB_NODELIST="gpu07", SLURM_STEP_NODELIST=None
            ),
            ("SLURM_JOB_NODELIST=gpu07", "2 nodes"),
        ),
        (fixture("openmpi", OMPI_COMM_WORLD_LOCAL_SIZE="3"), ("OMPI_COMM_WORLD_SIZE=8",)),
        (fixture("openmpi", MASTER_ADDR=None), ("MASTER_ADDR",)),
        (
            fixture("skypilot", SKYPILOT_NUM_NODES="3"),
            ("SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES=3"),
        ),
        (fixture("torchrun-inside-srun", LOCAL_RANK="4"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ],
)
def test_an_inconsistent_environment_fails_at_once_naming_its_variables(
    env: dict[str, str], names: tuple[str, ...]
) -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        dist.environment(env)
    assert time.monotonic() - started < 5
    for name in names:
        assert name in str(info.value)


def test_init_refuses_a_local_rank_beyond_the_visible_gpus_before_any_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process_group, "_context", None)  # no context cached by another test
    for key in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "OMPI_", "SKYPILOT_"))]:
        monkeypatch.delenv(key)
    for key, value in fixture("srun-task-per-gpu-2-nodes", CUDA_VISIBLE_DEVICES="0,1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    with pytest.raises(DistributedError, match=r"SLURM_LOCALID.*CUDA_VISIBLE_DEVICES=0,1"):
        dist.init()


# -- torchrun_args ---------------------------------------------------------------------------


def test_torchrun_args_under_srun_one_task_per_node_join_the_jobs_first_node() -> None:
    # Job 4242's step 1: 15000 + (4242 + 7919 * 1) mod 15000. No --node-rank: the c10d
    # rendezvous numbers the nodes, and torchrun warns that it ignores one given.
    assert dist.torchrun_args(4, fixture("srun-task-per-node-gpukit-run")) == [
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=rack1-gpu07:27161",
        "--rdzv-id=4242.1",
    ]


def test_torchrun_args_under_skypilot_use_the_first_node_ip() -> None:
    args = dist.torchrun_args(4, fixture("skypilot"))
    assert args[:2] == ["--nnodes=2", "--nproc-per-node=4"]
    assert args[3].startswith("--rdzv-endpoint=10.0.0.5:")


def test_torchrun_args_without_a_multi_node_job_are_standalone() -> None:
    assert dist.torchrun_args(2, fixture("no-launcher")) == ["--standalone", "--nproc-per-node=2"]


def test_torchrun_args_refuse_several_tasks_per_node() -> None:
    with pytest.raises(DistributedError, match="--ntasks-per-node=1"):
        dist.torchrun_args(4, fixture("srun-task-per-gpu-2-nodes"))


def test_torchrun_args_refuse_to_nest_torchrun() -> None:
    with pytest.raises(DistributedError, match="already runs under torchrun"):
        dist.torchrun_args(4, fixture("torchrun-inside-srun"))


# -- Slurm host lists ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu07", ["gpu07"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[1-2,05,7]", ["n1", "n2", "n05", "n7"]),
        ("a[1-2],b3,c[9-10]", ["a1", "a2", "b3", "c9", "c10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("rack1-gpu[07-08].cluster", ["rack1-gpu07.cluster", "rack1-gpu08.cluster"]),
        ("n1 n2", ["n1", "n2"]),
        ("n[1]", ["n1"]),
    ],
)
def test_hostlists_expand_as_scontrol_show_hostnames(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[3-1]", "n[a-b]", "n[1-2", "n[[1]]", "n[]"])
def test_a_malformed_hostlist_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(DistributedError, match=re.escape(repr(bad))):
        expand_hostlist(bad)


_prefix = st.from_regex(r"[a-z][a-z0-9\-]{0,6}[a-z\-]", fullmatch=True)
_suffix = st.one_of(st.just(""), st.from_regex(r"[\-.][a-z]{1,4}", fullmatch=True))


@st.composite
def _groups(draw: st.DrawFn) -> list[tuple[str, int, list[int], str]]:
    """Runs of hosts sharing a prefix, zero-padding width and suffix."""
    groups = []
    for _ in range(draw(st.integers(1, 4))):
        width = draw(st.integers(1, 4))
        numbers = draw(st.lists(st.integers(0, 10**width - 1), min_size=1, max_size=8))
        groups.append((draw(_prefix), width, numbers, draw(_suffix)))
    return groups


def _compress(numbers: list[int], width: int) -> str:
    """Numbers as Slurm writes them in brackets: consecutive runs as ranges, in order."""
    parts: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start:0{width}d}" + ("" if prev == start else f"-{prev:0{width}d}"))
        if n is not None:
            start = prev = n
    return ",".join(parts)


@settings(max_examples=200, deadline=None)
@given(_groups())
def test_any_compressed_hostlist_expands_back_to_its_hosts_in_order(
    groups: list[tuple[str, int, list[int], str]],
) -> None:
    expected = [f"{p}{n:0{w}d}{s}" for p, w, numbers, s in groups for n in numbers]
    text = ",".join(f"{p}[{_compress(numbers, w)}]{s}" for p, w, numbers, s in groups)
    assert expand_hostlist(text) == expected


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=4), min_size=1, max_size=3),
    _prefix,
)
def test_several_bracket_groups_expand_first_group_slowest(
    groups: list[list[int]], prefix: str
) -> None:
    text = "".join(f"{prefix}[{_compress(g, 1)}]" for g in groups)
    expected = [""]
    for g in groups:
        expected = [e + prefix + str(n) for e in expected for n in g]
    assert expand_hostlist(text) == expected


def test_init_refuses_a_local_rank_beyond_the_gpus_cuda_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    import torch.distributed

    monkeypatch.setattr(process_group, "_context", None)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "OMPI_", "SKYPILOT_"))]:
        monkeypatch.delenv(key)
    env = fixture("srun-task-per-gpu-2-nodes", CUDA_VISIBLE_DEVICES=None, SLURM_LOCALID="3")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with pytest.raises(DistributedError, match=r"SLURM_LOCALID.*torch\.cuda\.device_count"):
        dist.init()


def test_gpukit_run_ddp_under_srun_one_task_per_node_joins_the_jobs_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpukit.distributed.torchrun import ddp_command

    for key, value in fixture("srun-task-per-node-gpukit-run").items():
        monkeypatch.setenv(key, value)
    argv = ddp_command(["python", "train.py"], 4)
    assert argv[1:] == [
        "-m",
        "gpukit.distributed.torchrun_agent",
        *dist.torchrun_args(4, fixture("srun-task-per-node-gpukit-run")),
        "train.py",
    ]
    assert "--rdzv-endpoint=rack1-gpu07:27161" in argv
