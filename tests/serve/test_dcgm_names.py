"""/metrics under dcgm-exporter's names: its labels, types, help texts and units.

The expected types and help texts are dcgm-exporter's own, read from a copy of its default
counters (``tests/fixtures/dcgm/default-counters.csv``); the values are checked against gpukit's
own names in the same exposition and against the machine descriptions.
"""

from __future__ import annotations

import csv
import json
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpukit.gpus.gpm import MIN_INTERVAL_S
from tests.helpers import MACHINES, ROOT

COUNTERS = ROOT / "tests" / "fixtures" / "dcgm" / "default-counters.csv"
MIB = 1 << 20
DCGM_LABELS = {
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "modelName",
    "Hostname",
    "DCGM_FI_DRIVER_VERSION",
}
SERVED = {
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
}
TENSOR = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
"""Served only for GPUs with GPM (Hopper and newer), from the second reading on."""


@dataclass(frozen=True)
class _Family:
    type: str
    help: str
    samples: dict[str, tuple[dict[str, str], float]]
    """GPU index -> (labels, value)."""


def _families(text: bytes) -> dict[str, _Family]:
    """Every family of the exposition by name; samples keyed by their ``gpu`` label."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        samples = {s.labels.get("gpu", ""): (s.labels, s.value) for s in family.samples}
        out[family.name] = _Family(family.type, family.documentation, samples)
    return out


def _dcgm(text: bytes) -> dict[str, _Family]:
    return {name: f for name, f in _families(text).items() if name.startswith("DCGM_")}


def _value(families: dict[str, _Family], name: str, gpu: int) -> float | None:
    found = families[name].samples.get(str(gpu))
    return None if found is None else found[1]


def _counters() -> dict[str, tuple[str, str]]:
    """dcgm-exporter's default counters: DCGM field -> (Prometheus type, help text)."""
    rows = (
        [cell.strip() for cell in row]
        for row in csv.reader(COUNTERS.read_text().splitlines())
        if row and not row[0].lstrip().startswith("#")
    )
    return {name: (kind, ",".join(rest).strip()) for name, kind, *rest in rows}


def test_every_dcgm_name_the_dashboard_needs_is_served(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    assert set(_dcgm(served.sampler.latest.metrics)) == SERVED


def test_dcgm_names_have_dcgm_exporters_type_and_help_text(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    counters = _counters()
    for name, family in _dcgm(served.sampler.latest.metrics).items():
        assert (family.type, family.help) == counters[name], name


def test_every_dcgm_sample_carries_dcgm_exporters_labels(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    described = json.loads((MACHINES / "server-8xA100-shared.json").read_text())
    for name, family in _dcgm(served.sampler.latest.metrics).items():
        assert sorted(family.samples) == [str(i) for i in range(8)], name
        for gpu in described["gpus"]:
            labels, _ = family.samples[str(gpu["index"])]
            assert labels == {
                "gpu": str(gpu["index"]),
                "UUID": gpu["uuid"],
                "pci_bus_id": gpu["pci_bus_id"],
                "device": f"nvidia{gpu['index']}",
                "modelName": gpu["name"],
                "Hostname": socket.gethostname(),
                "DCGM_FI_DRIVER_VERSION": described["driver_version"],
            }, name


def test_dcgm_values_are_gpukits_readings_in_dcgms_units(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    m = _families(served.sampler.latest.metrics)
    for gpu in range(8):
        used = _value(m, "gpukit_gpu_memory_used_bytes", gpu)
        ratio = _value(m, "gpukit_gpu_utilization_ratio", gpu)
        assert used is not None
        assert ratio is not None
        assert _value(m, "DCGM_FI_DEV_FB_USED", gpu) == used // MIB  # MiB, not bytes
        assert _value(m, "DCGM_FI_DEV_GPU_UTIL", gpu) == pytest.approx(ratio * 100)  # percent
        for dcgm, own in [
            ("DCGM_FI_DEV_GPU_TEMP", "gpukit_gpu_temperature_celsius"),
            ("DCGM_FI_DEV_POWER_USAGE", "gpukit_gpu_power_watts"),
        ]:
            assert _value(m, dcgm, gpu) == _value(m, own, gpu), (dcgm, gpu)


def test_dcgm_memory_and_clocks_equal_the_machine_description(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    m = _dcgm(served.sampler.latest.metrics)
    described = json.loads((MACHINES / "server-8xA100-shared.json").read_text())
    for gpu in described["gpus"]:
        i = gpu["index"]
        free = gpu["memory_total"] - gpu["memory_used"] - gpu["memory_reserved"]
        assert _value(m, "DCGM_FI_DEV_FB_FREE", i) == max(free, 0) // MIB
        assert _value(m, "DCGM_FI_DEV_FB_USED", i) == gpu["memory_used"] // MIB
        assert _value(m, "DCGM_FI_DEV_SM_CLOCK", i) == gpu["clock_sm_mhz"]
        assert _value(m, "DCGM_FI_DEV_MEM_CLOCK", i) == gpu["clock_mem_mhz"]


def test_framebuffer_memory_is_whole_mib_rounded_down_as_dcgm_counts_it(
    serve_machine: Any,
) -> None:
    served = serve_machine("server-8xA100-shared")
    served.edit(2, memory_used=5 * MIB, memory_reserved=0)
    served.edit(3, memory_used=5 * MIB + MIB - 1, memory_reserved=0)
    m = _dcgm(served.sampler.sample().metrics)
    assert _value(m, "DCGM_FI_DEV_FB_USED", 2) == 5
    assert _value(m, "DCGM_FI_DEV_FB_USED", 3) == 5
    total = json.loads(served.machine.read_text())["gpus"][3]["memory_total"]
    assert _value(m, "DCGM_FI_DEV_FB_FREE", 3) == (total - 6 * MIB + 1) // MIB


def test_free_framebuffer_memory_is_never_below_zero(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    total = json.loads(served.machine.read_text())["gpus"][2]["memory_total"]
    served.edit(2, memory_used=total, memory_reserved=512 * MIB)  # over-counted by 512 MiB
    m = _dcgm(served.sampler.sample().metrics)
    assert _value(m, "DCGM_FI_DEV_FB_FREE", 2) == 0
    assert _value(m, "DCGM_FI_DEV_FB_USED", 2) == total // MIB


def test_a_reading_the_gpu_cannot_give_has_no_dcgm_sample(serve_machine: Any) -> None:
    served = serve_machine("server-2xH100-mig")
    served.edit(1, clock_sm_mhz=None)
    m = _dcgm(served.sampler.sample().metrics)
    # GPU 0 is in MIG mode: no utilisation there, rather than a made-up 0.
    assert _value(m, "DCGM_FI_DEV_GPU_UTIL", 0) is None
    assert _value(m, "DCGM_FI_DEV_GPU_UTIL", 1) == 12
    assert _value(m, "DCGM_FI_DEV_SM_CLOCK", 1) is None
    assert _value(m, "DCGM_FI_DEV_MEM_CLOCK", 1) == 2619


def test_a_gpu_without_power_readings_has_no_dcgm_power_sample(serve_machine: Any) -> None:
    served = serve_machine("laptop-rtx3060")
    m = _dcgm(served.sampler.latest.metrics)
    assert _value(m, "DCGM_FI_DEV_POWER_USAGE", 0) is None
    assert _value(m, "DCGM_FI_DEV_GPU_TEMP", 0) == 46


def test_a_description_without_clocks_has_no_dcgm_clock_samples(serve_machine: Any) -> None:
    served = serve_machine("kaggle-2xT4-idle")
    data = json.loads(served.machine.read_text())
    for gpu in data["gpus"]:  # as descriptions were written before clocks were read
        del gpu["clock_sm_mhz"], gpu["clock_mem_mhz"]
    served.machine.write_text(json.dumps(data))
    m = _dcgm(served.sampler.sample().metrics)
    assert m["DCGM_FI_DEV_SM_CLOCK"].samples == {}
    assert m["DCGM_FI_DEV_MEM_CLOCK"].samples == {}
    assert sorted(m["DCGM_FI_DEV_GPU_TEMP"].samples) == ["0", "1"]


def test_a_lost_gpu_has_no_dcgm_samples_and_hides_no_other(serve_machine: Any) -> None:
    served = serve_machine("kaggle-2xT4-one-lost")
    for name, family in _dcgm(served.sampler.latest.metrics).items():
        assert sorted(family.samples) == ["0"], name


@pytest.mark.parametrize(
    "name",
    ['Evil "GPU"\nDCGM_FI_DEV_GPU_TEMP{gpu="9"} 1', "back\\slash\\", "} 5\n# TYPE x counter"],
)
def test_a_hostile_model_name_stays_inside_its_label(serve_machine: Any, name: str) -> None:
    served = serve_machine("server-8xA100-shared")
    served.edit(2, name=name)
    text = served.sampler.sample().metrics
    m = _dcgm(text)
    assert set(m) == SERVED
    for family in m.values():
        assert sorted(family.samples) == [str(i) for i in range(8)]
        assert family.samples["2"][0]["modelName"] == name
    lines = text.decode().splitlines()
    assert not [line for line in lines if line.startswith(('DCGM_FI_DEV_GPU_TEMP{gpu="9"', "} 5"))]


def _promtool(text: bytes) -> tuple[int, set[str]]:
    """``promtool check metrics`` on ``text``: its exit code and its complaints."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    said = (done.stdout + done.stderr).decode(errors="replace").splitlines()
    return done.returncode, {line.strip() for line in said if line.strip()}


def test_promtool_finds_only_dcgm_exporters_own_camel_case_label(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    code, complaints = _promtool(served.sampler.latest.metrics)
    # modelName is dcgm-exporter's spelling, which promtool's style check flags on its own
    # exposition too; dashboards select on it, so it stays. Anything else is a real problem.
    camel = "label names should be written in 'snake_case' not 'camelCase'"
    assert (code, complaints) == (3, {f"{name} {camel}" for name in SERVED})


def test_promtool_finds_nothing_in_gpukits_own_names(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    blocks = served.sampler.latest.metrics.split(b"# HELP ")[1:]  # one per family
    own = b"".join(b"# HELP " + block for block in blocks if not block.startswith(b"DCGM_"))
    assert b"gpukit_gpu_memory_used_bytes" in own
    assert b"DCGM_" not in own
    assert _promtool(own) == (0, set())


def _second_reading(served: Any) -> bytes:
    """The metrics of the sampler's second reading: the first with a GPM value to serve."""
    served.sampler.latest  # noqa: B018 - the first reading, taken at start
    time.sleep(MIN_INTERVAL_S * 1.5)  # NVML compares GPM samples at least 100 ms apart
    return served.sampler.sample().metrics


def test_tensor_activity_has_dcgm_exporters_type_help_text_and_labels(serve_machine: Any) -> None:
    served = serve_machine("server-2xH100-mig")
    described = json.loads((MACHINES / "server-2xH100-mig.json").read_text())
    family = _dcgm(_second_reading(served))[TENSOR]
    assert (family.type, family.help) == _counters()[TENSOR]
    gpu = described["gpus"][1]
    assert family.samples == {
        "1": (
            {
                "gpu": "1",
                "UUID": gpu["uuid"],
                "pci_bus_id": gpu["pci_bus_id"],
                "device": "nvidia1",
                "modelName": gpu["name"],
                "Hostname": socket.gethostname(),
                "DCGM_FI_DRIVER_VERSION": described["driver_version"],
            },
            gpu["tensor_active_percent"] / 100,  # a ratio, as DCGM serves it
        )
    }


def test_tensor_activity_is_a_ratio_of_the_described_percent(serve_machine: Any) -> None:
    served = serve_machine("server-2xH100-mig")
    served.edit(1, tensor_active_percent=37.5)
    assert _value(_dcgm(_second_reading(served)), TENSOR, 1) == 0.375


def test_an_idle_gpu_with_gpm_has_a_zero_sample(serve_machine: Any) -> None:
    served = serve_machine("server-2xH100-mig")
    served.edit(1, tensor_active_percent=0)
    assert _value(_dcgm(_second_reading(served)), TENSOR, 1) == 0.0


def test_no_tensor_activity_is_served_at_the_first_reading(serve_machine: Any) -> None:
    served = serve_machine("server-2xH100-mig")
    assert TENSOR not in _dcgm(served.sampler.latest.metrics)


@pytest.mark.parametrize("name", ["server-8xA100-shared", "server-4xL4-idle", "kaggle-2xT4-idle"])
def test_gpus_without_gpm_serve_no_tensor_activity_even_on_later_readings(
    serve_machine: Any, name: str
) -> None:
    served = serve_machine(name)
    assert set(_dcgm(_second_reading(served))) == SERVED
