"""A stranger's checkpoint: hostile metadata, headers, FIFOs, links and memory bombs.

Every such input is a one-line CheckpointError (``gpukit ckpt`` exit code 2), never a
traceback, never a hang, never a read of a file outside the checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import signal
import struct
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import gpukit as gk
from gpukit.checkpoint.atomic import TMP_SUFFIX, atomic_folder
from gpukit.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00001.safetensors"


# --- helpers -----------------------------------------------------------------------------------


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail, instead of hanging, when the block takes longer than ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: it blocked")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _linear(fill: float | None = None) -> nn.Linear:
    model = nn.Linear(3, 2)
    if fill is not None:
        with torch.no_grad():
            model.weight.fill_(fill)
            model.bias.fill_(fill)
    return model


def _dcp_save(folder: Path, fill: float = 1.0) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"model": _linear(fill).state_dict(), "step": 3}, checkpoint_id=folder, no_dist=True
        )
    return folder


def _metadata(folder: Path) -> Any:
    return pickle.loads((folder / ".metadata").read_bytes())  # our own file, just written


def _write_metadata(folder: Path, metadata: Any, pickler: type[pickle.Pickler] = pickle.Pickler):
    buffer = io.BytesIO()
    pickler(buffer, protocol=4).dump(metadata)  # what torch writes
    (folder / ".metadata").write_bytes(buffer.getvalue())


def _shard_folder(folder: Path, header: str | bytes, data: bytes = b"") -> Path:
    """A sharded folder whose one shard has exactly this header text."""
    folder.mkdir()
    raw = header.encode() if isinstance(header, str) else header
    (folder / SHARD).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    (folder / INDEX).write_text(json.dumps({"weight_map": {"w": SHARD}}))
    return folder


def _refused_by_the_command(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    from gpukit.cli.main import main

    code = main(["ckpt", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("gpukit ckpt: ")
    return err


# --- DCP metadata: exact types, never a file outside the folder -------------------------------


class _PathPrintingAs:
    """Pickled as a PosixPath whose slots say one name and whose parts say another path."""

    def __init__(self, shown: str, real: Path) -> None:
        self.shown = shown
        self.real = real


class _DisguisingPickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, _PathPrintingAs):
            slots = {"_str": obj.shown, "_drv": "", "_root": "/", "_parts": list(obj.real.parts)}
            return (pathlib.PosixPath, (), (None, slots))
        return NotImplemented


def test_dcp_metadata_whose_path_prints_as_a_data_file_cannot_read_a_file_outside_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    victim = _dcp_save(tmp_path / "victim", fill=7.0)  # another checkpoint of the same shapes
    hostile = _dcp_save(tmp_path / "hostile", fill=1.0)
    secret = victim / "__0_0.distcp"
    disguised = _PathPrintingAs("__0_0.distcp", secret)
    built = pickle.loads(_disguised_bytes(disguised))
    if str(built) != "__0_0.distcp" or hostile / built != secret:  # pragma: no cover
        pytest.skip("this Python's pathlib keeps no slots that pickle could set this way")
    metadata = _metadata(hostile)
    for info in metadata.storage_data.values():
        info.relative_path = disguised
    _write_metadata(hostile, metadata, _DisguisingPickler)

    model = _linear(0.0)
    with pytest.raises(CheckpointError, match="is not a string"):
        gk.load(model, hostile)
    assert torch.all(model.weight == 0)
    _refused_by_the_command(capsys, "convert", str(hostile), str(tmp_path / "out.pt"))
    assert not (tmp_path / "out.pt").exists()


def _disguised_bytes(obj: _PathPrintingAs) -> bytes:
    buffer = io.BytesIO()
    _DisguisingPickler(buffer, protocol=4).dump(obj)
    return buffer.getvalue()


class _EnumsAsGetattr(pickle.Pickler):
    """Pickles enum members as early Python 3.11 releases do: builtins.getattr(cls, name)."""

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, Enum):
            return (getattr, (type(obj), obj.name))
        return NotImplemented


def test_dcp_folder_written_by_python_3_11_2_with_getattr_enum_members_loads(tmp_path: Path):
    folder = _dcp_save(tmp_path / "dcp", fill=5.0)
    _write_metadata(folder, _metadata(folder), _EnumsAsGetattr)
    assert b"getattr" in (folder / ".metadata").read_bytes()
    model = _linear(0.0)
    assert gk.load(model, folder).ok
    assert torch.all(model.weight == 5)


class _Method:
    def __init__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self) -> None:  # only so that pickle accepts it as a reduce callable
        raise AssertionError


class _Call:
    def __init__(self, method: _Method, args: tuple[object, ...]) -> None:
        self.method, self.args = method, args


class _GetattrPickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, _Method):
            return (getattr, (obj.owner, obj.name))
        if isinstance(obj, _Call):
            return (obj.method, obj.args)
        return NotImplemented


def test_getattr_in_dcp_metadata_of_anything_but_an_allowed_enum_member_is_refused_unrun(
    tmp_path: Path,
):
    folder = _dcp_save(tmp_path / "dcp")
    marker = tmp_path / "ran.txt"
    metadata = _metadata(folder)
    write = _Method(pathlib.PosixPath, "write_text")
    metadata.version = _Call(write, (pathlib.PosixPath(marker), "ran"))
    _write_metadata(folder, metadata, _GetattrPickler)
    with pytest.raises(CheckpointError, match="not plain DCP metadata"):
        gk.load(_linear(), folder)
    assert not marker.exists()


# --- malformed inputs: one typed error each ----------------------------------------------------


def _deep_header(folder: Path) -> Path:
    return _shard_folder(folder, '{"w": ' + "[" * 50000 + "]" * 50000 + "}")


def _entry(folder: Path, entry: str, data: bytes = b"\0" * 4) -> Path:
    return _shard_folder(folder, '{"w": ' + entry + "}", data)


def _deep_index(folder: Path) -> Path:
    _entry(folder, '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}')
    deep = "[" * 50000 + "]" * 50000
    (folder / INDEX).write_text('{"weight_map": {"w": "' + SHARD + '"}, "x": ' + deep + "}")
    return folder / INDEX


def _dcp_changed(change: Callable[[Any], None]) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        _dcp_save(folder)
        metadata = _metadata(folder)
        change(metadata)
        _write_metadata(folder, metadata)
        return folder

    return make


def _storage_of(metadata: Any, fqn: str) -> Any:
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def _set_offset(value: object) -> Callable[[Any], None]:
    def change(metadata: Any) -> None:
        _storage_of(metadata, "model.weight").offset = value

    return change


def _huge_tensor(metadata: Any) -> None:
    item = metadata.state_dict_metadata["model.weight"]
    item.size = torch.Size([2**40, 2**40])
    item.chunks[0].sizes = torch.Size([2**40, 2**40])


def _huge_compressed_tensor(metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    item = metadata.state_dict_metadata["model.weight"]
    item.size = item.chunks[0].sizes = torch.Size([2**61])
    item.chunks[0].offsets = torch.Size([0])
    key = next(index for index in metadata.storage_data if index.fqn == "model.weight")
    info = metadata.storage_data.pop(key)
    info.transform_descriptors = ["stream.zstd"]  # compressed: its length bounds nothing
    metadata.storage_data[MetadataIndex("model.weight", [0])] = info


def _bytes_at_minus_100(metadata: Any) -> None:
    _storage_of(metadata, "step").offset = -100


def _paths_that_disagree(metadata: Any) -> None:
    metadata.planner_data["model.weight"] = ("model", 0)  # a list here, a dict for model.bias


MALFORMED: dict[str, Callable[[Path], Path]] = {
    "shard header 50000 deep": _deep_header,
    "shape [1e999]": lambda f: _entry(
        f, '{"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}'
    ),
    "data_offsets [0, 1e999]": lambda f: _entry(
        f, '{"dtype": "F32", "shape": [1], "data_offsets": [0, 1e999]}'
    ),
    "__metadata__ not a dict": lambda f: _shard_folder(
        f,
        '{"__metadata__": [1, 2], "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        b"\0" * 4,
    ),
    "__metadata__ gpukit not a string": lambda f: _shard_folder(
        f,
        '{"__metadata__": {"gpukit": 5}, "w": {"dtype": "F32", "shape": [1], '
        '"data_offsets": [0, 4]}}',
        b"\0" * 4,
    ),
    "shape [-1]": lambda f: _entry(f, '{"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}'),
    "shape [2**40, 2**40]": lambda f: _entry(
        f, f'{{"dtype": "F32", "shape": [{2**40}, {2**40}], "data_offsets": [0, 4]}}'
    ),
    "index file 50000 deep": _deep_index,
    "DCP offset a string": _dcp_changed(_set_offset("12")),
    "DCP offset a list": _dcp_changed(_set_offset([12])),
    "DCP state_dict_metadata a list": _dcp_changed(
        lambda m: setattr(m, "state_dict_metadata", [1])
    ),
    "DCP tensor 2**40 x 2**40": _dcp_changed(_huge_tensor),
    "DCP compressed tensor of 2**61 floats": _dcp_changed(_huge_compressed_tensor),
    "DCP bytes entry at offset -100": _dcp_changed(_bytes_at_minus_100),
    "DCP storage_data None": _dcp_changed(lambda m: setattr(m, "storage_data", None)),
    "DCP planner paths that disagree": _dcp_changed(_paths_that_disagree),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_checkpoint_is_one_checkpoint_error_for_load_and_show(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = MALFORMED[case](tmp_path / "ckpt")
    with _deadline(30), pytest.raises(CheckpointError):
        gk.load(_linear(), path)
    with _deadline(30):
        _refused_by_the_command(capsys, "show", str(path))


# --- FIFOs in a folder: refused at once, never waited on -------------------------------------


def _fifo_config(folder: Path) -> Path:
    gk.save(_linear(), folder, max_shard_size=64)
    os.mkfifo(folder / "config.json")
    return folder


def _link_to_fifo(folder: Path) -> Path:
    folder.mkdir()
    os.mkfifo(folder.parent / "pipe")
    os.symlink(folder.parent / "pipe", folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("make", [_fifo_config, _link_to_fifo], ids=["config.json", "link"])
def test_a_fifo_in_a_checkpoint_folder_is_refused_without_waiting(
    make: Callable[[Path], Path], tmp_path: Path, run_cli
):
    folder = make(tmp_path / "ckpt")
    with _deadline(30), pytest.raises(CheckpointError, match="FIFO"):
        gk.load(_linear(), folder)
    for args in (["show", str(folder)], ["convert", str(folder), str(tmp_path / "out.pt")]):
        result = run_cli("ckpt", *args, timeout=60)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert "FIFO" in result.stderr


# --- memory bombs: bounded before anything is read ---------------------------------------------


@contextmanager
def _peak_allocation() -> Iterator[list[int]]:
    found: list[int] = []
    tracemalloc.start()
    try:
        yield found
    finally:
        found.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_a_shard_header_length_past_100_mb_is_refused_without_reading_it(tmp_path: Path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    claimed = 200_000_000
    with open(folder / SHARD, "wb") as handle:  # sparse: the claimed bytes cost no disk
        handle.write(struct.pack("<Q", claimed))
        handle.truncate(8 + claimed)
    (folder / INDEX).write_text(json.dumps({"weight_map": {"w": SHARD}}))
    with _peak_allocation() as peak, pytest.raises(CheckpointError, match="more than 100000000"):
        gk.load(_linear(), folder)
    assert peak[0] < 20_000_000


def test_dcp_planner_data_asking_for_a_list_index_far_past_its_entries_is_refused(tmp_path: Path):
    folder = _dcp_save(tmp_path / "dcp")
    metadata = _metadata(folder)
    metadata.planner_data["step"] = ("steps", 10**7)  # old readers appended ten million Nones
    _write_metadata(folder, metadata)
    with _peak_allocation() as peak, pytest.raises(CheckpointError, match="DCP metadata"):
        gk.load(_linear(), folder)
    assert peak[0] < 20_000_000


def test_dcp_planner_path_of_100000_steps_is_refused_at_once(tmp_path: Path):
    folder = _dcp_save(tmp_path / "dcp")
    metadata = _metadata(folder)
    metadata.planner_data["step"] = tuple(["x"] * 100_000)
    _write_metadata(folder, metadata)
    with _deadline(20), pytest.raises(CheckpointError, match="steps"):
        gk.load(_linear(), folder)


# --- links in a folder: inside it, or into a Hugging Face cache's blobs ------------------------


def _hf_cache(cache: Path) -> Path:
    """A Hugging Face cache snapshot whose files are links into the repository's blobs/."""
    repo = cache / "models--org--name"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    gk.save(_linear(3.0), tmp := cache / "saved", max_shard_size=16)
    for number, name in enumerate(sorted(os.listdir(tmp))):
        blob = repo / "blobs" / f"{number:040x}"
        os.rename(tmp / name, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot


def test_a_hugging_face_cache_snapshot_of_links_into_blobs_loads(tmp_path: Path):
    snapshot = _hf_cache(tmp_path / "hub")
    model = _linear(0.0)
    assert gk.load(model, snapshot).ok
    assert torch.all(model.weight == 3)


def _link_out_of_a_folder(tmp_path: Path) -> Path:
    (tmp_path / "private").mkdir()
    save_file(_linear(9.0).state_dict(), tmp_path / "private" / "model.safetensors")
    folder = tmp_path / "shared"
    folder.mkdir()
    os.symlink(tmp_path / "private" / "model.safetensors", folder / "model.safetensors")
    return folder


def _shard_link_out_of_a_snapshot(tmp_path: Path) -> Path:
    snapshot = _hf_cache(tmp_path / "hub")
    (tmp_path / "private").mkdir()
    gk.save(_linear(9.0), tmp_path / "private" / "w", max_shard_size=16)
    shard = sorted(p for p in snapshot.iterdir() if p.name != INDEX)[0]
    shard.unlink()
    os.symlink(tmp_path / "private" / "w" / shard.name, shard)
    return snapshot


def _dcp_data_link_out(tmp_path: Path) -> Path:
    _dcp_save(tmp_path / "private", fill=9.0)
    folder = _dcp_save(tmp_path / "shared", fill=1.0)
    (folder / "__0_0.distcp").unlink()
    os.symlink(tmp_path / "private" / "__0_0.distcp", folder / "__0_0.distcp")
    return folder


@pytest.mark.parametrize(
    "make",
    [_link_out_of_a_folder, _shard_link_out_of_a_snapshot, _dcp_data_link_out],
    ids=["single file", "hf shard", "dcp data file"],
)
def test_a_link_from_a_checkpoint_folder_to_a_file_outside_it_is_refused(
    make: Callable[[Path], Path], tmp_path: Path
):
    folder = make(tmp_path)
    model = _linear(0.0)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        gk.load(model, folder)
    assert torch.all(model.weight == 0)


def test_a_checkpoint_file_the_user_names_may_itself_be_a_link(tmp_path: Path):
    folder = _link_out_of_a_folder(tmp_path)
    assert gk.load(_linear(), folder / "model.safetensors").ok


# --- folder saves in a folder others can write -------------------------------------------------


def _planting(target: Path, link_to: Path) -> Callable[[Path], None]:
    def fill(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"new")
        os.symlink(link_to, target)  # a co-user, while the save is being written

    return fill


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "replacing a folder"])
def test_a_link_planted_at_a_folder_save_target_is_refused_and_left_untouched(
    existing: bool, tmp_path: Path
):
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    target = tmp_path / "out"
    fill = _planting(target, elsewhere)
    if existing:
        target.mkdir()

        def fill(folder: Path) -> None:
            (folder / "model.safetensors").write_bytes(b"new")
            os.rename(target, tmp_path / "moved")
            os.symlink(elsewhere, target)

    with pytest.raises(CheckpointError, match=f"Cannot save {target}: a symbolic link"):
        atomic_folder(target, fill)
    assert target.is_symlink()
    assert os.readlink(target) == str(elsewhere)
    assert sorted(os.listdir(elsewhere)) == ["keep.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(TMP_SUFFIX)]


def test_dcp_metadata_that_copies_one_list_ten_thousand_times_is_refused_in_small_memory(
    tmp_path: Path,
):
    folder = _dcp_save(tmp_path / "dcp")
    # By hand: memo 0 = builtins.list, memo 1 = a list of 1000 zeros, then 10000 times
    # list(memo 1) appended to one list: 60 KB of pickle, 10 million list slots when run.
    copy = pickle.BINGET + b"\x00" + pickle.BINGET + b"\x01" + pickle.TUPLE1 + pickle.REDUCE
    data = (
        pickle.PROTO + b"\x04"
        + pickle.SHORT_BINUNICODE + b"\x08builtins" + pickle.SHORT_BINUNICODE + b"\x04list"
        + pickle.STACK_GLOBAL + pickle.MEMOIZE
        + pickle.EMPTY_LIST + pickle.MARK + (pickle.BININT1 + b"\x00") * 1000 + pickle.APPENDS
        + pickle.MEMOIZE
        + pickle.EMPTY_LIST + pickle.MARK + copy * 10_000 + pickle.APPENDS + pickle.STOP
    )  # fmt: skip
    (folder / ".metadata").write_bytes(data)
    with _peak_allocation() as peak, pytest.raises(CheckpointError, match="far more than"):
        gk.load(_linear(), folder)
    assert peak[0] < 20_000_000


def test_convert_to_a_new_folder_where_a_link_is_planted_meanwhile_exits_2_and_keeps_the_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    import gpukit.checkpoint.api as api

    source = tmp_path / "model.safetensors"
    save_file(_linear().state_dict(), source)
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    target = tmp_path / "out"
    write_shards = api.write_shards

    def write_then_plant(folder: Path, *args: Any) -> None:
        write_shards(folder, *args)
        os.symlink(elsewhere, target)  # a co-user, while the conversion runs

    monkeypatch.setattr(api, "write_shards", write_then_plant)
    err = _refused_by_the_command(capsys, "convert", str(source), str(target))
    assert str(target) in err
    assert os.readlink(target) == str(elsewhere)
    assert os.listdir(elsewhere) == []


_SIZES = st.integers(min_value=-2, max_value=8) | st.sampled_from([2**40, 2**64, -(2**63)])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | _SIZES | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "I64", "BOOL", "U8"]) | _JSON_VALUES,
        "shape": st.lists(_SIZES | st.floats(), max_size=3) | _JSON_VALUES,
        "data_offsets": st.lists(st.integers(0, 64), min_size=2, max_size=2)
        | st.lists(_SIZES | st.floats(), max_size=3)
        | _JSON_VALUES,
    }
)
_HEADERS = st.fixed_dictionaries(
    {"w": _ENTRY | _JSON_VALUES},
    optional={"__metadata__": st.dictionaries(st.text(max_size=6), _JSON_VALUES) | _JSON_VALUES},
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(header=_HEADERS)
def test_any_shard_header_document_loads_or_is_one_checkpoint_error(
    header: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
):
    folder = tmp_path_factory.mktemp("ckpt") / "sharded"
    text = json.dumps(header).replace("Infinity", "1e999")  # an overflowing number, as JSON
    _shard_folder(folder, text, b"\0" * 64)
    with suppress(CheckpointError):
        gk.load(_linear(), folder, strict=False)


def _weight_storage(metadata: Any) -> Any:
    return _storage_of(metadata, "model.weight")


_DCP_FIELDS: dict[str, Callable[[Any, Any], None]] = {
    "relative_path": lambda m, v: setattr(_weight_storage(m), "relative_path", v),
    "offset": lambda m, v: setattr(_weight_storage(m), "offset", v),
    "length": lambda m, v: setattr(_weight_storage(m), "length", v),
    "size": lambda m, v: setattr(m.state_dict_metadata["model.weight"], "size", v),
    "chunks": lambda m, v: setattr(m.state_dict_metadata["model.weight"], "chunks", v),
    "chunk sizes": lambda m, v: setattr(
        m.state_dict_metadata["model.weight"].chunks[0], "sizes", v
    ),
    "dtype": lambda m, v: setattr(m.state_dict_metadata["model.weight"].properties, "dtype", v),
    "entry": lambda m, v: m.state_dict_metadata.__setitem__("model.weight", v),
    "planner path": lambda m, v: m.planner_data.__setitem__("model.weight", v),
    "planner_data": lambda m, v: setattr(m, "planner_data", v),
    "storage key": lambda m, v: m.storage_data.__setitem__(v, _weight_storage(m)),
}
_DCP_VALUES = (
    _JSON_VALUES
    | st.sampled_from([torch.float32, torch.Size([2, 3]), torch.Size([-1]), pathlib.PurePath("x")])
    | st.tuples(st.text(max_size=3) | _SIZES, st.text(max_size=3) | _SIZES)
)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(field=st.sampled_from(list(_DCP_FIELDS)), value=_DCP_VALUES)
def test_any_value_in_any_dcp_metadata_field_loads_or_is_one_checkpoint_error(
    field: str, value: Any, tmp_path_factory: pytest.TempPathFactory
):
    folder = tmp_path_factory.mktemp("dcp") / "dcp"
    _dcp_save(folder)
    metadata = _metadata(folder)
    try:
        _DCP_FIELDS[field](metadata, value)
    except TypeError:  # an unhashable storage key
        return
    _write_metadata(folder, metadata)
    with suppress(CheckpointError):
        gk.load(_linear(), folder, strict=False)


def test_a_dcp_tensor_entry_pointing_at_the_wrong_bytes_is_one_checkpoint_error(tmp_path: Path):
    folder = _dcp_save(tmp_path / "dcp")
    metadata = _metadata(folder)
    _storage_of(metadata, "model.weight").offset += 1  # still inside the file, not a tensor
    _write_metadata(folder, metadata)
    model = _linear(0.0)
    unreadable = r"cannot be read as a DCP checkpoint \(UnpicklingError"
    with pytest.raises(CheckpointError, match=unreadable):
        gk.load(model, folder)
    assert torch.all(model.weight == 0)


def test_metadata_recorded_in_a_file_reaches_the_terminal_without_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from gpukit.cli.main import main

    path = tmp_path / "model.safetensors"
    info = {"gpukit_version": "1\x1b]0;owned\x07", "metadata": {"note": "\x1b[2Jcleared"}}
    save_file(_linear().state_dict(), path, metadata={"gpukit": json.dumps(info)})
    assert main(["ckpt", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "?[2Jcleared" in out
