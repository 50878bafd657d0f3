"""`gpukit list --hosts`: several machines in one table, over a fake ssh, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers.hosts import FakeHosts

if TYPE_CHECKING:
    from tests.helpers import CliRunner


@pytest.fixture
def hosts(tmp_path: Path) -> FakeHosts:
    return FakeHosts(tmp_path / "hosts")


def test_list_hosts_shows_one_table_grouped_by_host(run_cli: CliRunner, hosts: FakeHosts) -> None:
    hosts.gpukit("gpu1", "server-8xA100-shared")
    hosts.nvidia_smi("t4box")
    hosts.refusing("down")
    result = run_cli(
        "list", "--hosts", "gpu1,t4box,down", "--ssh-command", hosts.ssh, env={"COLUMNS": "200"}
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["host", "GPU", "name"]
    starts = [line.split()[0] for line in lines[1:] if line.strip() and not line[0].isspace()]
    assert starts == ["gpu1", "t4box", "down"]
    gpu1 = [line for line in lines if "A100-SXM4-80GB" in line]
    assert len(gpu1) == 8
    assert "alice:40211 python train.py" in gpu1[0]
    assert sum("Tesla T4" in line for line in lines) == 2
    [down] = [line for line in lines if line.startswith("down")]
    assert "unreachable: ssh: connect to host down port 22: Connection refused" in down
    assert "Traceback" not in result.stderr


def test_list_hosts_json_follows_the_hosts_schema(run_cli: CliRunner, hosts: FakeHosts) -> None:
    hosts.nvidia_smi("t4box")
    hosts.hanging("dead")
    result = run_cli(
        "list", "--hosts", "t4box,dead", "--timeout", "2", "--json", "--ssh-command", hosts.ssh
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gpukit.hosts/1"
    assert [h["host"] for h in doc["hosts"]] == ["t4box", "dead"]
    assert doc["hosts"][0]["via"] == "nvidia-smi"
    assert len(doc["hosts"][0]["inventory"]["gpus"]) == 2
    assert doc["hosts"][1]["error"] == "unreachable: no answer within 2 s"
    assert hosts.live_processes() == []


def test_list_hosts_reads_the_ssh_command_from_gpukit_ssh(
    run_cli: CliRunner, hosts: FakeHosts
) -> None:
    hosts.nvidia_smi("t4box")
    result = run_cli("list", "--hosts", "t4box", "--json", env={"GPUKIT_SSH": hosts.ssh})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["hosts"][0]["via"] == "nvidia-smi"


def test_list_hosts_exits_3_when_no_host_answers(run_cli: CliRunner, hosts: FakeHosts) -> None:
    hosts.refusing("a")
    result = run_cli("list", "--hosts", "a,b", "--ssh-command", hosts.ssh)
    assert result.returncode == 3
    assert "Connection refused" in result.stdout
    assert "Could not resolve hostname b" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hosts", "a,-oProxyCommand=x"], "'-oProxyCommand=x' is not a host name"),
        (["--hosts", "a", "--timeout", "0"], "'0' is not a number of seconds (above 0"),
        (["--hosts", "a", "--watch"], "--watch does not combine with --hosts"),
        (["--hosts", "a", "--ssh-command", "'unclosed"], "Cannot read the ssh command"),
        (["--timeout", "5"], "no --hosts was given"),
    ],
)
def test_list_hosts_refuses_bad_arguments_with_exit_2(
    run_cli: CliRunner, args: list[str], message: str
) -> None:
    result = run_cli("list", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_json_output_writes_non_finite_numbers_as_null(capsys: pytest.CaptureFixture[str]) -> None:
    from gpukit.cli._output import print_json

    print_json({"schema": "x/1", "power": float("nan"), "since": float("-inf")})
    assert json.loads(capsys.readouterr().out) == {"schema": "x/1", "power": None, "since": None}
