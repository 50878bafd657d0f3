"""gk.distributed across processes: gloo on CPU, launched by gk.distributed.launch and torchrun.

Each test runs a script from ``distributed/scripts/`` in a subprocess with a timeout, so a hang
fails the test instead of blocking the suite, and checks afterwards that no worker is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpukit.distributed.launcher import free_port
from tests.helpers import ROOT

# Its workers train on the CPU with gloo, on a GPU machine too.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]

SCRIPTS = ROOT / "tests" / "distributed" / "scripts"
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(SCRIPTS)])
    env["MASTER_ADDR"] = "127.0.0.1"
    env["OMP_NUM_THREADS"] = "1"  # two processes on a small machine: do not oversubscribe
    return env


def _script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        check=False,
    )


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("*.pid")]


def _assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "worker processes were left running"


@pytest.fixture(scope="module")
def session() -> dict[str, Any]:
    """One run: the workloads in 1 process, then in 2 processes started by launch()."""
    done = _script("launch_session.py", "2", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_launch_returns_each_ranks_result_in_rank_order(session: dict[str, Any]) -> None:
    ranks = session["ranks"]
    assert [(r["rank"], r["world_size"], r["is_main"]) for r in ranks] == [
        (0, 2, True),
        (1, 2, False),
    ]


def test_launch_gives_the_caller_back_its_signal_handlers(session: dict[str, Any]) -> None:
    # torch's elastic agent leaves its own: Ctrl-C would then raise SignalException, not
    # KeyboardInterrupt, and a script under nohup would die on a hang-up.
    assert session["signal_handlers_kept"] is True


def test_launched_processes_use_gloo_and_their_local_rank_on_cpu(
    session: dict[str, Any],
) -> None:
    assert [(r["backend"], r["local_rank"]) for r in session["ranks"]] == [("gloo", 0), ("gloo", 1)]


def test_all_reduce_mean_averages_over_processes(session: dict[str, Any]) -> None:
    assert [r["mean_of_ranks"] for r in session["ranks"]] == [0.5, 0.5]


def test_two_processes_end_with_the_same_weights_as_one_when_the_last_batch_is_uneven(
    session: dict[str, Any],
) -> None:
    # 101 samples, global batch 8: the last step splits 5 samples 3 + 2. Repeating a sample
    # to even it out, or averaging the two gradients 1/2 + 1/2, moves the weights by ~1e-3.
    single = session["single"]["weights"]
    for rank in session["ranks"]:
        assert rank["weights"] == pytest.approx(single, rel=0, abs=1e-12)


def test_a_rank_with_no_sample_in_the_last_step_still_steps_with_the_others(
    session: dict[str, Any],
) -> None:
    # 97 samples: the last global batch holds 1 sample, so rank 1 gets an empty batch. With
    # momentum, a rank that skipped that step would drift from the others in the next epoch.
    single = session["single"]["weights_with_an_empty_share"]
    for rank in session["ranks"]:
        assert rank["weights_with_an_empty_share"] == pytest.approx(single, rel=0, abs=1e-12)


def test_the_loss_weighted_by_batch_length_is_one_process_loss_even_with_an_empty_batch(
    session: dict[str, Any],
) -> None:
    single = session["single"]["logged_losses"]
    assert len(single) == 2 * 13  # 13 steps an epoch, the last of 1 sample
    for rank in session["ranks"]:
        assert rank["logged_losses"] == pytest.approx(single, rel=0, abs=1e-12)


def test_gather_for_metrics_returns_each_sample_once_when_the_world_does_not_divide_it(
    session: dict[str, Any],
) -> None:
    for rank in session["ranks"]:
        assert sorted(rank["eval_ids"]) == list(range(11))
        assert rank["eval_ids"] == session["ranks"][0]["eval_ids"]  # every rank sees it all


def test_gather_for_metrics_pairs_dict_entries_by_key_not_by_position(
    session: dict[str, Any],
) -> None:
    for rank in session["ranks"]:
        assert rank["gathered_by_key"] == {"a": [0, 10], "b": [1, 11]}


def test_gather_for_metrics_refuses_on_every_rank_dicts_whose_keys_differ(
    session: dict[str, Any],
) -> None:
    for rank in session["ranks"]:
        assert "different structures" in rank["mismatch"]
        assert "rank 0 has x['b'], which rank 1 does not" in rank["mismatch"]


def test_launched_workers_are_gone_after_launch_returns(session: dict[str, Any]) -> None:
    _assert_all_gone([r["pid"] for r in session["ranks"]])


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("raise", "failed: rank 1 raised ValueError: boom from the test worker"),
        ("kill", "failed: rank 1 was killed by SIGKILL"),
    ],
)
def test_a_failing_worker_ends_launch_quickly_naming_its_rank_and_leaving_no_process(
    tmp_path: Path,
    mode: str,
    says: str,
) -> None:
    started = time.monotonic()
    # A hang would run into the subprocess timeout (an error); a slow, clean stop would not: the
    # elapsed-time check below is what tells the two apart.
    done = _script("launch_failing.py", mode, str(tmp_path), timeout=180)
    assert time.monotonic() - started < 60
    assert done.returncode != 0
    assert "WorkerFailedError" in done.stderr
    assert says in done.stderr
    pids = _pids(tmp_path)
    assert len(pids) == 2  # both workers had started before rank 1 failed
    _assert_all_gone(pids)


def _two_nodes(tmp_path: Path) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]]:
    endpoint = f"127.0.0.1:{free_port()}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=gpukit-two-nodes",
        "--max-restarts=0",
        str(SCRIPTS / "torchrun_train.py"),
        str(tmp_path),
    ]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [
        subprocess.Popen(
            command,
            env=_env(),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so that a stop reaches the node's workers too
        )
        for log in logs
    ]
    try:
        # When one node fails (its rendezvous port was taken, say), the other would wait for
        # it until torch's own rendezvous timeout: stop it too.
        deadline = time.monotonic() + 300
        while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
            if any(n.poll() not in (None, 0) for n in nodes):
                break
            time.sleep(0.1)
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=10)
    outputs = [("", log.read_text()) for log in logs]
    return nodes, outputs


def test_two_torchrun_nodes_with_a_c10d_rendezvous_train_together(tmp_path: Path) -> None:
    # The port is free when chosen but another process may take it before the rendezvous binds
    # it; that race is the machine's, not gpukit's, so only that failure is tried again.
    for _ in range(3):
        nodes, outputs = _two_nodes(tmp_path)
        if not any("address already in use" in err.lower() for _, err in outputs):
            break
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["backend"]) for r in results] == [
        (0, 2, "gloo"),
        (1, 2, "gloo"),
    ]
    assert results[0]["weights"] == pytest.approx(results[1]["weights"], abs=1e-6)
    _assert_all_gone(_pids(tmp_path))
    # A group still held at exit is torn down with its threads running, which now and then
    # aborted a worker that had finished ("terminate called without an active exception").
    threads = [json.loads(p.read_text()) for p in tmp_path.glob("*.threads")]
    assert len(threads) == 2
    assert [[n for n in names if "gloo" in n] for names in threads] == [[], []]


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("unloadable", "before running the function: the worker could not load it"),
        ("unpicklable", "'returns_a_lock' returned a lock, which cannot be sent back"),
    ],
)
def test_launch_says_why_when_a_function_cannot_travel_to_workers_or_its_result_back(
    mode: str, says: str
) -> None:
    done = _script("launch_mistakes.py", mode, timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]
    assert says in done.stdout
    if mode == "unloadable":
        assert 'start_method="fork" works in notebooks' in done.stdout
