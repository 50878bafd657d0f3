"""gpustat's document from an inventory: what others chose comes out safe, and processes are read
as gpustat reads them. The field-for-field comparison with real gpustat is in
tests/cli/test_list_gpustat.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from gpukit.gpus.fake_nvml import load_description
from gpukit.gpus.gpustat_format import gpustat_json
from gpukit.gpus.inventory import inventory
from gpukit.output import dumps
from tests.helpers.gpustat_driver import described_here, gpustat_text, sleepers

HOSTILE_ARGS: list[str | bytes] = [
    b"line one\nline two",
    b"\x1b]0;owned\x07\x1b[2J",
    b"caf\xc3\xa9 \xff\xfe not utf-8",
    b"",
    "--flag=ok",
]


def _machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, description: dict[str, Any]) -> None:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(description))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))


def _one_process(pid_entry: dict[str, Any]) -> dict[str, Any]:
    """The idle T4 pair with one process on GPU 0."""
    description = load_description("kaggle-2xT4-idle")
    description["gpus"][0]["processes"] = [{**pid_entry, "used_memory": 3 << 30}]
    return description


def _made_safe(text: str) -> str:
    """gpustat's string as gpukit writes it: undecodable bytes (psutil's lone surrogates) as
    U+FFFD, then each control character as ``?``."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _no_control_characters(document: dict[str, Any]) -> bool:
    return not any(unicodedata.category(c) in ("Cc", "Cs") for s in _strings(document) for c in s)


def test_a_hostile_command_line_is_gpustats_with_control_characters_as_question_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with sleepers([HOSTILE_ARGS]) as (pid,):
        description = _one_process(described_here(pid))
        _machine(tmp_path, monkeypatch, description)
        ours = json.loads(dumps(gpustat_json(inventory())))
        theirs = json.loads(gpustat_text(description, monkeypatch))
    (mine,) = ours["gpus"][0]["processes"]
    (gpustats,) = theirs["gpus"][0]["processes"]
    assert "line one\nline two" in gpustats["full_command"]  # gpustat passes them on as they are
    assert mine["full_command"] == [_made_safe(arg) for arg in gpustats["full_command"]]
    assert mine["full_command"][-5:] == [
        "line one?line two",
        "?]0;owned??[2J",
        "café \ufffd\ufffd not utf-8",
        "",
        "--flag=ok",
    ]
    assert {k: v for k, v in mine.items() if k != "full_command"} == {
        k: v for k, v in gpustats.items() if k != "full_command"
    }
    assert _no_control_characters(ours)


def test_a_command_line_past_64_kib_is_cut_there_and_still_valid_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with sleepers([["--config=" + "x" * 100_000, "--after"]]) as (pid,):
        _machine(tmp_path, monkeypatch, _one_process(described_here(pid)))
        text = dumps(gpustat_json(inventory()))
    (process,) = json.loads(text)["gpus"][0]["processes"]
    kept = process["full_command"]
    assert kept[-1].startswith("--config=xxxx")
    assert "--after" not in kept
    assert len("\0".join(kept).encode()) <= 64 << 10  # as read: NUL between arguments


def test_hostile_names_from_a_description_come_out_printable_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    description = _one_process(
        {"pid": 4_000_000, "user": "eve\x1b[31m", "name": "python\nrm -rf ~ \x1b]8;;x\x07"}
    )
    gpu = description["gpus"][0]
    gpu["name"] = "Tesla\x1b[2J T4" + "A" * 100_000
    gpu["uuid"] = "GPU-\r\n-1"
    _machine(tmp_path, monkeypatch, description)
    ours = json.loads(dumps(gpustat_json(inventory())))
    theirs = json.loads(gpustat_text(copy.deepcopy(description), monkeypatch))
    mine = ours["gpus"][0]
    assert mine["name"] == _made_safe(theirs["gpus"][0]["name"])[:500]
    assert mine["uuid"] == "GPU-??-1"
    (process,) = mine["processes"]
    assert (process["username"], process["command"]) == ("eve?[31m", "python?rm")
    assert process["full_command"] == ["python?rm", "-rf", "~", "?]8;;x?"]
    assert _no_control_characters(ours)


def test_a_busy_process_reads_as_cpu_percent_of_one_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spin = (
        "import time\nprint(flush=True)\n"
        "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    )
    with subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE) as busy:
        try:
            assert busy.stdout is not None
            busy.stdout.readline()  # started: its command line is the spinner's
            _machine(tmp_path, monkeypatch, _one_process(described_here(busy.pid)))
            (process,) = gpustat_json(inventory())["gpus"][0]["processes"]
        finally:
            busy.kill()
    # A core spinning for the whole interval is 100 %; a loaded machine gives it less.
    assert 10 <= process["cpu_percent"] <= 105
    assert process["cpu_memory_usage"] > 1 << 20  # bytes: an interpreter holds megabytes


def test_a_described_pid_that_runs_another_process_here_keeps_the_description(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with sleepers([["serve.py"]]) as (pid,):
        _machine(
            tmp_path,
            monkeypatch,
            _one_process({"pid": pid, "user": "alice", "name": "python train.py --lr 3e-4"}),
        )
        (process,) = gpustat_json(inventory())["gpus"][0]["processes"]
    assert process == {
        "username": "alice",
        "command": "python",
        "full_command": ["python", "train.py", "--lr", "3e-4"],
        "gpu_memory_usage": 3072,
        "cpu_percent": 0,
        "cpu_memory_usage": 0.0,
        "pid": pid,
    }


def test_an_unknown_user_and_command_read_as_gpustats_question_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _machine(tmp_path, monkeypatch, _one_process({"pid": 4_000_001, "user": None, "name": ""}))
    (process,) = gpustat_json(inventory())["gpus"][0]["processes"]
    assert (process["username"], process["command"], process["full_command"]) == ("?", "?", ["?"])
