"""Per-user limits from the administrator's policy.toml in the lock folder."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpukit as gk
from gpukit.errors import PolicyError, UserLimitError
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.sharing.claims import claim
from gpukit.sharing.lockfiles import open_folder
from gpukit.sharing.policy import Limits, Policy, holdings, load_policy, user_name
from tests.helpers import MACHINES, ROOT, CliRunner

L4 = MACHINES / "server-4xL4-idle.json"
ME = os.getuid()


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    folder.mkdir()
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


def _policy(locks: Path, text: str, mode: int = 0o644) -> Path:
    path = locks / "policy.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_no_policy_file_means_no_limits(locks: Path) -> None:
    assert load_policy() == Policy()
    with gk.acquire(4):
        pass


def test_the_administrators_policy_sets_the_limit(locks: Path) -> None:
    path = _policy(locks, "[limits]\nmax_gpus_per_user = 2\n")
    assert load_policy() == Policy(Limits(max_gpus_per_user=2), path=path)


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_policy_others_could_write_is_refused(locks: Path, mode: int) -> None:
    _policy(locks, "[limits]\nmax_gpus_per_user = 2\n", mode)
    with pytest.raises(PolicyError, match="writable by others") as info:
        load_policy()
    assert "chmod go-w" in str(info.value)
    with pytest.raises(PolicyError):
        gk.acquire()


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("[limits]\nmax_gpu_per_user = 2\n", "limits.max_gpu_per_user"),
        ("[limit]\nmax_gpus_per_user = 2\n", "limit"),
        ("[limits]\nmax_gpus_per_user = '2'\n", "'2'"),
        ("[limits]\nmax_gpus_per_user = true\n", "True"),
        ("[limits]\nmax_gpus_per_user = -1\n", "-1"),
        ("[limits]\nmax_gpus_per_user = 2.5\n", "2.5"),
        ("limits = 3\n", "not a table"),
        ("[limits\n", "Cannot read"),
    ],
)
def test_a_malformed_policy_is_refused_not_guessed(locks: Path, text: str, what: str) -> None:
    _policy(locks, text)
    with pytest.raises(PolicyError) as info:
        load_policy()
    assert what in info.value.message


def test_a_policy_that_is_a_link_is_refused(locks: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.toml"
    target.write_text("[limits]\nmax_gpus_per_user = 9\n")
    (locks / "policy.toml").symlink_to(target)
    with pytest.raises(PolicyError, match="not a plain file"):
        load_policy()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_policy_file_of_another_user_is_not_a_policy(locks: Path) -> None:
    path = _policy(locks, "[limits]\nmax_gpus_per_user = 0\n")
    os.chown(path, 65534, 65534)
    policy = load_policy()
    assert policy.limits == Limits()
    assert policy.ignored is not None
    assert f"belongs to {user_name(65534)}" in policy.ignored
    with gk.acquire():
        pass


def test_holdings_count_claims_by_the_user_running_the_holder_whatever_the_record_says(
    locks: Path,
) -> None:
    gpus = inventory().gpus
    with claim(gpus[:2]):
        for gpu in gpus[:2]:  # a record that blames someone else changes nothing
            record = {"user": "mallory", "pid": 1, "host": "h", "command": "x", "since": 0}
            (locks / f"{gpu.uuid}.lock").write_text(json.dumps(record))
        assert holdings() == {ME: (gpus[0].uuid, gpus[1].uuid)}
    assert holdings() == {}


def test_a_claim_past_the_limit_is_refused_with_4_naming_the_limit_and_holdings(
    locks: Path,
) -> None:
    _policy(locks, "[limits]\nmax_gpus_per_user = 2\n")
    gpus = inventory().gpus
    with claim(gpus[:1]), gk.acquire(1):  # 1 held + 1 = 2: allowed
        with pytest.raises(UserLimitError) as info:
            gk.acquire(1)
        with pytest.raises(UserLimitError):
            gk.pick(1)
    assert info.value.exit_code == 4
    message = info.value.message
    assert "allows 2 per user (max_gpus_per_user)" in message
    assert f"{user_name(ME)} already holds 2" in message
    assert gpus[0].uuid in message


def test_asking_for_more_than_the_limit_fails_at_once_even_with_wait(locks: Path) -> None:
    _policy(locks, "[limits]\nmax_gpus_per_user = 2\n")
    with pytest.raises(UserLimitError, match="allows 2 per user") as info:
        gk.acquire(3, wait=True, timeout=600, poll=600)
    assert "Waiting cannot help" in str(info.value)


def test_a_waiter_at_its_limit_waits_until_its_own_claims_drop(locks: Path) -> None:
    _policy(locks, "[limits]\nmax_gpus_per_user = 1\n")
    mine = claim(inventory().gpus[:1])
    polls: list[int] = []

    def read() -> Inventory:
        polls.append(1)
        if len(polls) == 3:
            mine.release()  # three GPUs were free all along: only the limit held it back
        return inventory()

    statuses: list[str] = []
    with gk.acquire(wait=True, poll=0.01, settle=1, read=read, on_status=statuses.append):
        assert len(polls) == 3
    assert "user limit 1 reached" in statuses[0]


def test_the_queue_view_can_say_a_waiter_is_held_back_by_its_limit() -> None:
    policy = Policy(Limits(max_gpus_per_user=2))
    held = {1001: ("GPU-a", "GPU-b"), 1002: ("GPU-c",)}
    assert policy.refusal(1001, 1, held) == "user limit 2 reached"
    assert policy.refusal(1002, 1, held) is None
    assert policy.refusal(1002, 2, held) == "user limit 2 reached"
    assert policy.refusal(1003, 3, held) == "user limit 2 is below 3"
    assert Policy().refusal(1001, 8, held) is None


_NOBODY = 65534
_HOLD_AND_WAIT = """
import sys
from pathlib import Path
from gpukit.sharing.claims import claim
from gpukit.sharing.tickets import Ticket
locks, uuid = Path(sys.argv[1]), sys.argv[2]
held = claim([uuid], folder=locks)
ticket = Ticket(locks, n=1, command="more please")
print("ready", flush=True)
sys.stdin.read()
"""


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)


def _python_for_nobody() -> str | None:
    """An interpreter another user may run (a virtual environment under /root is not)."""
    import subprocess
    import sys

    for python in (sys.executable, "/usr/bin/python3"):
        try:
            probe = subprocess.run(
                [python, "-c", "import gpukit.sharing.tickets"],
                env={"PYTHONPATH": str(ROOT / "src")},
                preexec_fn=_as_nobody,
                capture_output=True,
                check=False,
            )
        except OSError:
            continue
        if probe.returncode == 0:
            return python
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="running as a second user needs root")
def test_a_waiter_held_back_by_its_users_limit_does_not_hold_up_the_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shutil
    import subprocess
    import tempfile

    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter that another user may run")
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    shared.chmod(0o755)
    locks = shared / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(locks))
    other = None
    try:
        os.close(open_folder(locks, create=True))
        _policy(locks, "[limits]\nmax_gpus_per_user = 1\n")
        gpu0 = inventory().gpus[0].uuid
        # nobody holds GPU 0 and waits in line for one more: its limit holds it back.
        other = subprocess.Popen(
            [python, "-c", _HOLD_AND_WAIT, str(locks), gpu0],
            env={"PYTHONPATH": str(ROOT / "src")},
            preexec_fn=_as_nobody,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert other.stdout is not None
        assert other.stdout.readline() == "ready\n"
        from gpukit.sharing.waiters import read_queue

        (first,) = read_queue(locks).waiters
        assert (first.uid, first.command) == (_NOBODY, "more please")
        assert holdings(locks) == {_NOBODY: (gpu0,)}
        assert load_policy(locks).refusal(first.uid, first.n, holdings(locks)) == (
            "user limit 1 reached"
        )
        # Three GPUs are free: the next user in line is served at once, not behind nobody.
        with gk.acquire(wait=True, timeout=20, poll=0.01, settle=1) as held:
            assert gpu0 not in held.uuids
    finally:
        if other is not None:
            other.kill()
            other.wait()
        shutil.rmtree(shared)


_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet="abc12 ", max_size=4).map(json.dumps),
    st.lists(st.integers(0, 9), max_size=3),
).map(lambda v: json.dumps(v) if isinstance(v, list) else v)


@given(
    st.dictionaries(
        st.sampled_from(["max_gpus_per_user", "max_hours", "limit"]), _VALUES, max_size=2
    ),
    st.sampled_from(["limits", "limit", "other"]),
)
def test_a_policy_is_read_exactly_or_refused_with_a_policy_error(
    entries: dict[str, object], table: str
) -> None:
    from gpukit.sharing.policy import _parse

    def toml(value: object) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    text = f"[{table}]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in entries.items())
    value = entries.get("max_gpus_per_user")
    good = (
        table == "limits"
        and set(entries) <= {"max_gpus_per_user"}
        and (value is None or (type(value) is int and value >= 0))
    )
    if good:
        assert _parse(text.encode(), Path("policy.toml")) == Limits(max_gpus_per_user=value)  # type: ignore[arg-type]
    else:
        with pytest.raises(PolicyError):
            _parse(text.encode(), Path("policy.toml"))


@given(st.binary(max_size=100))
def test_any_bytes_in_a_policy_are_read_or_refused_with_a_policy_error(data: bytes) -> None:
    from gpukit.sharing.policy import _parse

    with contextlib.suppress(PolicyError):
        _parse(data, Path("policy.toml"))


def test_hard_links_to_a_held_lock_file_under_other_names_count_as_no_more_gpus(
    locks: Path,
) -> None:
    _policy(locks, "[limits]\nmax_gpus_per_user = 2\n")
    gpus = inventory().gpus
    with claim(gpus[:1]):
        # Lock files are 0666: a co-user can give the one this user holds more names, among
        # them names that sort first and the name of another GPU of the machine.
        held = locks / f"{gpus[0].uuid}.lock"
        for name in ("AAA.lock", "extra.lock", "GPU-not-on-this-machine.lock", gpus[3].uuid):
            os.link(held, locks / (name if name.endswith(".lock") else f"{name}.lock"))
        assert holdings() == {ME: (gpus[0].uuid,)}
        with gk.acquire(1) as second:  # 1 held + 1 = 2: allowed
            assert second.uuids[0] not in (gpus[0].uuid, gpus[3].uuid)
            with pytest.raises(UserLimitError, match="already holds 2"):
                gk.acquire(1)


def test_a_lock_file_of_no_gpu_nvml_reports_is_not_a_gpu_held(locks: Path) -> None:
    gpus = inventory().gpus
    with claim(["GPU-00000000-0000-0000-0000-0000000000ff"]), claim(gpus[1:2]):
        assert holdings() == {ME: (gpus[1].uuid,)}
        assert holdings(gpus=["GPU-00000000-0000-0000-0000-0000000000ff"]) == {
            ME: ("GPU-00000000-0000-0000-0000-0000000000ff",)
        }


@pytest.mark.parametrize(
    "text",
    [
        "[limits]\nmax_gpus_per_user = " + "[" * 50_000 + "\n",
        "x = " + "{a = " * 50_000 + "\n",
        "[limits]\nmax_gpus_per_user = " + "[" * 40 + "1" + "]" * 40 + "\n",
        "[limits]\nmax_gpus_per_user = inf\n",
        "[limits]\nmax_gpus_per_user = 2\n" + "#" * 70_000 + "\n",
    ],
    ids=["deep-array", "deep-inline-table", "nested-list-value", "infinite", "over-64-KiB"],
)
def test_a_hostile_policy_of_the_folder_owner_is_a_policy_error_not_a_crash(
    locks: Path, run_cli: CliRunner, text: str
) -> None:
    path = _policy(locks, text)
    with pytest.raises(PolicyError) as info:
        load_policy()
    assert str(path) in info.value.message
    assert info.value.hint
    done = run_cli(
        "run", "--", "true", env={"GPUKIT_LOCK_DIR": str(locks), "GPUKIT_FAKE_NVML": str(L4)}
    )
    assert done.returncode == 5, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{path}" in done.stderr
