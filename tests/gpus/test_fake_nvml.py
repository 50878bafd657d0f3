"""Machine descriptions for GPUKIT_FAKE_NVML: checked whole, and shipped inside the package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpukit.errors import InvalidArgumentError
from gpukit.gpus.fake_nvml import bundled_machines, check_description, load_description
from tests.helpers import CliRunner, subprocess_env


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("description", "named"),
    [
        ({"gpus": [5]}, "gpus[0] is int 5, not an object"),
        ({"gpus": [{"memory_total": "lots"}]}, "gpus[0].memory_total is str 'lots'"),
        ({"gpus": "two"}, "gpus is str, not a list"),
        ({"gpus": [{"processes": [{"user": "bob"}]}]}, "gpus[0].processes[0] has no 'pid'"),
        ({"gpus": [{"mig_mode": "yes"}]}, "gpus[0].mig_mode is str 'yes', not true or false"),
        ({"gpus": [{"compute_capability": [8]}]}, "gpus[0].compute_capability is list [8]"),
        ({"gpus": [{"memory_totl": 5}]}, "gpus[0].memory_totl is not a field gpukit knows"),
        ({"gpus": [{"mig_devices": [{"processes": [{"pid": -1}]}]}]}, "mig_devices[0].processes"),
        ({"gpus": [], "cuda_driver_version": "12.4"}, "cuda_driver_version is str '12.4'"),
        ({"gpus": [{"temperature_c": True}]}, "gpus[0].temperature_c is bool True"),
        ({"gpus": [{"fan_speed": "fast"}]}, "gpus[0].fan_speed is str 'fast'"),
        ({"gpus": [{"utilization_decoder": -5}]}, "gpus[0].utilization_decoder is int -5"),
        ([], "the description is list [], not an object"),
        ({}, "the description has no 'gpus'"),
    ],
)
def test_a_wrong_field_is_a_usage_error_that_names_it(
    tmp_path: Path, description: Any, named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a valid machine description") as caught:
        load_description(_write(tmp_path, description))
    assert named in caught.value.message


def test_every_wrong_field_is_named_at_once() -> None:
    problems = check_description(
        {"gpus": [{"memory_total": "lots", "memory_used": -1}, {"uuid": 7}]}
    )
    assert [p.split(" is ")[0] for p in problems] == [
        "gpus[0].memory_total",
        "gpus[0].memory_used",
        "gpus[1].uuid",
    ]


@pytest.mark.parametrize("name", bundled_machines())
def test_every_bundled_machine_is_valid_and_matches_the_test_fixture(
    name: str, machines_dir: Path
) -> None:
    assert check_description(load_description(name)) == []
    assert load_description(name) == json.loads((machines_dir / f"{name}.json").read_text())


def test_the_bundled_machines_include_the_ones_the_readme_shows() -> None:
    assert {"server-8xA100-shared", "kaggle-2xT4-idle", "no-driver"} <= set(bundled_machines())


def test_an_unknown_machine_name_lists_the_bundled_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="server-8xA100-shared") as caught:
        load_description("server-8xA100")
    assert "neither a machine gpukit ships nor a path" in caught.value.message


def test_a_bundled_name_works_from_any_folder_and_a_path_still_works(
    run_cli: CliRunner, tmp_path: Path, machines_dir: Path
) -> None:
    # A file of that name in the current folder must not stand in for the bundled machine.
    (tmp_path / "server-8xA100-shared").write_text('{"gpus": []}')
    env = {"GPUKIT_FAKE_NVML": "server-8xA100-shared", "GPUKIT_LOCK_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "pick", "-n", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=subprocess_env(**env),
        check=False,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "2,4\n"), done.stderr
    by_path = run_cli(
        "pick",
        "-n",
        "2",
        env={"GPUKIT_FAKE_NVML": str(machines_dir / "server-8xA100-shared.json"), **env},
    )
    assert (by_path.returncode, by_path.stdout) == (0, "2,4\n")


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["gpus", "processes", "memory_total", "pid", "mig_devices", "x"]),
                inner,
                max_size=3,
            )
        ),
        max_leaves=10,
    )
)
def test_checking_any_json_never_fails_with_anything_but_a_list_of_problems(data: Any) -> None:
    problems = check_description(data)
    assert isinstance(problems, list)
    assert all(isinstance(p, str) for p in problems)


def test_a_fifo_as_the_description_is_refused_instead_of_hanging(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "machine.json"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        load_description(fifo)


def test_a_description_nested_without_end_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    path.write_text('{"gpus": ' + "[" * 100_000)
    with pytest.raises(InvalidArgumentError, match="nested more than"):
        load_description(path)


def test_a_sparse_file_of_a_terabyte_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    with path.open("wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(InvalidArgumentError, match="larger than"):
        load_description(path)


def test_a_description_that_is_not_utf8_json_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(InvalidArgumentError, match="does not name a readable machine"):
        load_description(path)
