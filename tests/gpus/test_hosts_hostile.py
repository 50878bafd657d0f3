"""A hostile or broken host costs its own row of `gpukit list --hosts`, never the others'.

Each host's answer is data another machine wrote: nested without end, numbers that overflow,
escape sequences for the terminal, answers that never end, more GPUs than a machine has.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukit.gpus.hosts import MAX_GPUS, parse_answer, parse_nvidia_smi_csv, read_hosts
from gpukit.gpus.inventory import SCHEMA
from tests.helpers.hosts import FakeHosts

if TYPE_CHECKING:
    from tests.helpers import CliRunner

ESCAPE = "\x1b]0;owned\x07\x1b[2J"
SMI = "0, GPU-x, Tesla T4, 00000000:00:04.0, 15360, {used}, 15360, 3, 0, 40, {power}, 70, 535"


def _inventory(**gpu: object) -> str:
    base: dict[str, object] = {"index": 0, "uuid": "GPU-a", "name": "Tesla T4"}
    return json.dumps({"schema": SCHEMA, "gpus": [{**base, **gpu}]})


@pytest.fixture
def hosts(tmp_path: Path) -> FakeHosts:
    return FakeHosts(tmp_path / "hosts")


def _strict(text: str) -> object:
    def refuse(name: str) -> object:
        raise AssertionError(f"{name} in the JSON output")

    return json.loads(text, parse_constant=refuse)


HOSTILE = {
    "deep JSON": "{" + '"a":[' * 100_000,
    "a 340-digit memory reading": _inventory(memory_used=10**340, memory_total=10**340),
    "NaN power": _inventory(power_draw_w=float("nan")),
    "a memory reading of 1e999 MiB": SMI.format(used="1e999", power="27").replace("T4", "X1"),
    "nan watts": SMI.format(used="0", power="nan").replace("T4", "X1"),
}


@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
def test_one_hostile_answer_is_that_hosts_error_row_and_the_others_are_shown(
    run_cli: CliRunner, hosts: FakeHosts, answer: str
) -> None:
    hosts.nvidia_smi("good")
    hosts.answering("bad", answer, via="gpukit" if answer.startswith("{") else "nvidia-smi")
    result = run_cli("list", "--hosts", "bad,good", "--ssh-command", hosts.ssh)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    [bad] = [line for line in result.stdout.splitlines() if line.startswith("bad")]
    assert "answer not understood" in bad
    assert sum("Tesla T4" in line for line in result.stdout.splitlines()) == 2


@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
def test_list_hosts_json_holds_no_nan_or_infinity_whatever_a_host_answers(
    run_cli: CliRunner, hosts: FakeHosts, answer: str
) -> None:
    hosts.answering("bad", answer, via="gpukit" if answer.startswith("{") else "nvidia-smi")
    hosts.nvidia_smi("good")
    result = run_cli("list", "--hosts", "bad,good", "--json", "--ssh-command", hosts.ssh)
    assert result.returncode == 0, result.stderr
    doc = _strict(result.stdout)
    assert isinstance(doc, dict)
    assert doc["hosts"][0]["error"].startswith("answer not understood")


def test_terminal_escapes_in_a_hosts_json_answer_never_reach_the_terminal(
    run_cli: CliRunner, hosts: FakeHosts
) -> None:
    process = {"pid": 7, "user": f"eve{ESCAPE}", "command": f"x{ESCAPE}", "used_memory": 1}
    claim = {"user": f"mallory{ESCAPE}", "pid": 8, "command": f"y{ESCAPE}", "since": 1.0}
    answer = json.loads(_inventory(name=f"T4{ESCAPE}", processes=[process]))
    answer["claims"] = {"GPU-a": claim}
    hosts.answering("evil", json.dumps(answer))
    result = run_cli("list", "--hosts", "evil", "--ssh-command", hosts.ssh, env={"COLUMNS": "300"})
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "\x07" not in result.stdout
    for shown in ("T4?]0;owned??[2J", "eve?]0;owned", "mallory?]0;owned"):
        assert shown in result.stdout


def test_terminal_escapes_in_nvidia_smi_names_and_ssh_messages_never_reach_the_terminal(
    run_cli: CliRunner, hosts: FakeHosts
) -> None:
    hosts.answering(
        "smi", SMI.format(used="0", power="27").replace("Tesla T4", ESCAPE + "T4"), via="nvidia-smi"
    )
    hosts.script("fails", "gpukit", f"printf '%s\\n' 'no {ESCAPE} way' >&2; exit 1\n")
    result = run_cli(
        "list", "--hosts", "smi,fails", "--ssh-command", hosts.ssh, env={"COLUMNS": "300"}
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "?]0;owned??[2JT4" in result.stdout
    assert "failed: no ?]0;owned??[2J way" in result.stdout


def test_strings_of_a_hosts_answer_are_printable_once_parsed() -> None:
    reading = parse_answer("h", _inventory(name=f"T4{ESCAPE}", pci_bus_id=f"0{ESCAPE}"))
    assert reading.inventory is not None
    gpu = reading.inventory.gpus[0]
    assert gpu.name.isprintable()
    assert gpu.pci_bus_id is not None
    assert gpu.pci_bus_id.isprintable()


def test_an_endless_answer_is_cut_at_the_limit_and_its_ssh_killed(hosts: FakeHosts) -> None:
    # 64 MiB then silence with the pipe held open: read whole, it would wait for --timeout.
    hosts.script("flood", "gpukit", "head -c 67108864 /dev/zero; sleep 600\n")
    hosts.nvidia_smi("good")
    start = time.monotonic()
    flood, good = read_hosts(["flood", "good"], timeout=30, ssh_command_text=hosts.ssh)
    assert flood.error == "answer larger than 4 MiB; not read"
    assert time.monotonic() - start < 30
    assert good.inventory is not None
    assert hosts.live_processes() == []


def test_endless_messages_on_stderr_are_cut_at_their_limit(hosts: FakeHosts) -> None:
    hosts.script("chatty", "gpukit", "head -c 8388608 /dev/zero >&2; sleep 600\n")
    start = time.monotonic()
    [reading] = read_hosts(["chatty"], timeout=30, ssh_command_text=hosts.ssh)
    assert reading.error == "messages larger than 64 KiB; not read"
    assert time.monotonic() - start < 30
    assert hosts.live_processes() == []


def test_a_host_listing_more_gpus_than_a_machine_has_is_refused_with_the_limit() -> None:
    gpu = {"index": 0, "uuid": "GPU-a", "name": "T4"}
    payload = {"schema": SCHEMA, "gpus": [gpu] * (MAX_GPUS + 1)}
    reading = parse_answer("h", json.dumps(payload))
    assert reading.error is not None
    assert f"more than the {MAX_GPUS} gpukit reads" in reading.error
    csv = "\n".join([SMI.format(used="0", power="27")] * (MAX_GPUS + 1))
    reading = parse_answer("h", csv)
    assert reading.error is not None
    assert f"more than the {MAX_GPUS} gpukit reads" in reading.error


def test_a_host_with_max_gpus_is_read_whole() -> None:
    csv = "\n".join(
        SMI.format(used="0", power="27").replace("0, GPU-x", f"{i}, GPU-{i}", 1)
        for i in range(MAX_GPUS)
    )
    assert len(parse_nvidia_smi_csv(csv).gpus) == MAX_GPUS


def test_the_power_limit_read_through_nvidia_smi_is_the_enforced_one(hosts: FakeHosts) -> None:
    # A stand-in nvidia-smi answering each queried field; the board's default limit (power.limit,
    # 70 W) differs from what the driver enforces (enforced.power.limit, 60 W), as after
    # `nvidia-smi -pl 60`.
    hosts.script(
        "capped",
        "nvidia-smi",
        'fields=$(printf "%s" "$1" | sed "s/^--query-gpu=//")\n'
        "line=''\n"
        "IFS=,; for f in $fields; do\n"
        '  case "$f" in\n'
        "    index) v=0;; uuid) v=GPU-x;; name) v='Tesla T4';; power.draw) v=27;;\n"
        "    power.limit) v=70;; enforced.power.limit) v=60;; *) v=1;;\n"
        "  esac\n"
        '  line="$line${line:+, }$v"\n'
        "done\n"
        'echo "$line"\n',
    )
    [reading] = read_hosts(["capped"], timeout=60, ssh_command_text=hosts.ssh)
    assert reading.inventory is not None, reading.error
    assert reading.inventory.gpus[0].power_limit_w == 60


_HOSTILE_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats()  # NaN and infinities included
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    [
        "index",
        "uuid",
        "name",
        "memory_total",
        "memory_used",
        "memory_free",
        "utilization_gpu",
        "temperature_c",
        "power_draw_w",
        "power_limit_w",
        "processes",
        "mig_instances",
        "mig_mode",
        "compute_capability",
        "error",
        "pci_bus_id",
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.dictionaries(_FIELDS, _HOSTILE_JSON, max_size=6), max_size=3),
    st.dictionaries(
        st.sampled_from(["claims", "driver_version", "taken_at", "source"]), _HOSTILE_JSON
    ),
    st.integers(min_value=0, max_value=200),
)
def test_any_hostile_document_from_a_host_is_read_or_refused_and_what_is_read_can_be_shown(
    gpus: list[dict[str, object]], extra: dict[str, object], depth: int
) -> None:
    from rich.console import Console

    from gpukit.cli._gpu_table import build_hosts_table
    from gpukit.output import dumps

    document: object = {"schema": SCHEMA, "gpus": gpus, **extra}
    for _ in range(depth):  # sometimes buried deep in lists
        document = {"schema": SCHEMA, "gpus": [document]}
    reading = parse_answer("h", json.dumps(document))
    assert (reading.inventory is None) == (reading.error is not None)
    assert reading.error is None or reading.error.isprintable()
    if reading.inventory is not None:
        dumps(reading.to_json())  # finite: dumps refuses NaN
        out = Console(width=80, force_terminal=True, color_system=None)
        with out.capture() as captured:
            out.print(build_hosts_table([reading]))
        assert "\x1b" not in captured.get()


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_from_a_host_are_read_or_refused_never_an_exception(answer: bytes) -> None:
    reading = parse_answer("h", answer)
    assert (reading.inventory is None) == (reading.error is not None)
