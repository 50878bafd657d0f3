"""gk.inventory() against a fake NVML built from each machine description."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gpukit as gk
from gpukit.errors import InvalidArgumentError, NoDriverError, NvmlError
from gpukit.gpus.inventory import SCHEMA, Inventory, inventory, inventory_json
from tests.helpers import MACHINES

DESCRIPTIONS = sorted(MACHINES.glob("*.json"))
# Machines whose every GPU NVML reads in full (one-lost has its own test).
WITH_DRIVER = [m for m in DESCRIPTIONS if m.stem not in ("no-driver", "kaggle-2xT4-one-lost")]


def _use(monkeypatch: pytest.MonkeyPatch, path: Path) -> dict[str, Any]:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _variant(tmp_path: Path, machine: Path, **changes: Any) -> Path:
    data = json.loads(machine.read_text())
    data.update(changes)
    out = tmp_path / "machine.json"
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("machine", WITH_DRIVER, ids=lambda p: p.stem)
def test_inventory_reports_every_described_gpu_in_nvml_order(
    monkeypatch: pytest.MonkeyPatch, machine: Path
) -> None:
    described = _use(monkeypatch, machine)
    inv = inventory()
    assert [(g.index, g.uuid, g.name) for g in inv.gpus] == [
        (g["index"], g["uuid"], g["name"]) for g in described["gpus"]
    ]


@pytest.mark.parametrize("machine", WITH_DRIVER, ids=lambda p: p.stem)
def test_inventory_reads_memory_and_unsupported_readings_become_none(
    monkeypatch: pytest.MonkeyPatch, machine: Path
) -> None:
    described = _use(monkeypatch, machine)
    for gpu, want in zip(inventory().gpus, described["gpus"], strict=True):
        assert gpu.memory_total == want["memory_total"]
        assert gpu.memory_used == want["memory_used"]
        assert (
            gpu.memory_free == want["memory_total"] - want["memory_used"] - want["memory_reserved"]
        )
        assert gpu.utilization_gpu == want["utilization_gpu"]
        assert gpu.temperature_c == want["temperature_c"]
        expected_power = want["power_usage_mw"] and want["power_usage_mw"] / 1000
        assert gpu.power_draw_w == expected_power
        assert gpu.compute_capability == tuple(want["compute_capability"])


@pytest.mark.parametrize("machine", WITH_DRIVER, ids=lambda p: p.stem)
def test_inventory_reads_fan_speed_and_video_engine_load_or_none(
    monkeypatch: pytest.MonkeyPatch, machine: Path
) -> None:
    described = _use(monkeypatch, machine)
    assert [
        (g.fan_speed, g.utilization_encoder, g.utilization_decoder) for g in inventory().gpus
    ] == [
        (g.get("fan_speed"), g.get("utilization_encoder"), g.get("utilization_decoder"))
        for g in described["gpus"]
    ]


def test_a_description_without_fan_and_video_engine_readings_reads_them_as_none(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path, tmp_path: Path
) -> None:
    data = json.loads((machines_dir / "workstation-mixed-order.json").read_text())
    for gpu in data["gpus"]:
        for key in ("fan_speed", "utilization_encoder", "utilization_decoder"):
            del gpu[key]
    path = tmp_path / "older.json"
    path.write_text(json.dumps(data))
    _use(monkeypatch, path)
    gpus = inventory().gpus
    assert [(g.fan_speed, g.utilization_encoder, g.utilization_decoder) for g in gpus] == [
        (None, None, None)
    ] * 2
    assert [g.memory_used for g in gpus] == [g["memory_used"] for g in data["gpus"]]


@pytest.mark.parametrize(
    ("unsupported", "readable"),
    [
        (["nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"], False),
        (["nvmlDeviceGetComputeRunningProcesses"], True),
        ([], True),
    ],
)
def test_a_gpu_whose_processes_nvml_cannot_list_says_so(
    monkeypatch: pytest.MonkeyPatch,
    machines_dir: Path,
    tmp_path: Path,
    unsupported: list[str],
    readable: bool,
) -> None:
    machine = _variant(
        tmp_path, machines_dir / "laptop-rtx3060.json", unsupported_functions=unsupported
    )
    _use(monkeypatch, machine)
    (gpu,) = inventory().gpus
    assert gpu.processes_readable is readable
    # The fake's graphics query lists no one: the laptop's two processes are compute ones.
    assert len(gpu.processes) == (2 if not unsupported else 0)


@pytest.mark.parametrize("machine", WITH_DRIVER, ids=lambda p: p.stem)
def test_inventory_round_trips_through_json(monkeypatch: pytest.MonkeyPatch, machine: Path) -> None:
    _use(monkeypatch, machine)
    inv = inventory()
    text = json.dumps(inv.to_json())
    assert json.loads(text)["schema"] == SCHEMA
    assert Inventory.from_json(text) == inv


def test_laptop_without_power_readings_reports_power_as_not_available(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "laptop-rtx3060.json")
    gpu = inventory().gpus[0]
    assert (gpu.power_draw_w, gpu.power_limit_w) == (None, None)
    assert gpu.temperature_c == 46


def test_processes_carry_user_command_and_memory_largest_first(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "laptop-rtx3060.json")
    procs = inventory().gpus[0].processes
    assert [(p.pid, p.user, p.command, p.used_memory) for p in procs] == [
        (2240, "me", "firefox", 650117120),
        (1712, "me", "Xorg", 432013312),
    ]


def test_mig_gpu_lists_its_instances_with_mig_uuids_and_memory(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "server-2xH100-mig.json")
    mig_gpu, plain = inventory().gpus
    assert mig_gpu.mig_mode is True
    assert plain.mig_mode is False
    assert plain.mig_instances == ()
    assert [(m.index, m.uuid[:12], m.memory_total) for m in mig_gpu.mig_instances] == [
        (0, "MIG-92276658", 42144366592),
        (1, "MIG-ae97ba94", 42144366592),
    ]
    assert mig_gpu.mig_instances[0].memory_free == 42144366592 - 21474836480
    assert mig_gpu.utilization_gpu is None


def test_a_process_inside_a_mig_instance_counts_for_its_gpu_too(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "server-2xH100-mig.json")
    gpu = inventory().gpus[0]
    assert [p.pid for p in gpu.mig_instances[0].processes] == [7001]
    assert [p.pid for p in gpu.processes] == [7001]
    assert gpu.mig_instances[1].processes == ()


def test_busy_server_shows_who_uses_each_gpu(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "server-8xA100-shared.json")
    users = {g.index: sorted({p.user for p in g.processes}) for g in inventory().gpus}
    assert users == {
        0: ["alice"],
        1: ["alice"],
        2: [],
        3: ["bob"],
        4: [],
        5: ["carol"],
        6: ["dave"],
        7: ["erin"],
    }


def test_driver_and_cuda_versions_are_reported(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "kaggle-2xT4-idle.json")
    inv = inventory()
    assert (inv.driver_version, inv.cuda_driver_version) == ("550.90.07", "12.4")
    assert inv.source.startswith("fake:")


def test_no_driver_raises_no_driver_error_with_exit_code_3(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "no-driver.json")
    with pytest.raises(NoDriverError, match="No NVIDIA driver") as info:
        inventory()
    assert info.value.exit_code == 3
    assert info.value.hint


def test_older_driver_without_v2_memory_query_falls_back_to_v1(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path, tmp_path: Path
) -> None:
    machine = _variant(
        tmp_path,
        machines_dir / "server-8xA100-shared.json",
        unsupported_functions=["nvmlDeviceGetMemoryInfo_v2"],
    )
    _use(monkeypatch, machine)
    gpu = inventory().gpus[0]
    assert gpu.memory_reserved is None
    # The v1 query counts reserved memory as used.
    assert gpu.memory_used == 76450417868 + 536870912


def test_a_missing_nvml_function_makes_a_reading_unavailable_not_an_error(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path, tmp_path: Path
) -> None:
    machine = _variant(
        tmp_path,
        machines_dir / "kaggle-2xT4-idle.json",
        unsupported_functions=["nvmlDeviceGetTemperature"],
    )
    _use(monkeypatch, machine)
    assert [g.temperature_c for g in inventory().gpus] == [None, None]


def test_an_unexpected_nvml_failure_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path, tmp_path: Path
) -> None:
    machine = _variant(tmp_path, machines_dir / "kaggle-2xT4-idle.json", nvml_error="Unknown")
    _use(monkeypatch, machine)
    with pytest.raises(NvmlError, match="NVML failed to start"):
        inventory()


def test_an_unreadable_fake_machine_file_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(tmp_path / "missing.json"))
    with pytest.raises(InvalidArgumentError, match="GPUKIT_FAKE_NVML"):
        inventory()


def test_from_json_refuses_another_schema() -> None:
    with pytest.raises(InvalidArgumentError, match="schema"):
        Inventory.from_json({"schema": "gpukit.inventory/999", "gpus": []})


@pytest.mark.parametrize(
    "text",
    ["{not json", '{"schema": "gpukit.inventory/1", "gpus": [1]}', "[" * 200 + "]" * 200],
    ids=["not json", "a gpu that is no mapping", "too deep"],
)
def test_from_json_refuses_malformed_text_with_a_typed_error(text: str) -> None:
    from gpukit.gpus.inventory import SCHEMA

    with pytest.raises(InvalidArgumentError, match="inventory JSON"):
        Inventory.from_json(text.replace("gpukit.inventory/1", SCHEMA))


@pytest.mark.parametrize("key", [True, "", 1.0, None], ids=["True", "empty", "float", "None"])
def test_a_gpu_is_named_by_an_index_or_a_uuid_only(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path, key: object
) -> None:
    _use(monkeypatch, machines_dir / "kaggle-2xT4-idle.json")
    with pytest.raises(InvalidArgumentError, match="named by its NVML index or its UUID"):
        inventory().gpu(key)  # type: ignore[arg-type]


def test_from_json_ignores_fields_added_by_a_newer_writer(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "kaggle-2xT4-idle.json")
    inv = inventory()
    data = inv.to_json()
    data["future"] = 1
    data["gpus"][0]["fan_rpm"] = 1800
    assert Inventory.from_json(data) == inv


def test_inventory_json_is_the_dict_of_the_inventory(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "kaggle-2xT4-idle.json")
    data = inventory_json()
    assert data["schema"] == SCHEMA
    assert [g["uuid"] for g in data["gpus"]] == [g.uuid for g in inventory().gpus]


def test_gpu_lookup_by_index_or_uuid_prefix(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    _use(monkeypatch, machines_dir / "kaggle-2xT4-idle.json")
    inv = inventory()
    assert inv.gpu(1) is inv.gpu("GPU-d23f") is inv.gpus[1]
    with pytest.raises(InvalidArgumentError, match="No single GPU"):
        inv.gpu("GPU-")


def test_gk_inventory_stays_callable_after_the_module_is_imported(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    import gpukit.gpus.inventory  # binds gk.inventory to the module, as any import would

    _use(monkeypatch, machines_dir / "kaggle-2xT4-idle.json")
    assert len(gk.inventory().gpus) == 2
    assert gpukit.gpus.inventory.Inventory is gk.Inventory


def test_a_lost_gpu_is_reported_without_hiding_the_others(
    monkeypatch: pytest.MonkeyPatch, machines_dir: Path
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / "kaggle-2xT4-one-lost.json"))
    inv = gk.inventory()
    healthy, lost = inv.gpus
    assert healthy.error is None
    assert healthy.name == "Tesla T4"
    assert lost.error is not None
    assert "lost" in lost.error.lower()
    assert lost.memory_total is None
    assert Inventory.from_json(inv.to_json()).gpus[1].error == lost.error


def test_a_co_users_command_line_reaches_no_terminal_as_escape_sequences() -> None:
    # Anyone chooses their own process's argv; gpukit list and queue print it to other users.
    from gpukit.gpus.inventory import _proc_owner_and_command

    hostile = "\x1b]0;pwned\x07\x1b[2J"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()", hostile],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # started, with its own command line
        _, command = _proc_owner_and_command(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert command is not None
    assert command.endswith("?]0;pwned??[2J")
    assert command.isprintable()


def test_a_process_of_a_uid_without_an_account_is_named_as_its_claims_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import pwd

    from gpukit.gpus.inventory import _proc_owner_and_command
    from gpukit.holders import user_name

    def no_account(uid: int) -> pwd.struct_passwd:
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", no_account)
    user, _ = _proc_owner_and_command(os.getpid())
    assert user == user_name(os.getuid()) == f"uid {os.getuid()}"
