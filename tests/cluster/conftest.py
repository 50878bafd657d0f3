"""The cluster tier's fixtures: a real Slurm of one node and of two, shared by the session.

The daemons start once, when the first test needs them, and stop at the end of the session,
each by its pid (see ``slurm.py``). Where they cannot run (not root, packages missing, no
namespaces), every test of the tier skips and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from tests.cluster.slurm import Cluster, Munge, Unavailable, available
from tests.helpers import MACHINES, ROOT

SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORKLOADS = ROOT / "tests" / "distributed" / "scripts"
TRAIN = SCRIPTS / "train.py"
RESUME = SCRIPTS / "resume.py"
NO_DRIVER = MACHINES / "no-driver.json"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_env(**extra: str) -> dict[str, str]:
    """What a user's shell holds: this checkout importable, no launcher's variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM", "OMPI_", "PMIX", "TORCHELASTIC"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(WORKLOADS)])
    env["OMP_NUM_THREADS"] = "1"  # several processes on a small machine: do not oversubscribe
    env["GPUKIT_FAKE_NVML"] = str(NO_DRIVER)  # gpukit run --cpu-ok: the same on a GPU machine
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def cluster_folder(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A folder for the daemons' keys, sockets, configuration and logs (root's alone)."""
    reason = available()
    if reason:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="gpukit-slurm-"))
    previous = signal.signal(signal.SIGTERM, _stopper(request.session))
    try:
        yield folder
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(folder, ignore_errors=True)


def _stopper(session: pytest.Session) -> Callable[[int, FrameType | None], None]:
    """A SIGTERM handler that stops a test run told to stop (a CI timeout, `kill`), so that the
    fixtures' teardown stops the daemons.

    It interrupts the test at hand, as Ctrl-C would, and tells pytest to run no further test:
    an interrupt raised where Python cannot pass it on (in a garbage collector's callback, a
    ``__del__``) is printed and dropped, and the run would go on. A second SIGTERM ends the
    run at once.
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        session.shouldstop = f"signal {signum}"
        signal.signal(signum, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signum}")

    return stop


@pytest.fixture(scope="session")
def munge(cluster_folder: Path) -> Iterator[Munge]:
    try:
        daemon = Munge(cluster_folder / "munge")
    except (Unavailable, OSError) as exc:
        pytest.skip(f"munged cannot start here: {exc}")
    yield daemon
    daemon.stop()


def _cluster(folder: Path, munge: Munge, names: list[str]) -> Iterator[Cluster]:
    try:
        cluster = Cluster(folder, munge, names)
    except (Unavailable, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"a {len(names)}-node Slurm cannot start here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def one_node(cluster_folder: Path, munge: Munge) -> Iterator[Cluster]:
    """A one-node Slurm (node ``node0``, 4 CPUs) and the namespace its commands run in."""
    yield from _cluster(cluster_folder / "one", munge, ["node0"])


@pytest.fixture(scope="session")
def two_nodes(cluster_folder: Path, munge: Munge) -> Iterator[Cluster]:
    """A two-node Slurm (``n1``, ``n2``, 4 CPUs each) joined by a private veth link."""
    yield from _cluster(cluster_folder / "two", munge, ["n1", "n2"])


@pytest.fixture(autouse=True)
def _nothing_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test's jobs are cancelled, so that they do not hold the next test's CPUs."""
    yield
    for name in ("one_node", "two_nodes"):
        if name in request.fixturenames:
            request.getfixturevalue(name).cancel_all()


@pytest.fixture(scope="session")
def single_weights(cluster_folder: Path) -> list[float]:
    """The weights of the training in one process, which every N-process run must end with."""
    out = cluster_folder / "single"
    out.mkdir()
    subprocess.run([sys.executable, str(TRAIN), str(out)], env=job_env(), check=True, timeout=180)
    (result,) = read_results(out)
    assert (result["world_size"], result["source"]) == (1, None)
    weights: list[float] = result["weights"]
    return weights


def assert_ok(done: subprocess.CompletedProcess[str], output: Path | None = None) -> None:
    """The command (and the job whose output is ``output``) ended well; else say how."""
    text = output.read_text(errors="replace")[-3000:] if output and output.exists() else ""
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], text)


def read_results(out: Path) -> list[dict[str, Any]]:
    """Every process's result, by rank (two trainings would give two results of rank 0)."""
    results = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    return sorted(results, key=lambda r: r["rank"])


def assert_one_training(
    out: Path, world: int, single: list[float], source: str | None = "slurm"
) -> list[dict[str, Any]]:
    """``world`` processes trained together and each ended with the one-process weights."""
    results = read_results(out)
    assert [(r["rank"], r["world_size"]) for r in results] == [(r, world) for r in range(world)]
    if source is not None:
        assert {r["source"] for r in results} == {source}
    for result in results:
        assert result["weights"] == pytest.approx(single, rel=0, abs=1e-12)
    return results
