"""Reading other machines' GPUs over (a fake) ssh: gpukit there, nvidia-smi there, or no answer."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukit.errors import InvalidArgumentError
from gpukit.gpus.hosts import (
    NVIDIA_SMI_FIELDS,
    hosts_json,
    parse_answer,
    parse_hosts,
    parse_nvidia_smi_csv,
    read_hosts,
    ssh_command,
)
from gpukit.gpus.inventory import SCHEMA, Inventory
from gpukit.sharing.claims import claim
from tests.helpers.hosts import NVIDIA_SMI_CSV, FakeHosts


@pytest.fixture
def hosts(tmp_path: Path) -> FakeHosts:
    return FakeHosts(tmp_path / "hosts")


def test_a_host_with_gpukit_answers_with_its_inventory(hosts: FakeHosts) -> None:
    hosts.gpukit("gpu1", "server-8xA100-shared")
    [reading] = read_hosts(["gpu1"], timeout=60, ssh_command_text=hosts.ssh)
    assert reading.error is None
    assert reading.via == "gpukit"
    assert reading.inventory is not None
    assert len(reading.inventory.gpus) == 8
    assert reading.inventory.gpus[3].processes[0].user == "bob"


def test_a_host_with_gpukit_reports_who_claimed_its_gpus(hosts: FakeHosts) -> None:
    hosts.gpukit("gpu1", "server-8xA100-shared")
    gpu4 = "GPU-a170b338-3926-3059-f28c-105d1fb17c23"
    with claim([gpu4], command="python sweep.py", folder=hosts.root / "gpu1" / "locks"):
        [reading] = read_hosts(["gpu1"], timeout=60, ssh_command_text=hosts.ssh)
    assert reading.claims[gpu4].command == "python sweep.py"
    assert reading.claims[gpu4].pid == os.getpid()
    claims = hosts_json([reading])["hosts"][0]["claims"]
    assert claims[gpu4]["command"] == "python sweep.py"


def test_a_host_without_gpukit_is_read_through_nvidia_smi(hosts: FakeHosts) -> None:
    hosts.nvidia_smi("t4box")
    [reading] = read_hosts(["t4box"], timeout=60, ssh_command_text=hosts.ssh)
    assert reading.via == "nvidia-smi", reading.error
    assert reading.inventory is not None
    assert [g.name for g in reading.inventory.gpus] == ["Tesla T4", "Tesla T4"]


def test_nvidia_smi_csv_is_read_in_bytes_watts_and_percent() -> None:
    inv = parse_nvidia_smi_csv(NVIDIA_SMI_CSV.read_text())
    first, second = inv.gpus
    assert inv.driver_version == "535.104.05"
    assert (first.index, first.uuid) == (0, "GPU-1b6c9e2a-7c1d-4f0e-9a51-3e2f8c0d4a11")
    assert first.pci_bus_id == "00000000:00:04.0"
    assert first.memory_total == 15360 * 2**20
    assert first.memory_used == 1024 * 2**20
    assert first.memory_free == 14100 * 2**20
    assert (first.utilization_gpu, first.utilization_memory) == (35, 10)
    assert first.temperature_c == 54
    assert first.power_draw_w == pytest.approx(27.35)
    assert first.power_limit_w == pytest.approx(70.0)
    assert second.power_draw_w is None  # "[N/A]"


@pytest.mark.parametrize("missing", ["[N/A]", "[Not Supported]", "N/A", ""])
def test_nvidia_smi_readings_it_cannot_give_become_none(missing: str) -> None:
    line = f"0, GPU-x, Tesla T4, 00000000:00:04.0, 15360, 0, 15360, {missing}, 0, 40, 10, 70, 535"
    assert parse_nvidia_smi_csv(line).gpus[0].utilization_gpu is None


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30),
        min_size=len(NVIDIA_SMI_FIELDS),
        max_size=len(NVIDIA_SMI_FIELDS),
    )
)
def test_any_garbage_from_a_host_becomes_its_error_never_an_exception(cells: list[str]) -> None:
    reading = parse_answer("h", ", ".join(cells))
    assert (reading.inventory is None) == (reading.error is not None)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_GPU_KEYS = [
    "index",
    "uuid",
    "name",
    "memory_total",
    "memory_used",
    "utilization_gpu",
    "temperature_c",
    "power_draw_w",
    "processes",
    "mig_instances",
    "compute_capability",
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(_GPU_KEYS), _JSON), max_size=3), _JSON)
def test_any_inventory_json_from_a_host_is_read_or_refused_never_an_exception(
    gpus: list[dict[str, object]], driver: object
) -> None:
    payload = {"schema": SCHEMA, "gpus": gpus, "driver_version": driver}
    reading = parse_answer("h", json.dumps(payload))
    assert (reading.inventory is None) == (reading.error is not None)
    if reading.inventory is not None:  # what is kept can be shown, wide and narrow
        from rich.console import Console

        from gpukit.cli._gpu_table import build_hosts_table

        for width in (80, 200):
            out = Console(width=width, force_terminal=True, color_system=None)
            with out.capture():
                out.print(build_hosts_table([reading]))


@pytest.mark.parametrize(
    "gpu",
    [
        {"index": 0, "uuid": "GPU-a", "name": 5},
        {"index": "0", "uuid": "GPU-a", "name": "T4"},
        {"index": 0, "uuid": "GPU-a", "name": "T4", "memory_used": "lots"},
        {"index": 0, "uuid": "GPU-a", "name": "T4", "processes": [{"pid": "x"}]},
        {"index": 0, "uuid": "GPU-a", "name": "T4", "processes": [5]},
    ],
)
def test_an_inventory_with_readings_of_the_wrong_type_is_refused(gpu: dict[str, object]) -> None:
    reading = parse_answer("h", json.dumps({"schema": SCHEMA, "gpus": [gpu]}))
    assert reading.inventory is None
    assert reading.error is not None
    assert reading.error.startswith("answer not understood: its gpukit ")


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ('{"schema": "gpukit.inventory/9", "gpus": []}', "this gpukit reads"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "nvidia-smi columns"),
        ("", "nvidia-smi listed no GPU"),
        ("Welcome to gpu1!\n", "nvidia-smi columns"),
    ],
)
def test_an_unreadable_answer_says_what_came_back(answer: str, why: str) -> None:
    reading = parse_answer("gpu1", answer)
    assert reading.inventory is None
    assert reading.error is not None
    assert why in reading.error


def test_a_refusing_host_is_unreachable_with_sshs_reason(hosts: FakeHosts) -> None:
    hosts.refusing("down")
    [reading] = read_hosts(["down"], timeout=60, ssh_command_text=hosts.ssh)
    assert reading.inventory is None
    assert reading.error == "unreachable: ssh: connect to host down port 22: Connection refused"


def test_a_host_whose_gpukit_fails_reports_its_message(hosts: FakeHosts) -> None:
    hosts.gpukit("nodriver", "no-driver")
    [reading] = read_hosts(["nodriver"], timeout=60, ssh_command_text=hosts.ssh)
    assert reading.error is not None
    assert reading.error.startswith("failed: ")
    assert "No NVIDIA driver" in reading.error


def test_a_hanging_host_costs_the_timeout_and_leaves_no_process(hosts: FakeHosts) -> None:
    hosts.hanging("dead")
    hosts.nvidia_smi("alive")
    start = time.monotonic()
    dead, ok = read_hosts(["dead", "alive"], timeout=2, ssh_command_text=hosts.ssh)
    # The fake sleeps 600 s: returning at all, long before that, shows the timeout cut it.
    assert time.monotonic() - start < 60
    assert dead.error == "unreachable: no answer within 2 s"
    assert dead.elapsed_s >= 2
    assert ok.inventory is not None
    assert hosts.live_processes() == []


def test_eight_hosts_are_read_at_once_in_order(hosts: FakeHosts) -> None:
    names = [f"gpu{i}" for i in range(8)]
    for name in names:
        hosts.gpukit(name, "kaggle-2xT4-idle")
    readings = read_hosts(names, timeout=60, ssh_command_text=hosts.ssh)
    assert [r.host for r in readings] == names
    assert all(r.inventory is not None and len(r.inventory.gpus) == 2 for r in readings)


def test_hosts_json_has_an_inventory_or_an_error_per_host(hosts: FakeHosts) -> None:
    hosts.nvidia_smi("t4box")
    readings = read_hosts(["t4box", "nowhere"], timeout=60, ssh_command_text=hosts.ssh)
    doc = hosts_json(readings)
    assert doc["schema"] == "gpukit.hosts/1"
    first, second = doc["hosts"]
    assert first["host"] == "t4box"
    assert first["via"] == "nvidia-smi"
    assert first["claims"] == {}  # nvidia-smi knows nothing of claims
    assert first["elapsed_s"] > 0
    assert Inventory.from_json(first["inventory"]).gpus[0].memory_total == 15360 * 2**20
    assert "error" not in first
    assert second["host"] == "nowhere"
    assert "inventory" not in second
    assert "Could not resolve hostname nowhere" in second["error"]


@pytest.mark.parametrize("text", ["", "a,,b", "-oProxyCommand=evil", "a b", " , "])
def test_host_lists_that_ssh_would_misread_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a host name"):
        parse_hosts(text)


def test_host_list_keeps_order_and_drops_repeats() -> None:
    assert parse_hosts("b, a,b,user@c") == ["b", "a", "user@c"]


def test_default_ssh_never_prompts_and_gives_up_connecting_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUKIT_SSH", raising=False)
    assert ssh_command(2.5) == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3"]
    monkeypatch.setenv("GPUKIT_SSH", "ssh -p 2222")
    assert ssh_command(2.5) == ["ssh", "-p", "2222"]
    assert ssh_command(2.5, "my-ssh -q") == ["my-ssh", "-q"]


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_positive_time_is_refused(timeout: float) -> None:
    with pytest.raises(InvalidArgumentError, match="--timeout"):
        read_hosts(["a"], timeout=timeout, ssh_command_text="true")


def test_a_missing_ssh_command_is_a_usage_error() -> None:
    with pytest.raises(InvalidArgumentError, match="'no-such-ssh' is not found"):
        read_hosts(["a"], timeout=1, ssh_command_text="no-such-ssh -v")
