"""Reading one checkpoint file: its format from its bytes, its devices, and errors that say why.

The expected messages here are written out by hand: they are what a user reads when a file
cannot be loaded, and each names the file, what is wrong with it, and what to do next.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import gpukit as gk
from gpukit.checkpoint import single_file as ckpt_io
from gpukit.errors import CheckpointError, InvalidArgumentError, UntrustedCheckpointError

DAMAGED_HINT = (
    "The file is probably truncated or corrupted (an interrupted copy or save); save or "
    "download it again."
)
UNTRUSTED_HINT = (
    "If you made this file or trust where it came from, pass trust=True (gpukit ckpt: --trust). "
    "Then re-save it with gk.save to get a file that needs no trust."
)
MISSING_CODE_HINT = (
    "Load it from a program that imports the code defining it (the training script's package), "
    "then re-save the weights with gk.save to get a file that needs no code."
)
NOT_A_CHECKPOINT_HINT = (
    "gk.load reads files written by torch.save or safetensors (*.pt, *.pth, *.safetensors)."
)


def _net() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _load_error(path: Path, *, trust: bool = False) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        gk.load(_net(), path, trust=trust)
    return caught.value


def _header(length: int, rest: bytes = b"{") -> bytes:
    """The first bytes of a safetensors file: the header's length (8 bytes, little-endian)."""
    return struct.pack("<Q", length) + rest


# --- the format, from the name (for saving) and from the bytes (for loading) ---


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("m.safetensors", "safetensors"),
        ("M.SafeTensors", "safetensors"),
        ("m.pt", "torch"),
        ("m.pth", "torch"),
        ("m.bin", "torch"),
        ("m.ckpt", "torch"),
        ("m.tar", "torch"),
        ("LAST.PT", "torch"),
    ],
)
def test_the_suffix_picks_the_format_whatever_its_case(name: str, expected: str):
    assert ckpt_io.suffix_format(Path("run") / name) == expected


@pytest.mark.parametrize(
    ("name", "shown"), [("m.weights", "'.weights'"), ("model.pt.gz", "'.gz'"), ("m", "'no suffix'")]
)
def test_an_unknown_suffix_is_a_usage_error_naming_it_and_the_known_ones(name: str, shown: str):
    with pytest.raises(InvalidArgumentError) as caught:
        ckpt_io.suffix_format(Path("run") / name)
    assert caught.value.message == (
        f"{name}: gpukit picks the checkpoint layout from the suffix, and {shown} is not one "
        "it knows."
    )
    assert caught.value.hint == (
        "Name the file *.safetensors (weights only) or *.pt / *.pth (anything torch.save can "
        "hold), or give no suffix for a sharded folder."
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "empty"),
        (b"\n", "text"),
        (b"PK\x03\x04" + b"\0" * 20, "torch"),  # a zip archive: torch.save's format
        (b"\x80\x02\x8a\x0a", "torch"),  # a pickle: torch's format before 1.6
        (b"\x93NUMPY\x01\x00", "numpy or HDF5 data"),
        (b"\x89HDF\r\n\x1a\n", "numpy or HDF5 data"),
        (b"\xff\xfe\x00\x01binary", "unknown binary data"),
        (b"epoch 3: loss 0.2\n", "text"),
        # safetensors: an 8-byte header length, then the header's JSON object
        (_header(1), "safetensors"),  # nine bytes: the shortest header start there is
        (_header(0), "text"),  # a header of no bytes cannot hold "{"
        (_header(100 << 20), "safetensors"),  # the library's limit, 100 MiB, is allowed
        (_header((100 << 20) + 1), "text"),  # one byte more is not a safetensors header
        (_header(2, b"[]"), "text"),  # the header is a JSON object or nothing
        (struct.pack(">Q", 2) + b"{}", "text"),  # the length is little-endian
    ],
)
def test_the_format_is_read_from_the_first_bytes(tmp_path: Path, content: bytes, expected: str):
    path = tmp_path / "file.pt"
    path.write_bytes(content)
    assert ckpt_io.file_format(path) == expected


def test_a_safetensors_header_start_cut_before_its_ninth_byte_is_not_safetensors(tmp_path: Path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(_header(1, b""))  # the length alone: 8 bytes
    assert ckpt_io.file_format(path) == "text"


def test_text_whose_first_64_bytes_end_inside_a_character_is_still_text(tmp_path: Path):
    path = tmp_path / "notes.pt"
    # "é" is two bytes, the 64th and the 65th: the first 64 end inside it.
    path.write_bytes(("x" * 63 + "é, learning rate 0.1\n").encode())
    assert ckpt_io.file_format(path) == "text"


def test_an_empty_file_is_not_a_checkpoint_and_the_error_says_it_has_0_bytes(tmp_path: Path):
    path = tmp_path / "m.pt"
    path.write_bytes(b"")
    error = _load_error(path)
    assert error.message == f"{path} (0 bytes) is not a checkpoint: its content looks like empty."
    assert error.hint == NOT_A_CHECKPOINT_HINT


def test_a_numpy_file_is_not_a_checkpoint_and_the_error_says_what_it_is(tmp_path: Path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"\x93NUMPY\x01\x00v\x00" + b" " * 118)  # 128 bytes
    error = _load_error(path)
    assert error.message == (
        f"{path} (128 bytes) is not a checkpoint: its content looks like numpy or HDF5 data."
    )


def test_reading_a_folder_as_one_file_is_refused(tmp_path: Path):
    with pytest.raises(CheckpointError) as caught:
        ckpt_io.read(tmp_path, target=None, trust=False)
    assert caught.value.message == f"{tmp_path} is a folder, not a checkpoint file."
    assert caught.value.hint == "Pass the file inside it (*.pt, *.pth or *.safetensors)."


# --- files cut short or damaged ---


def test_a_torch_zip_cut_short_is_named_as_such_with_its_size(tmp_path: Path):
    torch.save(_net().state_dict(), tmp_path / "m.pt")
    cut = tmp_path / "cut.pt"
    cut.write_bytes((tmp_path / "m.pt").read_bytes()[:700])
    error = _load_error(cut)
    assert error.message == (
        f"{cut} (700 bytes) is a torch.save zip archive cut short (its central directory is "
        "missing)."
    )
    assert error.hint == DAMAGED_HINT


def test_a_safetensors_file_cut_inside_its_header_says_how_long_the_header_is(tmp_path: Path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(_header(61, b'{"w": {"dtype"'))  # 22 bytes of the 69 the header needs
    error = _load_error(path)
    assert error.message == (
        f"{path} (22 bytes) is a safetensors file cut short (its header alone needs 69 bytes)."
    )
    assert error.hint == DAMAGED_HINT


def test_a_safetensors_file_cut_right_after_its_header_is_damaged_not_cut_inside_it(
    tmp_path: Path,
):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    assert len(header) == 61
    path = tmp_path / "cut.safetensors"
    path.write_bytes(_header(61, header))  # 69 bytes: the whole header, none of the data
    error = _load_error(path)
    assert error.message == (
        f"{path} (69 bytes) looks like a safetensors file but cannot be read (Error while "
        "deserializing header: incomplete metadata, file not fully covered)."
    )


def test_a_damaged_pickle_is_unreadable_not_untrusted_when_the_file_is_trusted(tmp_path: Path):
    path = tmp_path / "m.pt"
    path.write_bytes(b"\x80\x02garbage")
    error = _load_error(path, trust=True)
    assert type(error) is CheckpointError
    assert error.message == (
        f"{path} (9 bytes) looks like a torch.save file but cannot be read (pickle data was "
        "truncated)."
    )
    assert error.hint == DAMAGED_HINT


def test_an_error_without_a_message_is_named_by_its_type(tmp_path: Path):
    whole = tmp_path / "old.pt"
    torch.save(_net().state_dict(), whole, _use_new_zipfile_serialization=False)
    path = tmp_path / "cut.pt"
    path.write_bytes(whole.read_bytes()[:5])  # torch's weights-only reader: a bare EOFError
    error = _load_error(path)
    assert error.message == (
        f"{path} (5 bytes) looks like a torch.save file but cannot be read (EOFError)."
    )


def test_only_the_first_sentence_of_the_reason_is_shown(tmp_path: Path):
    torch.save(_net().state_dict(), tmp_path / "m.pt")
    path = tmp_path / "m.pt"
    cause = RuntimeError("first part. second part.\nthird line")
    error = ckpt_io.unreadable_error(path, "torch", cause)
    size = path.stat().st_size
    assert error.message == (
        f"{path} ({size} bytes) looks like a torch.save file but cannot be read (first part)."
    )


def test_only_the_full_stop_is_taken_off_the_end_of_the_reason(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"not safetensors at all")
    error = ckpt_io.unreadable_error(path, "safetensors", ValueError("unknown dtype F8X."))
    assert error.message.endswith("cannot be read (unknown dtype F8X).")


def test_a_reason_on_several_lines_shows_its_first_line_without_the_full_stop(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"not safetensors at all")
    error = ckpt_io.unreadable_error(path, "safetensors", ValueError("bad dtype.\nat offset 8"))
    assert error.message == (
        f"{path} (22 bytes) looks like a safetensors file but cannot be read (bad dtype)."
    )


@pytest.mark.parametrize("cut", range(1, 33))
def test_an_old_format_checkpoint_cut_anywhere_in_its_first_bytes_is_a_checkpoint_error(
    tmp_path: Path, cut: int
):
    whole = tmp_path / "old.pt"
    torch.save(_net().state_dict(), whole, _use_new_zipfile_serialization=False)
    path = tmp_path / "cut.pt"
    path.write_bytes(whole.read_bytes()[:cut])
    # Not an IndexError or struct.error from deep inside the unpickler: a typed error that
    # names the file.
    assert str(path) in _load_error(path).message
    assert str(path) in _load_error(path, trust=True).message


# --- trust: what a file that would run code says ---


class _RunsCode:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (shutil.rmtree, ("/nonexistent-folder",))


def test_a_pickle_that_names_a_function_is_refused_naming_that_function(tmp_path: Path):
    path = tmp_path / "evil.pt"
    torch.save({"model": _net().state_dict(), "x": _RunsCode()}, path)
    with pytest.raises(UntrustedCheckpointError) as caught:
        gk.load(_net(), path)
    assert caught.value.message == (
        f"{path} holds a reference to shutil.rmtree, which loading would have to run as code; "
        "refused because the file is not trusted (torch.load weights_only=True)."
    )
    assert caught.value.hint == UNTRUSTED_HINT


class Hyper:
    """A custom class, pickled by reference."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_a_refusal_that_names_no_global_says_the_file_holds_python_objects(tmp_path: Path):
    path = tmp_path / "p4.pt"
    # Protocol 4 names classes with STACK_GLOBAL, which torch's refusal does not spell out.
    torch.save({"model": _net().state_dict(), "h": Hyper(0.1)}, path, pickle_protocol=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the protocol
        with pytest.raises(UntrustedCheckpointError) as caught:
            gk.load(_net(), path)
    assert caught.value.message == (
        f"{path} holds Python objects other than tensors, which loading would have to run as "
        "code; refused because the file is not trusted (torch.load weights_only=True)."
    )


def test_a_trusted_file_with_python_objects_loads_them(tmp_path: Path):
    path = tmp_path / "t.pt"
    torch.save({"model": _net().state_dict(), "h": Hyper(0.5)}, path)
    report = gk.load(_net(), path, trust=True)
    assert report.extras["h"].lr == 0.5


@contextlib.contextmanager
def _class_in(module_name: str, name: str) -> Iterator[type]:
    """A class that lives in ``module_name`` only while the block runs."""
    module = sys.modules.get(module_name) or types.ModuleType(module_name)
    created = module_name not in sys.modules
    cls = type(name, (), {"__module__": module_name})
    setattr(module, name, cls)
    sys.modules[module_name] = module
    try:
        yield cls
    finally:
        delattr(module, name)
        if created:
            del sys.modules[module_name]


def test_a_trusted_file_needing_a_missing_package_names_it_and_says_what_to_do(tmp_path: Path):
    path = tmp_path / "t.pt"
    with _class_in("lost_training_package", "Config") as config:
        torch.save({"model": _net().state_dict(), "cfg": config()}, path)
    error = _load_error(path, trust=True)
    assert error.message == (
        f"{path} holds pickled objects that need lost_training_package, which this Python "
        "cannot import."
    )
    assert error.hint == MISSING_CODE_HINT


def test_a_trusted_file_needing_a_class_of_the_training_script_says_so(tmp_path: Path):
    path = tmp_path / "t.pt"
    with _class_in("__main__", "TrainConfig") as config:
        torch.save({"model": _net().state_dict(), "cfg": config()}, path)
    error = _load_error(path, trust=True)
    assert error.message == (
        f"{path} holds pickled objects that need TrainConfig (from the script that saved it), "
        "which this Python cannot import."
    )
    assert error.hint == MISSING_CODE_HINT


def test_a_trusted_file_needing_a_class_its_package_lost_names_the_package(tmp_path: Path):
    path = tmp_path / "t.pt"
    with _class_in("json", "OldConfig") as config:  # a module that stays, a class that goes
        torch.save({"model": _net().state_dict(), "cfg": config()}, path)
    error = _load_error(path, trust=True)
    assert error.message == (
        f"{path} holds pickled objects that need OldConfig (from json), which this Python "
        "cannot import."
    )


class _NeedsCupy:
    """An object whose class refuses to be rebuilt without an optional library."""

    def __init__(self) -> None:
        self.data = [1, 2]

    def __setstate__(self, state: object) -> None:
        raise ImportError("GpuArray needs cupy")


def test_an_import_error_that_names_no_module_is_shown_as_its_message(tmp_path: Path):
    path = tmp_path / "t.pt"
    torch.save({"model": _net().state_dict(), "x": _NeedsCupy()}, path)
    error = _load_error(path, trust=True)
    assert error.message == (
        f"{path} holds pickled objects that need GpuArray needs cupy, which this Python cannot "
        "import."
    )


class _MissingAttribute:
    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        return (getattr, (Hyper, "no_such_attribute"))


def test_an_attribute_error_that_names_no_class_is_reported_as_unreadable(tmp_path: Path):
    path = tmp_path / "t.pt"
    torch.save({"model": _net().state_dict(), "x": _MissingAttribute()}, path)
    error = _load_error(path, trust=True)
    size = path.stat().st_size
    assert error.message == (
        f"{path} ({size} bytes) looks like a torch.save file but cannot be read (type object "
        "'Hyper' has no attribute 'no_such_attribute')."
    )


# --- where the tensors were saved, and where they go ---


@contextlib.contextmanager
def _saved_as_if_on(where: dict[int, str]) -> Iterator[None]:
    """Make torch.save tag each CPU storage (by address) with a GPU, as a save there would."""

    def tag(storage: object) -> str | None:
        if getattr(storage, "device", None) != torch.device("cpu"):
            return None
        return where.get(storage.data_ptr())  # type: ignore[attr-defined]

    def never(storage: object, location: str) -> None:
        return None

    torch.serialization.register_package(0, tag, never)
    try:
        yield
    finally:
        registry = torch.serialization._package_registry
        registry[:] = [entry for entry in registry if entry[1] is not tag]


def _two_gpu_file(tmp_path: Path) -> Path:
    a, b, c = torch.ones(2), torch.zeros(3), torch.full((4,), 2.0)
    where = {
        a.untyped_storage().data_ptr(): "cuda:1",
        b.untyped_storage().data_ptr(): "cuda:0",
        c.untyped_storage().data_ptr(): "cuda:1",
    }
    path = tmp_path / "two.pt"
    with _saved_as_if_on(where):
        torch.save({"a": a, "b": b, "c": c}, path)
    return path


def test_each_saved_device_is_listed_once_in_the_order_the_file_holds_them(tmp_path: Path):
    raw = ckpt_io.read(_two_gpu_file(tmp_path), target=None, trust=False)
    assert raw.source_devices == ["cuda:1", "cuda:0"]
    assert all(t.device == torch.device("cpu") for t in raw.content.values())


def test_each_tensor_of_a_two_gpu_file_knows_which_gpu_it_was_saved_from(tmp_path: Path):
    raw = ckpt_io.read(_two_gpu_file(tmp_path), target=torch.device("cpu"), trust=False)
    saved = {key: raw.saved_device(tensor) for key, tensor in raw.content.items()}
    assert saved == {"a": "cuda:1", "b": "cuda:0", "c": "cuda:1"}


def test_a_tensor_the_file_did_not_hold_has_no_saved_device(tmp_path: Path):
    raw = ckpt_io.read(_two_gpu_file(tmp_path), target=None, trust=False)
    assert raw.saved_device(torch.ones(1)) is None


def test_every_tensor_of_a_one_gpu_file_was_saved_from_that_gpu(tmp_path: Path):
    a = torch.ones(2)
    path = tmp_path / "one.pt"
    with _saved_as_if_on({a.untyped_storage().data_ptr(): "cuda:3"}):
        torch.save({"a": a}, path)
    raw = ckpt_io.read(path, target=None, trust=False)
    assert raw.source_devices == ["cuda:3"]
    assert raw.saved_device(torch.ones(1)) == "cuda:3"


def test_tensors_are_mapped_onto_a_device_other_than_the_cpu(tmp_path: Path):
    # "meta" stands in for a GPU here: a device the tensors were not saved on.
    torch.save({"model": _net().state_dict(), "ema": torch.ones(2)}, tmp_path / "m.pt")
    report = gk.load(nn.Linear(4, 2, device="meta"), tmp_path / "m.pt")
    assert report.device == "meta"
    assert report.extras["ema"].device == torch.device("meta")
    assert report.source_devices == ["cpu"]


def test_a_safetensors_file_lists_the_devices_gk_save_recorded(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    meta = {"gpukit": json.dumps({"devices": ["cuda:0", "cuda:1"]})}
    save_file({"weight": torch.ones(2, 4), "bias": torch.ones(2)}, path, metadata=meta)
    raw = ckpt_io.read(path, target=None, trust=False)
    assert raw.source_devices == ["cuda:0", "cuda:1"]
    assert {t.device.type for t in raw.content.values()} == {"cpu"}


def test_a_safetensors_file_from_another_tool_was_saved_from_the_cpu(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.ones(2, 4), "bias": torch.ones(2)}, path)
    report = gk.load(_net(), path)
    assert report.path == path
    assert report.format == "safetensors"
    assert report.source_devices == ["cpu"]
    assert report.metadata == {}
    raw = ckpt_io.read(path, target=torch.device("cpu"), trust=False)
    assert raw.path == path
    assert raw.size == path.stat().st_size


# --- what gk.save recorded ---


@pytest.mark.parametrize("recorded", ["not json {", '["a list"]', '"a string"'])
def test_recorded_metadata_that_is_not_a_json_object_is_ignored(tmp_path: Path, recorded: str):
    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.ones(2, 4), "bias": torch.ones(2)}, path, {"gpukit": recorded})
    report = gk.load(_net(), path)
    assert report.metadata == {}
    assert report.source_devices == ["cpu"]


def test_recorded_metadata_of_a_safetensors_file_is_read_back(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    recorded = {"devices": ["cuda:2"], "metadata": {"run": "b7"}}
    save_file(
        {"weight": torch.ones(2, 4), "bias": torch.ones(2)}, path, {"gpukit": json.dumps(recorded)}
    )
    report = gk.load(_net(), path)
    assert report.metadata == recorded
    assert report.source_devices == ["cuda:2"]


def test_metadata_attached_to_a_torch_file_is_read_back(tmp_path: Path):
    gk.save(_net(), tmp_path / "m.pt", metadata={"epoch": 4})
    raw = ckpt_io.read(tmp_path / "m.pt", target=None, trust=False)
    assert raw.path == tmp_path / "m.pt"
    assert raw.format == "torch"
    assert raw.metadata["metadata"] == {"epoch": 4}
    assert raw.metadata["devices"] == ["cpu"]
    assert raw.size == (tmp_path / "m.pt").stat().st_size


def test_a_metadata_attribute_that_is_not_a_dict_is_ignored():
    state = {"w": torch.ones(1)}
    holder = types.SimpleNamespace(_gpukit_metadata=["not", "a", "dict"])
    assert ckpt_io.gpukit_metadata(holder, {}) == {}
    assert ckpt_io.gpukit_metadata(state, {}) == {}


def test_a_torch_file_named_safetensors_is_read_as_torch(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    torch.save({"w": torch.ones(2)}, path)
    raw = ckpt_io.read(path, target=None, trust=False)
    assert raw.format == "torch"
    assert torch.equal(raw.content["w"], torch.ones(2))
