"""``gpukit run``: claims held for the command's life, signals and exit codes passed through,
waiters served one GPU each in arrival order, nothing left claimed after a crash."""

from __future__ import annotations

import io
import itertools
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpukit.cli.run import _Status
from gpukit.distributed.torchrun import AGENT, ddp_command
from gpukit.sharing.claims import claim, current_claims
from gpukit.sharing.ledger import ledger_name
from tests.helpers import MACHINES, ROOT, CliRunner

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
        "import os; from gpukit.sharing.claims import current_claims; "
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
    assert "add --cpu-ok (gpukit run --cpu-ok -- CMD)" in done.stderr


def test_a_ddp_run_without_a_driver_names_the_cpu_ok_way_to_run_it(
    run_cli: CliRunner, locks: Path
) -> None:
    env = dict(_env(locks, MACHINES / "no-driver.json"))
    done = run_cli("run", "--ddp", "-n", "2", "--", *_py("pass"), env=env)
    assert done.returncode == 3
    assert "add --cpu-ok (gpukit run --ddp --cpu-ok -n N -- CMD)" in done.stderr


def test_a_cpu_ok_ddp_run_says_one_line_of_its_own_and_no_torchrun_banner(
    run_cli: CliRunner, locks: Path
) -> None:
    env = {**_env(locks, MACHINES / "no-driver.json"), "OMP_NUM_THREADS": None}
    # One write each (print writes the text and its newline apart: two workers' lines could
    # interleave as "11\n\n").
    show = "import os; os.write(1, (os.environ['OMP_NUM_THREADS'] + '\\n').encode())"
    done = run_cli("run", "--ddp", "--cpu-ok", "-n", "2", "--", *_py(show), env=env)
    assert (done.returncode, done.stdout) == (0, "1\n1\n")
    said = [line for line in done.stderr.splitlines() if "GPUKIT_FAKE_NVML" not in line]
    assert said == [
        "gpukit run: no NVIDIA driver; running on the CPU (--cpu-ok, CUDA_VISIBLE_DEVICES='')."
    ]


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
    assert proc.stderr is not None
    seen = [proc.stderr.readline() for _ in range(2)]  # the fake machine, then the wait
    assert "waiting for 1 GPU" in seen[1]  # plain lines in a log, not a live line
    assert proc.poll() is None  # still waiting
    held.release()
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (0, "ran\n")


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
    _until(lambda: any((locks / "queue").glob("*.ticket")))  # it has joined the line
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
    launcher = ["-m", AGENT, "--standalone", "--nproc-per-node=4"]
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
    # Each worker writes its own file: two workers printing into one pipe may interleave.
    script.write_text(
        "import os, pathlib\n"
        "seen = [os.environ[k] for k in ('LOCAL_RANK', 'WORLD_SIZE', 'CUDA_VISIBLE_DEVICES')]\n"
        f"pathlib.Path({str(tmp_path)!r}, 'rank' + seen[0]).write_text(' '.join(seen))\n"
    )
    done = run_cli("run", "-n", "2", "--ddp", "--", "python", str(script), env=dict(_env(locks)))
    assert done.returncode == 0, done.stderr
    seen = sorted(p.read_text() for p in tmp_path.glob("rank*"))
    assert seen == ["0 2 0,1", "1 2 0,1"]


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


@pytest.mark.parametrize("columns", [80, 40])
def test_the_live_wait_status_inside_a_grant_fits_one_terminal_row(
    monkeypatch: pytest.MonkeyPatch, columns: int
) -> None:
    # A line longer than the terminal wraps, and rewritten in place it then prints twice.
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", str(columns))
    status = _Status()
    text = (
        "waiting for 1 GPU (no process on it, granted GPUs 3,5): 0 of 2 qualify, "
        "0 for 3 polls in a row; 2 waiters ahead"
    )
    status(text)
    [line] = terminal.getvalue().split("\r\033[K")[1:]
    assert len(line) <= columns - 1
    assert line.startswith("waiting f")
    assert line.endswith("2 waiters ahead [0:00]")


def test_a_live_wait_status_that_fits_the_terminal_is_shown_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", "80")
    _Status()("waiting for 1 GPU (no process on it): 0 of 2 qualify")
    assert (
        terminal.getvalue() == "\r\033[Kwaiting for 1 GPU (no process on it): 0 of 2 qualify [0:00]"
    )


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


def test_run_wait_for_more_gpus_than_nvml_can_read_fails_at_once_with_4(
    run_cli: CliRunner, locks: Path
) -> None:
    env = dict(_env(locks, MACHINES / "kaggle-2xT4-one-lost.json"))
    done = run_cli("run", "-n", "2", "--wait", "--", "true", env=env, timeout=60)
    assert done.returncode == 4, done.stderr
    assert "GPU 1: unreadable by NVML" in done.stderr
    assert "Waiting cannot help: only 1 could ever qualify" in done.stderr


@pytest.mark.parametrize("exclude", ["7", "²", "GPU-ffff", "0,9"])
@pytest.mark.parametrize("command", ["run", "pick"])
def test_an_exclusion_the_machine_does_not_have_is_a_usage_error(
    run_cli: CliRunner, locks: Path, exclude: str, command: str
) -> None:
    tail = ["--wait", "--", "true"] if command == "run" else []
    done = run_cli(command, "--exclude", exclude, *tail, env=dict(_env(locks)), timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Cannot exclude" in done.stderr
    assert "Traceback" not in done.stderr
    assert current_claims(locks) == {}


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-2", "1e12"])
@pytest.mark.parametrize("wait", [(), ("--wait",), ("--poll", "1")], ids=["now", "wait", "poll"])
def test_run_refuses_a_poll_interval_variable_that_is_not_seconds_in_one_line(
    run_cli: CliRunner, locks: Path, value: str, wait: tuple[str, ...]
) -> None:
    env = {**_env(locks), "GPUKIT_POLL_INTERVAL": value}
    done = run_cli("run", *wait, "--", "true", env=dict(env), timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "fake machine" not in line]
    assert len(lines) == 1, done.stderr
    assert "GPUKIT_POLL_INTERVAL" in lines[0]


def test_run_refuses_a_poll_interval_longer_than_a_year_in_one_line(
    run_cli: CliRunner, locks: Path
) -> None:
    # time.sleep(1e12) raises OverflowError: the wait would end in a traceback.
    done = run_cli("run", "--wait", "--poll", "1e12", "--", "true", env=dict(_env(locks)))
    assert done.returncode == 2, done.stderr
    assert "--poll" in done.stderr
    assert "Traceback" not in done.stderr


def test_run_says_in_one_plain_line_that_a_claim_is_not_in_the_ledger(
    run_cli: CliRunner, locks: Path
) -> None:
    locks.mkdir(mode=0o1777)
    for n in range(8):  # every name this user's ledger may take, squatted (here by folders)
        (locks / ledger_name(os.geteuid(), n)).mkdir()
    done = run_cli("run", "-n", "1", "--", "true", env=dict(_env(locks)))
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "ledger" in line]
    assert line.startswith("gpukit run: warning: Cannot write the gpukit ledger")
    assert line.endswith("The claim is not in the ledger.")
    assert "RuntimeWarning" not in done.stderr


def _no_room_to_write() -> None:
    # As on a full disk: files can be made, nothing can be written into them.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


@pytest.mark.parametrize("wait", [(), ("--wait", "--timeout", "5")], ids=["now", "wait"])
def test_run_in_a_lock_folder_it_cannot_write_into_exits_5_in_one_line(
    locks: Path, wait: tuple[str, ...]
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "run", *wait, "--", "true"],
        env=_env(locks),
        preexec_fn=_no_room_to_write,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 5, done.stderr
    assert "Traceback" not in done.stderr
    assert current_claims(locks) == {}
    queue = locks / "queue"
    assert not queue.exists() or list(queue.iterdir()) == []  # no ticket left behind


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_run_warns_about_a_policy_file_a_co_user_wrote_and_applies_no_limit(
    run_cli: CliRunner, locks: Path
) -> None:
    locks.mkdir(mode=0o1777)
    policy = locks / "policy.toml"
    policy.write_text("[limits]\nmax_gpus_per_user = 0\n")
    os.chown(policy, 65534, 65534)
    done = run_cli("run", "-n", "2", "--", "true", env=dict(_env(locks)))
    assert done.returncode == 0, done.stderr
    assert "warning:" in done.stderr
    assert "it is not a policy and sets no limit" in done.stderr


def test_run_past_the_users_limit_exits_4_naming_the_limit(run_cli: CliRunner, locks: Path) -> None:
    locks.mkdir(mode=0o1777)
    (locks / "policy.toml").write_text("[limits]\nmax_gpus_per_user = 1\n")
    done = run_cli("run", "-n", "2", "--wait", "--", "true", env=dict(_env(locks)))
    assert done.returncode == 4, done.stderr
    assert "allows 1 per user (max_gpus_per_user)" in done.stderr
    assert "Waiting cannot help" in done.stderr


_FORGER = (
    "import fcntl, json, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "record = json.loads(sys.argv[2]); record['pid'] = os.getpid()\n"
    "os.write(fd, json.dumps(record).encode())\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_forged_early_ticket_made_after_an_honest_waiter_does_not_delay_it(
    locks: Path,
) -> None:
    import json

    from gpukit.holders import user_name

    uuids = _l4_uuids()
    others = claim(uuids[1:], folder=locks)
    held = claim(uuids[:1], folder=locks)
    waiter = _spawn(locks, "run", "--wait", *FAST, "--", *_py("print('served')"))
    _until(lambda: len(list((locks / "queue").glob("*.ticket"))) == 1)
    record = {
        "schema": "gpukit.ticket/1",
        "user": user_name(os.getuid()),
        "uid": os.getuid(),
        "n": 1,
        "criteria": "",
        "command": "jump",
        "since": 0.0,
    }
    forged = locks / "queue" / "00000000000000000000-1-ffffffff.ticket"
    forger = subprocess.Popen(
        [sys.executable, "-c", _FORGER, str(forged), json.dumps(record)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert forger.stdout is not None
        assert forger.stdout.readline() == "locked\n"
        held.release()
        out, err = waiter.communicate(timeout=30)
        assert (waiter.returncode, out) == (0, "served\n"), err
        assert forger.poll() is None  # served while the forged ticket was still held
    finally:
        forger.kill()
        forger.wait()
        others.release()


def test_a_fifo_among_tickets_never_blocks_a_waiter_and_its_timeout_holds(
    run_cli: CliRunner, locks: Path
) -> None:
    (locks / "queue").mkdir(parents=True)
    os.mkfifo(locks / "queue" / "00000000000000000000-1-ffffffff.ticket")
    with claim(_l4_uuids(), folder=locks):
        done = run_cli(
            "run",
            "--wait",
            "--timeout",
            "0.5",
            *FAST,
            "--",
            "true",
            env=dict(_env(locks)),
            timeout=30,
        )
    assert done.returncode == 124, done.stderr
    done = run_cli("run", "--wait", *FAST, "--", "true", env=dict(_env(locks)), timeout=30)
    assert done.returncode == 0, done.stderr
