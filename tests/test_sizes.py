"""Sizes: one reader and one writer, in units that show them, and no silent bytes."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from gpukit.cli._output import human_bytes
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import GPU, Inventory
from gpukit.gpus.select import assess
from gpukit.sharing.pick import pick
from gpukit.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (20 * 2**10, "20 KiB"),
        (20 * 2**10 + 512, "20.5 KiB"),
        (3 * 2**29, "1.5 GiB"),
        (60 * 2**30, "60 GiB"),
        (int(41.46 * 2**30), "41.5 GiB"),
        (5 * 2**40, "5 TiB"),
    ],
)
def test_a_size_is_written_in_the_largest_unit_it_fills(size: int, shown: str) -> None:
    assert format_size(size) == shown
    assert human_bytes(size) == shown  # the tables write sizes the same way


def test_a_small_free_memory_is_explained_in_a_unit_that_shows_it() -> None:
    gpu = GPU(index=0, uuid="GPU-a", name="T4", memory_total=2**34, memory_free=512)
    [verdict] = assess(Inventory(gpus=(gpu,)), Criteria.make(min_free="20KiB"), {})
    assert verdict.explain() == "GPU 0: 512 B free < 20 KiB"
    assert Criteria.make(min_free="20KiB").describe() == "at least 20 KiB free"


def test_a_library_size_without_a_unit_is_bytes_and_warns_when_implausibly_small() -> None:
    gpu = GPU(index=0, uuid="GPU-a", name="T4", memory_total=2**34, memory_free=2**34)
    inv = Inventory(gpus=(gpu,))
    with pytest.warns(UserWarning, match="read as 20 B; write '20GiB' if you meant gibibytes"):
        assert [g.index for g in pick(1, min_free=20, inventory=inv, claims={})] == [0]
    assert parse_size(20) == 20  # bytes, as documented, warned or not


@pytest.mark.parametrize("size", ["20GiB", "20B", 2**30, 0, "0"])
def test_a_size_with_a_unit_or_a_plausible_number_of_bytes_does_not_warn(
    size: int | str,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_size(size)


# -- one grammar for every size argument: gk.pick, gk.save and `gpukit ckpt convert` --------------

_SAME_EVERYWHERE = [("2G", 2 * 2**30), ("1.5G", 3 * 2**29), (".5GB", 5 * 10**8), ("2GB", 2 * 10**9)]


def _convert_shard_limit(tmp_path: Path, text: str) -> int | None:
    from gpukit.cli.ckpt import _check_paths
    from gpukit.cli.main import build_parser

    (source := tmp_path / "in.pt").write_bytes(b"")
    argv = ["ckpt", "convert", str(source), str(tmp_path / "out"), "--max-shard-size", text]
    return _check_paths(build_parser("ckpt").parse_args(argv)).shard_limit


@pytest.mark.parametrize(("text", "size"), _SAME_EVERYWHERE)
def test_a_size_means_the_same_bytes_in_pick_save_and_ckpt_convert(
    text: str, size: int, tmp_path: Path
) -> None:
    from gpukit.checkpoint.api import check_save_target

    assert Criteria.make(min_free=text).min_free == size
    assert check_save_target(tmp_path / "weights", text).shard_limit == size
    assert _convert_shard_limit(tmp_path, text) == size


@pytest.mark.parametrize("text", ["1X", "0", "-1", "nan", "GB", "2 GiBs"])
def test_a_bad_max_shard_size_is_a_usage_error_before_anything_is_read(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpukit.cli.main import main

    missing = tmp_path / "missing.pt"  # never looked at: the option is refused first
    with pytest.raises(SystemExit) as exited:
        main(["ckpt", "convert", str(missing), str(tmp_path / "out"), "--max-shard-size", text])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --max-shard-size: " in err, err
    assert "Traceback" not in err


def test_a_max_shard_size_without_a_unit_is_bytes_in_the_library_and_the_cli(
    tmp_path: Path,
) -> None:
    from gpukit.checkpoint.api import check_save_target

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bytes, as Hugging Face reads them: no warning
        assert check_save_target(tmp_path / "weights", 64).shard_limit == 64
        assert _convert_shard_limit(tmp_path, "64") == 64


def test_ckpt_convert_help_names_the_shard_size_gk_save_uses_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpukit.checkpoint.api import check_save_target
    from gpukit.cli.main import main
    from gpukit.sizes import parse_shard_size

    with pytest.raises(SystemExit):
        main(["ckpt", "convert", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    said = re.search(r"default (\S+?)\)", helped)
    assert said is not None, helped
    default = check_save_target(tmp_path / "weights", None).shard_limit
    assert parse_shard_size(said.group(1)) == default == 5 * 10**9  # Hugging Face's "5GB"


def test_a_memory_report_writes_sizes_as_every_other_table_does() -> None:
    import gpukit as gk

    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(1024, 1024, bias=False)  # a 4 MiB weight
    text = str(gk.memory_report("cpu", module=module, top=1))
    # The tensor's own row; the process-wide figures above it vary with what else is alive.
    row = next(line for line in text.splitlines() if line.rstrip().endswith("weight"))
    assert row.split()[:3] == ["4", "MiB", "float32"]


def test_a_size_past_the_callers_bound_names_that_bound() -> None:
    from gpukit.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"past 1 GiB\)"):
        parse_size("2GiB", most=2**30)
    with pytest.raises(InvalidArgumentError, match=r"past 2\*\*100 bytes\)"):
        parse_size(2**101)
