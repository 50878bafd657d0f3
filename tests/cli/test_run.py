"""``gpukit run``: claims held for the command's life, signals and exit codes passed through,
waiters served one GPU each in arrival order, nothing left claimed after a crash."""

from __future__ import annotations

import io
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpukit.cli.run import _Status, ddp_command
from gpukit.gpus.claims import claim, current_claims
from tests.conftest import ROOT, CliRunner

MACHINES = ROOT / "tests" / "fixtures" / "machines"
L4 = MACHINES / "server-4xL4-idle.json"
T4 = MACHINES / "kaggle-2xT4-idle.json"
FAST = ("--poll", "0.05", "--settle", "1")


@pytest.fixture
def locks(tmp_path: Path) -> Path:
    return tmp_path / "locks"


def _env(locks: Path, machine: Path = L4) -> dict[str, str]:
    env = {**os.environ, "GPUKIT_FAKE_NVML": str(machine), "GPUKIT_LOCK_DIR": str(locks)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _spawn(locks: Path, *args: str, machine: Path = L4) -> subprocess.Popen[str]:
    """Start ``gpukit ARGS`` without waiting for it (for signals and concurrency)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpukit", *args],
        env=_env(locks, machine),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.02)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _l4_uuids() -> list[str]:
    import json

    return [g["uuid"] for g in json.loads(L4.read_text())["gpus"]]


def test_run_sets_cuda_visible_devices_in_nvidia_smi_order(run_cli: CliRunner, locks: Path) -> None:
    show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER'])"
    done = run_cli("run", "-n", "2", "--", *_py(show), env=dict(_env(locks)))
    assert (done.returncode, done.stdout) == (0, "0,1 PCI_BUS_ID\n")


def test_run_returns_the_command_exit_code(run_cli: CliRunner, locks: Path) -> None:
    done = run_cli("run", "--", *_py("raise SystemExit(7)"), env=dict(_env(locks)))
    assert done.returncode == 7


def test_run_of_a_file_that_is_not_executable_exits_2_and_frees_the_gpu(
    run_cli: CliRunner, locks: Path, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    script.chmod(0o644)
    done = run_cli("run", "--", str(script), env=dict(_env(locks)))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "python train.py" in done.stderr
    assert current_claims(locks) == {}


@pytest.mark.parametrize("timeout", ["-1", "nan"])
def test_run_refuses_a_timeout_that_is_not_a_duration_with_exit_2(
    run_cli: CliRunner, locks: Path, timeout: str
) -> None:
    done = run_cli("run", "--timeout", timeout, "--", *_py("pass"), env=dict(_env(locks)))
    assert done.returncode == 2, done.stderr
    assert "--timeout" in done.stderr


def test_run_returns_128_plus_n_when_a_signal_kills_the_command(
    run_cli: CliRunner, locks: Path
) -> None:
    die = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert run_cli("run", "--", *_py(die), env=dict(_env(locks))).returncode == 128 + 9


def test_run_holds_the_claim_for_the_command_life_and_not_after(
    run_cli: CliRunner, locks: Path
) -> None:
    check = (
        "import os; from gpukit.gpus.claims import current_claims; "
        "print(sorted(h.command for h in current_claims().values()))"
    )
    done = run_cli("run", "--", *_py(check), env=dict(_env(locks)))
    assert "-c" in done.stdout
    assert done.returncode == 0
    assert current_claims(locks) == {}


def test_the_command_does_not_inherit_the_lock_descriptors(run_cli: CliRunner, locks: Path) -> None:
    done = run_cli("run", "--", "sh", "-c", "ls -l /proc/$$/fd", env=dict(_env(locks)))
    assert done.returncode == 0
    assert "/proc/" not in done.stderr
    assert "->" in done.stdout
    assert ".lock" not in done.stdout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_run_forwards_a_signal_sent_to_gpukit_and_returns_the_command_answer(
    locks: Path, tmp_path: Path, signum: int
) -> None:
    ready = tmp_path / "ready"
    trap = (
        "import signal, sys, time, pathlib\n"
        "def stop(n, f): print('got', n, flush=True); sys.exit(5)\n"
        "signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGINT, stop)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(30)\n"
    )
    proc = _spawn(locks, "run", "--", *_py(trap))
    _until(ready.exists)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=20)
    assert (proc.returncode, out) == (5, f"got {signum}\n")


def test_run_without_a_driver_exits_3(run_cli: CliRunner, locks: Path) -> None:
    done = run_cli("run", "--", "true", env=dict(_env(locks, MACHINES / "no-driver.json")))
    assert done.returncode == 3
    assert "No NVIDIA driver" in done.stderr


def test_run_cpu_ok_runs_on_the_cpu_without_a_driver_and_says_so(
    run_cli: CliRunner, locks: Path
) -> None:
    show = "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    env = dict(_env(locks, MACHINES / "no-driver.json"))
    done = run_cli("run", "--cpu-ok", "--", *_py(show), env=env)
    assert (done.returncode, done.stdout) == (0, "''\n")
    assert "on the CPU" in done.stderr


def test_run_without_wait_fails_with_4_when_the_gpus_are_claimed(
    run_cli: CliRunner, locks: Path
) -> None:
    with claim(_l4_uuids(), folder=locks):
        done = run_cli("run", "--", "true", env=dict(_env(locks)))
    assert done.returncode == 4
    assert "claimed by" in done.stderr


def test_run_timeout_exits_124_and_leaves_no_claim_behind(run_cli: CliRunner, locks: Path) -> None:
    uuids = _l4_uuids()
    with claim(uuids[1:], folder=locks):
        # One GPU is free but the command needs two: it waits, then gives up.
        done = run_cli(
            "run", "-n", "2", "--timeout", "0.5", *FAST, "--", "true", env=dict(_env(locks))
        )
        assert set(current_claims(locks)) == set(uuids[1:])
    assert done.returncode == 124
    assert "Waited 0.5 s" in done.stderr
    assert list((locks / "queue").iterdir()) == []


def test_run_wait_starts_the_command_once_a_gpu_is_released(locks: Path) -> None:
    held = claim(_l4_uuids(), folder=locks)
    proc = _spawn(locks, "run", "--wait", *FAST, "--", *_py("print('ran')"))
    time.sleep(0.5)
    assert proc.poll() is None  # still waiting
    held.release()
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (0, "ran\n")
    assert "waiting for 1 GPU" in err  # plain lines in a log, not a live line


def test_kill_9_of_a_running_gpukit_frees_its_gpu_at_once_for_the_next_waiter(
    locks: Path, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    one_gpu = ("--exclude", "1,2,3")
    sleeper = (
        f"import os, pathlib, time; pathlib.Path({str(started)!r}).write_text(str(os.getpid())); "
        "time.sleep(30)"
    )
    first = _spawn(locks, "run", *one_gpu, "--", *_py(sleeper))
    _until(lambda: started.exists() and started.read_text() != "")
    waiter = _spawn(locks, "run", "--wait", *one_gpu, *FAST, "--", *_py("print('next')"))
    time.sleep(0.3)
    assert waiter.poll() is None
    first.kill()
    first.wait()
    out, _ = waiter.communicate(timeout=30)
    assert (waiter.returncode, out) == (0, "next\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_kill_9_of_gpukit_also_stops_its_command(locks: Path, tmp_path: Path) -> None:
    started = tmp_path / "started"
    sleeper = (
        f"import os, pathlib, time; pathlib.Path({str(started)!r}).write_text(str(os.getpid())); "
        "time.sleep(30)"
    )
    first = _spawn(locks, "run", "--", *_py(sleeper))
    _until(lambda: started.exists() and started.read_text() != "")
    command_pid = int(started.read_text())
    first.kill()
    first.wait()

    def gone() -> bool:
        try:
            os.kill(command_pid, 0)
        except ProcessLookupError:
            return True
        # An exited child of a dead parent is reaped by init; until then it is a zombie.
        with open(f"/proc/{command_pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")

    _until(gone, timeout=10)


def test_waiters_are_served_in_arrival_order(locks: Path, tmp_path: Path) -> None:
    log = tmp_path / "order"
    uuids = _l4_uuids()
    others = claim(uuids[1:], folder=locks)  # one GPU for all: they must take turns
    held = claim(uuids[:1], folder=locks)
    waiters = []
    for name in ("first", "second", "third"):
        note = f"open({str(log)!r}, 'a').write('{name}\\n')"
        waiters.append(_spawn(locks, "run", "--wait", *FAST, "--", *_py(note)))
        arrived = len(waiters)
        _until(lambda: len(list((locks / "queue").glob("*.ticket"))) == arrived)  # noqa: B023
    held.release()
    for proc in waiters:
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    others.release()
    assert log.read_text().split() == ["first", "second", "third"]


@pytest.mark.slow
def test_16_concurrent_waiters_never_share_a_gpu_and_all_finish(
    locks: Path, tmp_path: Path
) -> None:
    record = (
        "import os, sys, time; start = time.time(); time.sleep(0.3); "
        "open(sys.argv[1], 'a').write(f\"{os.environ['CUDA_VISIBLE_DEVICES']} {start} "
        '{time.time()}\\n")'
    )
    log = tmp_path / "jobs"
    procs = [
        _spawn(
            locks, "run", "--wait", "--poll", "0.1", "--settle", "1", "--", *_py(record), str(log)
        )
        for _ in range(16)
    ]
    for proc in procs:
        proc.communicate(timeout=120)
    assert [p.returncode for p in procs] == [0] * 16
    jobs = [line.split() for line in log.read_text().splitlines()]
    assert len(jobs) == 16
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for gpu, start, end in jobs:
        by_gpu.setdefault(gpu, []).append((float(start), float(end)))
    assert set(by_gpu) <= {"0", "1", "2", "3"}
    for spans in by_gpu.values():
        spans.sort()
        for (_, end), (next_start, _) in itertools.pairwise(spans):
            assert end <= next_start, f"two jobs at once on one GPU: {spans}"
    assert current_claims(locks) == {}


def test_ddp_runs_the_script_under_torchrun_with_one_process_per_gpu() -> None:
    argv = ddp_command(["python", "train.py", "--lr", "1"], 4)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert argv[1:] == [*launcher, "train.py", "--lr", "1"]
    assert ddp_command(["python", "-m", "pkg.train"], 2)[-2:] == ["-m", "pkg.train"]
    assert ddp_command(["./train.sh"], 2)[-2:] == ["--no-python", "./train.sh"]


def test_ddp_passes_python_with_its_own_options_to_torchrun_as_a_program() -> None:
    from torch.distributed.run import get_args_parser

    argv = ddp_command(["python", "-u", "train.py", "--lr", "1"], 2)
    parsed = get_args_parser().parse_args(argv[3:])  # torchrun refused `-u` before
    assert parsed.no_python
    assert [parsed.training_script, *parsed.training_script_args] == [
        "python",
        "-u",
        "train.py",
        "--lr",
        "1",
    ]


@pytest.mark.slow
def test_ddp_starts_one_worker_per_claimed_gpu(
    run_cli: CliRunner, locks: Path, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    # One write per worker: print() may write its pieces separately, and two workers' pieces
    # then interleave on the shared pipe.
    script.write_text(
        "import os\nos.write(1, (os.environ['LOCAL_RANK'] + ' ' + os.environ['WORLD_SIZE'] + ' '"
        " + os.environ['CUDA_VISIBLE_DEVICES'] + '\\n').encode())\n"
    )
    done = run_cli("run", "-n", "2", "--ddp", "--", "python", str(script), env=dict(_env(locks)))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:2]) == ["0 2 0,1", "1 2 0,1"]


def test_gpukit_run_itself_never_imports_torch(locks: Path) -> None:
    code = (
        "import sys; from gpukit.cli.main import main; rc = main(['run', '--', 'true']); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    done = subprocess.run(_py(code), env=_env(locks), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_wait_status_is_one_live_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    status = _Status()
    status("waiting for 1 GPU: 0 of 4 qualify")
    status("waiting for 1 GPU: 0 of 4 qualify")
    assert terminal.getvalue().count("\r\033[K") == 2
    assert "\n" not in terminal.getvalue()


def test_the_wait_status_in_a_log_is_a_plain_line_per_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    status = _Status()
    for text in ("0 of 4 qualify", "0 of 4 qualify", "1 of 4 qualify"):
        status(text)
    assert log.getvalue().splitlines() == [
        "gpukit run: 0 of 4 qualify",
        "gpukit run: 1 of 4 qualify",
    ]
