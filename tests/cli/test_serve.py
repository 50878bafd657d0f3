"""`gpukit serve` as a user runs it: a subprocess that prints its URL and stops on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import subprocess_env

if TYPE_CHECKING:
    from tests.helpers import CliRunner


@pytest.fixture
def serving(machines_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = subprocess_env(
        GPUKIT_FAKE_NVML=str(machines_dir / "server-8xA100-shared.json"),
        GPUKIT_LOCK_DIR=str(tmp_path / "locks"),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "serve", "--port", "0", "--interval", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving http://127.0.0.1:" in line, line + proc.stderr.read()  # type: ignore[union-attr]
        url = line.split("serving ", 1)[1].split(" ", 1)[0]
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.slow
def test_serve_prints_its_url_serves_and_stops_cleanly_on_sigterm(
    serving: tuple[subprocess.Popen[str], str],
) -> None:
    proc, url = serving
    with urllib.request.urlopen(url + "api/inventory", timeout=10) as answer:
        assert len(json.load(answer)["gpus"]) == 8
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "fake machine" in proc.stderr.read()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "'70000' is not a whole number from 0 to 65,535"),
        (["--interval", "0"], "'0' is not a number of seconds (above 0"),
        (["--interval", "nan"], "'nan' is not a number of seconds"),
        (["--host", "no.such.host.invalid", "--port", "0"], "Cannot serve on no.such.host.invalid"),
    ],
)
def test_serve_refuses_bad_arguments_with_exit_2(
    run_cli: CliRunner, machines_dir: Path, args: list[str], message: str
) -> None:
    result = run_cli(
        "serve", *args, env={"GPUKIT_FAKE_NVML": str(machines_dir / "kaggle-2xT4-idle.json")}
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_without_a_driver_exits_3(run_cli: CliRunner, machines_dir: Path) -> None:
    result = run_cli(
        "serve", "--port", "0", env={"GPUKIT_FAKE_NVML": str(machines_dir / "no-driver.json")}
    )
    assert result.returncode == 3, result.stderr
    assert "No NVIDIA driver" in result.stderr
    assert "serving" not in result.stdout
