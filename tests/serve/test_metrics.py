"""/metrics: the Prometheus text of the fake machines, checked against their descriptions."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpukit.serve import Sampler
from gpukit.sharing.claims import claim
from gpukit.sharing.tickets import Ticket

A100_0 = "GPU-36f675cc-81e7-4ef5-e8e2-5d940ed90475"
A100_4 = "GPU-a170b338-3926-3059-f28c-105d1fb17c23"


def _samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: dict[Any, float], metric: str, /, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


def _names(samples: dict[Any, float]) -> set[str]:
    return {name for name, _ in samples}


def test_metrics_of_the_8_gpu_server_equal_its_description(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    m = _samples(served.sampler.latest.metrics)
    assert _value(m, "gpukit_gpu_memory_used_bytes", gpu="0") == 76450417868
    assert _value(m, "gpukit_gpu_memory_total_bytes", gpu="0") == 85899345920
    assert _value(m, "gpukit_gpu_utilization_ratio", gpu="0") == pytest.approx(0.98)
    assert _value(m, "gpukit_gpu_temperature_celsius", gpu="0") == 67
    assert _value(m, "gpukit_gpu_power_watts", gpu="0") == 389
    assert _value(m, "gpukit_gpu_power_limit_watts", gpu="0") == 400
    assert _value(m, "gpukit_gpu_utilization_ratio", gpu="2") == 0
    info = dict(gpu="0", uuid=A100_0, name="NVIDIA A100-SXM4-80GB", driver="550.54.15")
    assert _value(m, "gpukit_gpu_info", **info) == 1
    proc = dict(gpu="0", pid="40211", user="alice", command="python train.py")
    assert _value(m, "gpukit_process_gpu_memory_bytes", **proc) == 76235669504
    assert _value(m, "gpukit_gpu_claimed", gpu="0", user="") == 0
    assert _value(m, "gpukit_waiters") == 0
    assert _value(m, "gpukit_nvml_up") == 1
    per_gpu = [k for k in m if k[0] == "gpukit_gpu_temperature_celsius"]
    assert len(per_gpu) == 8


def test_metrics_name_who_claimed_a_gpu(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    with claim([A100_4], command="python sweep.py"):
        m = _samples(served.sampler.sample().metrics)
    claimed = {
        dict(labels)["gpu"]: (dict(labels)["user"], value)
        for (name, labels), value in m.items()
        if name == "gpukit_gpu_claimed"
    }
    me = pwd.getpwuid(os.getuid()).pw_name  # the holder process's owner, as the kernel says
    assert claimed == {str(i): ((me, 1.0) if i == 4 else ("", 0.0)) for i in range(8)}


def test_metrics_count_the_waiters_in_line(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    with Ticket(), Ticket():
        assert _value(_samples(served.sampler.sample().metrics), "gpukit_waiters") == 2
    assert _value(_samples(served.sampler.sample().metrics), "gpukit_waiters") == 0


def test_metrics_of_a_mig_gpu_list_its_instances_and_omit_missing_readings(
    serve_machine: Any,
) -> None:
    served = serve_machine("server-2xH100-mig")
    m = _samples(served.sampler.latest.metrics)
    mig0 = dict(
        gpu="0",
        mig="0",
        uuid="MIG-92276658-1e27-a1c0-8a6a-63ec24ede6a4",
        name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
    )
    assert _value(m, "gpukit_mig_memory_used_bytes", **mig0) == 21474836480
    assert _value(m, "gpukit_mig_memory_total_bytes", **mig0) == 42144366592
    # GPU 0 cannot report utilisation under MIG: no sample, rather than a made-up 0.
    assert _value(m, "gpukit_gpu_utilization_ratio", gpu="0") is None
    assert _value(m, "gpukit_gpu_utilization_ratio", gpu="1") == pytest.approx(0.12)
    proc = dict(gpu="0", pid="7001", user="frank", command="python finetune.py")
    assert _value(m, "gpukit_process_gpu_memory_bytes", **proc) == 21474836480


def test_metric_names_follow_prometheus_units(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    names = _names(_samples(served.sampler.latest.metrics))
    required = {
        "gpukit_gpu_info",
        "gpukit_gpu_memory_used_bytes",
        "gpukit_gpu_memory_total_bytes",
        "gpukit_gpu_utilization_ratio",
        "gpukit_gpu_temperature_celsius",
        "gpukit_gpu_power_watts",
        "gpukit_gpu_power_limit_watts",
        "gpukit_process_gpu_memory_bytes",
        "gpukit_gpu_claimed",
        "gpukit_waiters",
    }
    assert required <= names


def test_a_failed_reading_keeps_the_last_gpus_and_reports_nvml_down(serve_machine: Any) -> None:
    served = serve_machine("server-8xA100-shared")
    served.machine.write_text('{"nvml_error": "DriverNotLoaded", "gpus": []}')
    sample = served.sampler.sample()
    m = _samples(sample.metrics)
    assert _value(m, "gpukit_nvml_up") == 0
    assert _value(m, "gpukit_gpu_temperature_celsius", gpu="0") == 67
    assert sample.error is not None
    assert "driver" in sample.error.lower()


def test_sampler_refuses_to_start_without_a_driver(
    machines_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpukit.errors import NoDriverError

    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / "no-driver.json"))
    with pytest.raises(NoDriverError):
        Sampler(3600).start()


def test_a_refused_lock_folder_leaves_claims_unknown_not_free(
    serve_machine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")
    (tmp_path / "real-locks").mkdir()
    os.symlink(tmp_path / "real-locks", tmp_path / "link-locks")
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(tmp_path / "link-locks"))
    sample = served.sampler.sample()
    m = _samples(sample.metrics)
    assert _value(m, "gpukit_gpu_temperature_celsius", gpu="0") == 67
    assert "gpukit_gpu_claimed" not in _names(m)
    assert "gpukit_waiters" not in _names(m)
    state = json.loads(sample.state_json)
    assert state["error"].startswith("Claims unknown: ")
    assert state["queue"] == {"error": state["error"]}


def test_process_labels_are_cut_so_one_command_line_cannot_bloat_every_scrape(
    serve_machine: Any,
) -> None:
    served = serve_machine("server-8xA100-shared")
    long_command = "python train.py " + "--flag=value " * 40
    served.edit(
        2, processes=[{"pid": 7, "user": "u" * 100, "name": long_command, "used_memory": 5}]
    )
    m = _samples(served.sampler.sample().metrics)
    [labels] = [
        dict(labels)
        for name, labels in m
        if name == "gpukit_process_gpu_memory_bytes" and dict(labels)["gpu"] == "2"
    ]
    assert labels["command"] == long_command[:120]
    assert labels["user"] == "u" * 64
    assert labels["pid"] == "7"
