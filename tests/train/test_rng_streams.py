"""gpukit.train.rng: a process's random streams back as they were, and a changed save refused.

A save's streams can be reached by a stranger's file, a co-user or a flipped byte, so each field
that ``restore`` reads is checked; a malformed one is a CheckpointError that names it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gpukit.errors import CheckpointError
from gpukit.train import rng

WHERE = "streams.pt"
CANNOT = f"{WHERE} holds random streams that gpukit cannot restore: "
DAMAGED = "The file was changed or damaged after it was saved; resume from another save."


@pytest.fixture(autouse=True)
def _streams_put_back() -> Iterator[None]:
    """Leave this process's streams as the test found them."""
    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)


def _draws() -> tuple[list[float], list[float], list[float], list[float]]:
    """The next draws of each stream: Python's (uniform and gaussian), NumPy's and torch's."""
    return (
        [random.random() for _ in range(3)],
        [random.gauss(0.0, 1.0) for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
    )


def _saved() -> dict[str, Any]:
    """Streams as a save holds them, from a known seed."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    return rng.capture()


def _refusal(state: object) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        rng.restore(state, where=WHERE)
    return caught.value


# -- what a restore gives back -------------------------------------------------------------------


def test_a_restore_gives_back_the_gaussian_python_had_drawn_ahead() -> None:
    # random.gauss draws its numbers in pairs and keeps the second for its next call: a resumed
    # run that lost it would draw another gaussian than the run it continues.
    random.seed(3)
    random.gauss(0.0, 1.0)
    saved = rng.capture()
    assert type(random.getstate()[2]) is float
    expected = [random.gauss(0.0, 1.0) for _ in range(3)]
    random.seed(4)
    random.gauss(0.0, 1.0)
    rng.restore(saved, where=WHERE)
    assert [random.gauss(0.0, 1.0) for _ in range(3)] == expected


def test_a_restore_gives_back_numpy_keys_at_both_ends_of_a_32_bit_word() -> None:
    saved = _saved()
    keys = saved["numpy"]["keys"]
    keys[0], keys[1], keys[2] = 0, 0xFFFFFFFF, 1
    rng.restore(saved, where=WHERE)
    _, restored, *_ = np.random.get_state()
    assert restored.dtype == np.uint32
    assert restored[:3].tolist() == [0, 0xFFFFFFFF, 1]
    assert np.array_equal(restored, keys.numpy())


def test_a_restore_accepts_numpy_at_the_end_of_its_words() -> None:
    # Position 624: every word used, the next draw makes new ones.
    saved = _saved()
    saved["numpy"]["pos"] = 624
    rng.restore(saved, where=WHERE)
    assert np.random.get_state()[2] == 624


def _cuda_used_on(monkeypatch: pytest.MonkeyPatch, devices: int) -> list[tuple[Any, Any]]:
    """Make this process one that has used ``devices`` CUDA devices; list each stream set."""
    streams = [torch.full((8,), index + 1, dtype=torch.uint8) for index in range(devices)]
    put: list[tuple[Any, Any]] = []

    def set_rng_state(new_state: Any, device: Any = "cuda") -> None:
        put.append((new_state, device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in streams])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return put


def test_a_restore_puts_each_cuda_devices_stream_back_on_that_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    put = _cuda_used_on(monkeypatch, 2)
    saved = rng.capture()
    rng.restore(saved, where=WHERE)
    assert [device for _, device in put] == [0, 1]
    assert all(isinstance(state, torch.Tensor) for state, _ in put)
    assert [state.tolist() for state, _ in put] == [[1] * 8, [2] * 8]


def test_a_save_with_streams_of_more_cuda_devices_than_this_process_sees_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    put = _cuda_used_on(monkeypatch, 2)
    saved = rng.capture()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    error = _refusal(saved)
    assert error.message == f"{WHERE} holds the streams of 2 CUDA devices; this process sees 1."
    assert error.hint == "Resume with as many visible devices per process as the run had."
    assert put == []


def test_a_save_with_cuda_streams_is_refused_where_cuda_is_unavailable_though_nvml_counts_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch counts GPUs through NVML before CUDA starts: a driver too old for this torch still
    # shows its GPU there, while CUDA itself, and so is_available(), finds none.
    put = _cuda_used_on(monkeypatch, 1)
    saved = rng.capture()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    error = _refusal(saved)
    assert error.message == f"{WHERE} holds the streams of 1 CUDA devices; this process sees 0."
    assert error.hint == "Resume with as many visible devices per process as the run had."
    assert put == []


# -- what a restore refuses -----------------------------------------------------------------------


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """A change of one field of a save (``path``: keys joined by dots)."""
    *parents, last = path.split(".")

    def change(state: dict[str, Any]) -> None:
        for key in parents:
            state = state[key]
        state[last] = value

    return change


def _set_word(path: str, index: int, value: int) -> Callable[[dict[str, Any]], None]:
    """A change of one word of a save's Python stream or NumPy keys."""

    def change(state: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            state = state[key]
        words = state[last]
        if isinstance(words, torch.Tensor):
            state[last] = words.clone()
            state[last][index] = value
        else:
            words[index] = value

    return change


BYTES = "is not a generator state (a 1-D uint8 tensor)"
KEYS = "NumPy's stream has malformed keys (not 624 32-bit words)"
MALFORMED: list[Any] = [
    pytest.param(_set("python", "x"), "Python's stream is not a mapping", id="python"),
    pytest.param(_set("python.internal", (1, 2)), "Python's stream is not a list", id="internal"),
    pytest.param(
        _set("python.internal", [0] * 1001),
        "Python's stream has more than 1000 items",
        id="internal-length",
    ),
    pytest.param(
        _set_word("python.internal", 5, 1 << 32),
        "Python's stream is out of range (0 to 4294967295)",
        id="internal-word",
    ),
    pytest.param(
        _set_word("python.internal", 5, -1),
        "Python's stream is out of range (0 to 4294967295)",
        id="internal-negative",
    ),
    pytest.param(
        _set("python.internal", ["1"] * 625), "Python's stream is not an integer", id="internal-str"
    ),
    pytest.param(
        _set("python.gauss", "0.5"),
        "Python's stream has a malformed cached gaussian",
        id="gauss",
    ),
    pytest.param(
        _set("python.gauss", 1), "Python's stream has a malformed cached gaussian", id="gauss-int"
    ),
    pytest.param(_set("python.version", "3"), "Python's version is not an integer", id="version"),
    pytest.param(
        _set("python.version", 11),
        "Python's version is out of range (0 to 10)",
        id="version-range",
    ),
    pytest.param(_set("torch", [0] * 5056), f"torch's CPU stream {BYTES}", id="torch-list"),
    pytest.param(
        _set("torch", torch.zeros(5056, dtype=torch.float32)),
        f"torch's CPU stream {BYTES}",
        id="torch-dtype",
    ),
    pytest.param(
        _set("torch", torch.zeros(2, 2528, dtype=torch.uint8)),
        f"torch's CPU stream {BYTES}",
        id="torch-shape",
    ),
    pytest.param(_set("cuda", "x"), "CUDA is not a list", id="cuda"),
    pytest.param(
        _set("cuda", [torch.zeros(2, 8, dtype=torch.uint8)]),
        f"a CUDA stream {BYTES}",
        id="cuda-shape",
    ),
    pytest.param(
        _set("cuda", [torch.zeros(8, dtype=torch.int64)]), f"a CUDA stream {BYTES}", id="cuda-dtype"
    ),
    pytest.param(_set("numpy", ["MT19937"]), "NumPy's stream is not a mapping", id="numpy"),
    pytest.param(_set("numpy.kind", 5), "NumPy's generator is not a string", id="kind"),
    pytest.param(
        _set("numpy.kind", "M" * 33),
        "NumPy's generator is longer than 32 characters",
        id="kind-length",
    ),
    pytest.param(
        _set("numpy.kind", "PCG64"),
        "NumPy's stream is not of the MT19937 generator",
        id="kind-other",
    ),
    pytest.param(_set("numpy.keys", [0] * 624), KEYS, id="keys-list"),
    pytest.param(_set("numpy.keys", torch.zeros(624, dtype=torch.int32)), KEYS, id="keys-dtype"),
    pytest.param(_set("numpy.keys", torch.zeros(623, dtype=torch.int64)), KEYS, id="keys-shape"),
    pytest.param(_set_word("numpy.keys", 9, -1), KEYS, id="keys-negative"),
    pytest.param(_set_word("numpy.keys", 9, 1 << 32), KEYS, id="keys-33-bits"),
    pytest.param(
        _set("numpy.cached_gaussian", "0.0"),
        "NumPy's stream has a malformed cached gaussian",
        id="cached-gaussian",
    ),
    pytest.param(_set("numpy.pos", 3.0), "NumPy's position is not an integer", id="pos"),
    pytest.param(
        _set("numpy.pos", 625), "NumPy's position is out of range (0 to 624)", id="pos-range"
    ),
    pytest.param(
        _set("numpy.has_gauss", True), "NumPy's gaussian flag is not an integer", id="has-gauss"
    ),
    pytest.param(
        _set("numpy.has_gauss", 2),
        "NumPy's gaussian flag is out of range (0 to 1)",
        id="has-gauss-range",
    ),
]


@pytest.mark.parametrize(("change", "problem"), MALFORMED)
def test_a_malformed_field_is_refused_with_a_message_that_names_it(
    change: Callable[[dict[str, Any]], None], problem: str
) -> None:
    saved = _saved()
    expected = _draws()
    changed = copy.deepcopy(saved)
    change(changed)
    rng.restore(saved, where=WHERE)
    error = _refusal(changed)
    assert error.message == f"{CANNOT}{problem}."
    assert error.hint == DAMAGED
    assert _draws() == expected


@pytest.mark.parametrize("state", ["x", [], None], ids=["str", "list", "none"])
def test_streams_that_are_not_a_mapping_are_refused(state: object) -> None:
    error = _refusal(state)
    assert error.message == f"{CANNOT}the random streams is not a mapping."
    assert error.hint == DAMAGED


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_set("python.internal", [0] * 624), id="python-words"),
        pytest.param(_set("torch", torch.zeros(10, dtype=torch.uint8)), id="torch-size"),
    ],
)
def test_a_stream_its_generator_refuses_is_a_checkpoint_error(
    change: Callable[[dict[str, Any]], None],
) -> None:
    # Well-formed as far as gpukit checks, refused by Python or torch themselves.
    changed = _saved()
    change(changed)
    error = _refusal(changed)
    assert error.message.startswith(CANNOT)
    assert error.message.endswith(".")
    assert len(error.message) > len(CANNOT) + 1
    assert error.hint == DAMAGED


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_a_restore_that_torch_refuses_leaves_every_stream_as_it_was() -> None:
    # Python's stream comes back first; torch checks its state's size only when given it.
    changed = _saved()
    changed["torch"] = torch.zeros(10, dtype=torch.uint8)
    _seed_all(8)
    expected = _draws()
    _seed_all(8)
    _refusal(changed)
    assert _draws() == expected
