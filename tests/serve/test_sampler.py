"""The sampler serves what it could read and marks the rest: no part's failure stops a server."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpukit.errors import NvmlError
from gpukit.gpus.fake_nvml import gpm_samples_held
from gpukit.gpus.gpm import MIN_INTERVAL_S
from gpukit.gpus.inventory import Inventory
from gpukit.serve import sampler as sampler_module
from gpukit.sharing.claims import claim
from gpukit.sharing.tickets import Ticket

A100_4 = "GPU-a170b338-3926-3059-f28c-105d1fb17c23"


def _metrics(text: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _one(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    [(_, value)] = metrics[name]
    return value


def _raise(exc: BaseException) -> Any:
    def read(*args: object, **kwargs: object) -> Any:
        raise exc

    return read


def test_serve_starts_when_reading_the_claims_raises_anything(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a co-user's ticket of deeply nested JSON did: not a GpukitError, not even an Exception
    # that the lock folder's readers expect.
    monkeypatch.setattr(sampler_module, "sharing", _raise(RecursionError("too deep")))
    served = serve_machine("server-8xA100-shared")  # starts the sampler
    sample = served.sampler.latest
    assert sample.inventory is not None
    assert sample.stale
    assert sample.failed == {"claims": "Claims unknown: RecursionError: too deep"}
    m = _metrics(sample.metrics)
    assert _one(m, "gpukit_nvml_up") == 1
    assert _one(m, "gpukit_claims_up") == 0
    assert _one(m, "gpukit_sample_stale") == 1
    assert "gpukit_gpu_claimed" not in m  # unknown, not "free"


def test_a_running_sampler_stops_showing_old_claims_once_reading_them_fails(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")
    with claim([A100_4], command="python sweep.py"):
        good = _metrics(served.sampler.sample().metrics)
        assert any(lab["gpu"] == "4" and v == 1 for lab, v in good["gpukit_gpu_claimed"])
        monkeypatch.setattr(sampler_module, "sharing", _raise(KeyError("position")))
        sample = served.sampler.sample()
    m = _metrics(sample.metrics)
    assert _one(m, "gpukit_sample_stale") == 1
    assert _one(m, "gpukit_claims_up") == 0
    assert "gpukit_gpu_claimed" not in m
    state = json.loads(sample.state_json)
    assert state["stale"] is True
    assert state["failed"] == {"claims": "Claims unknown: KeyError: 'position'"}
    assert state["queue"] == {"error": "Claims unknown: KeyError: 'position'"}


def test_an_unexpected_error_reading_the_gpus_keeps_the_last_gpus_marked_stale(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")
    before = served.sampler.latest.inventory
    monkeypatch.setattr(served.sampler, "_read", _raise(OSError(5, "Input/output error")))
    sample = served.sampler.sample()
    assert sample.inventory is before
    assert sample.failed["gpus"] == "OSError: [Errno 5] Input/output error"
    m = _metrics(sample.metrics)
    assert _one(m, "gpukit_nvml_up") == 0
    assert _one(m, "gpukit_sample_stale") == 1
    state = json.loads(sample.state_json)
    assert state["inventory"]["taken_at"] == before.taken_at  # the page can say how old


def test_a_failure_message_reaches_the_page_without_control_characters(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")
    monkeypatch.setattr(sampler_module, "sharing", _raise(ValueError("\x1b]0;owned\x07ticket")))
    state = json.loads(served.sampler.sample().state_json)
    assert state["failed"]["claims"] == "Claims unknown: ValueError: ?]0;owned?ticket"


def test_a_reading_that_cannot_be_rendered_is_served_as_a_failure_not_a_crash(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-8xA100-shared")

    def broken_json(self: Inventory) -> dict[str, Any]:
        raise TypeError("a reading no renderer expected")

    monkeypatch.setattr(Inventory, "to_json", broken_json)
    sample = served.sampler.sample()
    assert sample.failed["render"] == "Rendering failed: TypeError: a reading no renderer expected"
    assert _one(_metrics(sample.metrics), "gpukit_sample_stale") == 1
    assert json.loads(sample.state_json)["stale"] is True


def test_a_full_sample_is_not_stale(serve_machine: Any) -> None:
    sample = serve_machine("server-8xA100-shared").sampler.sample()
    assert not sample.stale
    m = _metrics(sample.metrics)
    assert (_one(m, "gpukit_claims_up"), _one(m, "gpukit_sample_stale")) == (1, 0)
    assert json.loads(sample.state_json)["failed"] == {}


def test_serve_starts_beside_a_held_ticket_of_deeply_nested_json(serve_machine: Any) -> None:
    with Ticket() as ticket:
        # A co-user's ticket, locked by its live process, whose content is 60000 "[".
        ticket.path.write_text("[" * 60000)
        served = serve_machine("server-8xA100-shared")
        sample = served.sampler.latest
        assert sample.inventory is not None
        # Either the reader refuses the ticket and the claims are read, or they are unknown and
        # said to be: never the claims of some earlier sample.
        assert (sample.queue is None) == ("claims" in sample.failed)
        m = _metrics(sample.metrics)
        assert _one(m, "gpukit_nvml_up") == 1
        assert _one(m, "gpukit_claims_up") == (sample.queue is not None)


H100 = "GPU-923a7369-94e3-bf91-1a61-dbe22e44158b"  # GPU 1 of server-2xH100-mig: 6.25 % tensor


def _tensor(sample: sampler_module.Sample) -> dict[str, float]:
    """DCGM_FI_PROF_PIPE_TENSOR_ACTIVE by UUID; empty when not served."""
    families = _metrics(sample.metrics)
    return {labels["UUID"]: v for labels, v in families.get("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", [])}


def _later() -> None:
    time.sleep(MIN_INTERVAL_S * 1.5)  # NVML compares GPM samples at least 100 ms apart


def test_tensor_activity_is_served_from_the_second_reading_on(serve_machine: Any) -> None:
    served = serve_machine("server-2xH100-mig")
    assert _tensor(served.sampler.latest) == {}  # the first reading has nothing to compare
    _later()
    assert _tensor(served.sampler.sample()) == {H100: 0.0625}
    served.edit(1, tensor_active_percent=37.5)
    _later()
    assert _tensor(served.sampler.sample()) == {H100: 0.375}


def test_stopping_the_sampler_frees_the_gpm_samples_it_kept(serve_machine: Any) -> None:
    held = gpm_samples_held()
    served = serve_machine("server-2xH100-mig")
    for _ in range(3):
        _later()
        served.sampler.sample()
    assert gpm_samples_held() == held + 1  # the last sample of the one GPU with GPM
    served.sampler.stop()
    assert gpm_samples_held() == held


def test_a_gpm_failure_is_a_failed_part_and_the_gpus_still_serve(
    serve_machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_machine("server-2xH100-mig")
    failure = NvmlError("nvmlGpmMetricsGet failed: Unknown Error.")
    monkeypatch.setattr(served.sampler._tensor, "read", _raise(failure))
    _later()
    sample = served.sampler.sample()
    assert sample.failed == {
        "tensor": "Tensor activity unknown: nvmlGpmMetricsGet failed: Unknown Error."
    }
    m = _metrics(sample.metrics)
    assert _one(m, "gpukit_nvml_up") == 1
    assert _one(m, "gpukit_sample_stale") == 1
    assert _tensor(sample) == {}
    assert sorted(labels["gpu"] for labels, _ in m["DCGM_FI_DEV_GPU_TEMP"]) == ["0", "1"]
