"""`gpukit queue`, run as users of a shared server run it: subprocesses against fake machines."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpukit.sharing.report import SCHEMA
from gpukit.sharing.usage import held_runs
from tests.helpers import MACHINES, ROOT

if TYPE_CHECKING:
    from tests.helpers import CliRunner

L4 = MACHINES / "server-4xL4-idle.json"
NOBODY = 65534


@pytest.fixture
def locks(tmp_path: Path) -> Path:
    return tmp_path / "locks"


def _env(locks: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "GPUKIT_FAKE_NVML": str(L4),
        "GPUKIT_LOCK_DIR": str(locks),
        **extra,
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _holder(locks: Path, gpus: str, **popen: Any) -> subprocess.Popen[str]:
    """``gpukit run`` holding ``gpus`` (NVML indices) until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "run", "-n", str(len(gpus.split(","))), "--exclude",
         ",".join(str(i) for i in range(4) if str(i) not in gpus.split(",")),
         "--", sys.executable, "-c", "import sys; print('held', flush=True); sys.stdin.read()"],
        env=_env(locks),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        **popen,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen[str]) -> int:
    assert proc.stdin is not None
    proc.stdin.close()
    return proc.wait(timeout=60)


def test_queue_json_lists_the_holder_of_each_claim(run_cli: CliRunner, locks: Path) -> None:
    holder = _holder(locks, "1,2")
    try:
        result = run_cli(
            "queue", "--json", env={"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}
        )
    finally:
        _stop(holder)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == SCHEMA
    [claim] = data["holders"]
    assert (claim["gpus"], claim["pid"]) == ([1, 2], holder.pid)
    assert claim["command"].endswith("sys.stdin.read()'")
    assert (data["waiters"], data["unclaimed"], data["idle"]) == ([], [], [])
    assert data["idle_after_s"] == 1800


def test_queue_table_names_holder_and_says_nobody_waits(run_cli: CliRunner, locks: Path) -> None:
    holder = _holder(locks, "3")
    try:
        result = run_cli("queue", env={"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)})
    finally:
        _stop(holder)
    assert result.returncode == 0, result.stderr
    line = next(row for row in result.stdout.splitlines() if str(holder.pid) in row)
    assert line.split()[0] == "3"
    assert "nobody is waiting" in result.stdout


@pytest.mark.parametrize(
    "option",
    [
        ["--idle-after", "0"],
        ["--idle-after", "nan"],
        ["--idle-after", "1e400"],
        ["--watch", "-1"],
        ["--watch", "inf"],
        ["--watch", "1e12"],
    ],
)
def test_queue_refuses_a_threshold_or_interval_that_is_not_a_sensible_number_with_exit_2(
    run_cli: CliRunner, locks: Path, option: list[str]
) -> None:
    result = run_cli(
        "queue", *option, env={"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert option[0] in result.stderr


def test_queue_never_imports_torch(locks: Path) -> None:
    code = (
        "import sys; from gpukit.cli.main import main; rc = main(['queue', '--json']);"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(locks), check=True
    )
    assert out.stderr.strip().splitlines()[-1] == "False"


def _samples(proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield json.loads(line)


@pytest.mark.slow
def test_16_waiters_on_4_gpus_are_all_listed_in_arrival_order_and_never_share_a_gpu(
    locks: Path, tmp_path: Path
) -> None:
    env = _env(locks)
    # Each command holds its GPU until the watch has shown it holding (the test then leaves a
    # file named for its gpukit run), so no state can pass between two samples unseen.
    hold = (
        "import os, pathlib, time\n"
        f"done = pathlib.Path({str(tmp_path)!r}, f'done-{{os.getppid()}}')\n"
        "while not done.exists(): time.sleep(0.02)\n"
    )
    runs = []
    watch = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "queue", "--json", "--watch", "0.05"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert watch.stdout is not None
    samples = [json.loads(watch.stdout.readline())]  # the watch runs before anyone joins
    try:
        for _ in range(16):
            runs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gpukit",
                        "run",
                        "-n",
                        "1",
                        "--wait",
                        "--poll",
                        "0.1",
                        "--settle",
                        "1",
                        "--",
                        sys.executable,
                        "-c",
                        hold,
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        released: set[int] = set()
        deadline = time.monotonic() + 300
        while len(released) < 16 and time.monotonic() < deadline:
            sample = json.loads(watch.stdout.readline())
            samples.append(sample)
            for holder in sample["holders"]:
                if holder["pid"] not in released:
                    released.add(holder["pid"])
                    (tmp_path / f"done-{holder['pid']}").touch()
        codes = [p.wait(timeout=60) for p in runs]
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.wait()
        watch.send_signal(signal.SIGINT)
        out, _ = watch.communicate(timeout=60)
    assert codes == [0] * 16
    assert watch.returncode == 0  # Ctrl-C ends a watch as a finished one
    samples += [json.loads(line) for line in out.splitlines()]
    pids = {p.pid for p in runs}
    # What each gpukit run was at each sample: "w" waiting, "h" holding, "." neither.
    states: dict[int, str] = {pid: "" for pid in pids}
    for sample in samples:
        holding = [h["pid"] for h in sample["holders"]]
        waiting = [w["pid"] for w in sample["waiters"]]
        gpus = [g for h in sample["holders"] for g in h["gpus"]]
        assert len(gpus) == len(set(gpus)), f"a GPU in two claims: {sample['holders']}"
        assert [w["position"] for w in sample["waiters"]] == list(range(1, len(waiting) + 1))
        for pid in pids:
            states[pid] += "h" if pid in holding else "w" if pid in waiting else "."
    for pid, seen in states.items():
        # Nobody is missing between joining the line and leaving with their GPUs done:
        # each run reads, over time, as not yet started, waiting, holding, finished.
        shape = seen.strip(".")
        assert "." not in shape, f"pid {pid} missing from some samples: {seen}"
        assert "hw" not in shape, f"pid {pid} back in line after holding: {seen}"
        assert "h" in shape, f"pid {pid} never seen holding: {seen}"
    # Served in the order of the line: whoever was ahead in any sample claimed first.
    started = {r.pid: r.start for r in held_runs(locks)}
    assert len(started) == 16
    for sample in samples:
        order = [w["pid"] for w in sample["waiters"]]
        assert [started[p] for p in order] == sorted(started[p] for p in order)
    # No two claims of one GPU overlapped in time.
    runs_by_gpu: dict[str, list[tuple[float, float]]] = {}
    for run in held_runs(locks):
        assert run.end is not None
        for gpu in run.gpus:
            runs_by_gpu.setdefault(gpu, []).append((run.start, run.end))
    for spans in runs_by_gpu.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@pytest.fixture
def shared_locks() -> Iterator[Path]:
    """A lock folder that another user can reach (pytest's own tmp folder is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="gpukit-queue-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base / "locks"
    finally:
        shutil.rmtree(base)


def _as_nobody(folder: str, out: Any) -> None:
    """As user nobody: claim GPU 1, run `gpukit queue --json`, release, `gpukit usage --json`.

    A forked child that switches user, since nobody may not read this Python's files: every
    module it needs is imported before the switch.
    """
    import contextlib
    import io

    from gpukit.cli.main import main
    from gpukit.sharing.claims import claim

    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    printed = {}
    held = claim(["GPU-4a1d2e10-5b7c-4f3e-9d21-0c6e8f1a2b02"], command="theirs")
    for name, argv in (("queue", ["queue", "--json"]), ("usage", ["usage", "--json"])):
        if name == "usage":
            held.release(exit_code=0)
        with contextlib.redirect_stdout(io.StringIO()) as text:
            code = main(argv)
        printed[name] = (code, text.getvalue())
    out.send(printed)


@pytest.mark.skipif(os.getuid() != 0, reason="running as another user needs root")
def test_another_user_than_the_lock_folders_creator_can_claim_queue_and_count_usage(
    shared_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import multiprocessing
    import pwd

    # Imported before the child stops being root, who alone may read this Python's files.
    for module in (
        "encodings.ascii",
        "gpukit.cli.queue",
        "gpukit.cli.usage",
        "gpukit.gpus.fake_nvml",
    ):
        importlib.import_module(module)

    # The machine description too: that user may not read this checkout (a 0700 clone).
    machine = shutil.copy(L4, shared_locks.parent / L4.name)
    os.chmod(machine, 0o644)
    for key, value in _env(shared_locks, GPUKIT_FAKE_NVML=str(machine)).items():
        monkeypatch.setenv(key, value)
    root_holds = _holder(shared_locks, "0")
    try:
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_as_nobody, args=(str(shared_locks), send))
        child.start()
        while child.is_alive() and not receive.poll(0.1):
            pass
        printed = receive.recv() if receive.poll() else {}
        child.join(timeout=60)
    finally:
        _stop(root_holds)
    assert child.exitcode == 0
    nobody = pwd.getpwuid(NOBODY).pw_name
    code, queue = printed["queue"]
    assert code == 0
    holders = {tuple(h["gpus"]): h["user"] for h in json.loads(queue)["holders"]}
    assert holders == {(0,): "root", (1,): nobody}
    code, usage = printed["usage"]
    assert code == 0
    counted = {u["user"]: (u["runs"], u["held_now"]) for u in json.loads(usage)["users"]}
    assert counted == {"root": (1, 1), nobody: (1, 0)}
    ledger_files = {p.name: p.stat().st_uid for p in shared_locks.glob("ledger-*.jsonl")}
    assert ledger_files == {"ledger-0.jsonl": 0, f"ledger-{NOBODY}.jsonl": NOBODY}


def test_queue_shows_each_waiters_command_in_its_table_and_its_json(
    run_cli: CliRunner, locks: Path
) -> None:
    from gpukit.sharing.tickets import Ticket

    env: dict[str, str | None] = {"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}
    with Ticket(locks, command="python train.py --lr 3"):
        table = run_cli("queue", env=env)
        data = json.loads(run_cli("queue", "--json", env=env).stdout)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if str(os.getpid()) in line)
    assert row.rstrip().endswith("python train.py --lr 3")
    assert [w["command"] for w in data["waiters"]] == ["python train.py --lr 3"]


def test_queue_lists_the_first_few_junk_entries_and_says_how_many_more_there_are(
    run_cli: CliRunner, locks: Path
) -> None:
    queue = locks / "queue"
    queue.mkdir(parents=True)
    for i in range(2000):
        (queue / f"junk-{i:05d}").touch()
    env: dict[str, str | None] = {"GPUKIT_FAKE_NVML": str(L4), "GPUKIT_LOCK_DIR": str(locks)}
    table = run_cli("queue", env=env)
    data = json.loads(run_cli("queue", "--json", env=env).stdout)
    assert table.returncode == 0, table.stderr
    assert len(table.stdout) < 5000
    assert "junk-00000" in table.stdout
    assert "1980 more not listed (the first 20 by name are shown)" in table.stdout
    assert (len(data["foreign"]), data["foreign_not_listed"]) == (20, 1980)


def test_a_holder_without_an_account_has_one_name_in_gpukit_list_and_gpukit_queue(
    locks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pwd

    from gpukit.cli.main import main
    from gpukit.gpus.inventory import inventory
    from gpukit.sharing.claims import claim

    for name, value in _env(locks).items():
        monkeypatch.setenv(name, value)
    real = pwd.getpwuid

    def no_account(uid: int) -> pwd.struct_passwd:
        if uid == os.getuid():
            raise KeyError(uid)
        return real(uid)

    gpu = inventory().gpu(0)
    with claim([gpu]):
        monkeypatch.setattr(pwd, "getpwuid", no_account)
        capsys.readouterr()
        assert main(["list", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)["claims"][gpu.uuid]["user"]
        assert main(["queue", "--json"]) == 0
        (queued,) = json.loads(capsys.readouterr().out)["holders"]
    assert listed == queued["user"] == f"uid {os.getuid()}"
