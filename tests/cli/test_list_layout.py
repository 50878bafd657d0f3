"""The GPU table's layout: who uses each GPU stays readable at 80 columns, headers match cells,
and many hosts print quickly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from gpukit.cli._gpu_table import build_hosts_table, build_table
from gpukit.gpus.hosts import HostReading
from gpukit.gpus.inventory import GPU, GpuProcess, Inventory
from gpukit.gpus.visible import resolve
from gpukit.holders import Holder
from gpukit.sizes import format_size


def _render(renderable: object, width: int) -> list[str]:
    out = Console(width=width, force_terminal=True, color_system=None, highlight=False)
    with out.capture() as captured:
        out.print(renderable)
    return captured.get().splitlines()


def _gpu(index: int, *, pci: str, user: str = "alice", command: str = "python train.py") -> GPU:
    return GPU(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA A100-SXM4-80GB",
        pci_bus_id=pci,
        memory_total=80 * 2**30,
        memory_used=71 * 2**30,
        utilization_gpu=98,
        temperature_c=67,
        power_draw_w=389.0,
        power_limit_w=400.0,
        processes=(GpuProcess(40211 + index, user, command, 71 * 2**30),),
    )


HOLDER = Holder("bob", 4242, "gpu1", "python sweep.py --lr 3e-4", 1.0)


@pytest.mark.parametrize("name", ["server-8xA100-shared", "server-2xH100-mig"])
def test_list_at_80_columns_shows_who_claimed_and_who_uses_each_gpu(
    machines_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from gpukit.gpus.inventory import inventory

    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machines_dir / f"{name}.json"))
    inv = inventory()
    users = {p.user for g in inv.gpus for p in g.processes} | {
        p.user for g in inv.gpus for m in g.mig_instances for p in m.processes
    }
    claims = {inv.gpus[0].uuid: HOLDER}
    lines = _render(build_table(inv, resolve(None, None, inv), claims=claims), 80)
    assert all(len(line) <= 80 for line in lines)
    assert "bob:4242 python" in lines[1]  # the holder, its pid and its command's start
    shown = "\n".join(lines)
    for user in users - {None}:
        assert f"{user}:" in shown
    # The command's start: the memory column, in format_size's units ("13 MiB/39.2 GiB"),
    # leaves the processes a few characters fewer than a column of bare GiB did.
    assert "pyth" in next(line for line in lines if "frank:" in line or "alice:" in line)


def test_list_on_a_wide_terminal_keeps_the_bar_power_and_process_memory() -> None:
    inv = Inventory(gpus=(_gpu(0, pci="0000:01:00.0"),))
    [header, row] = _render(build_table(inv, resolve(None, None, inv), claims={}), 200)
    assert "power" in header
    assert "█" in row
    assert "389/400 W" in row
    assert "alice:40211 python train.py (71 GiB)" in row


@pytest.mark.parametrize("width", [80, 200])
def test_the_memory_column_writes_sizes_as_every_other_gpukit_output_does(width: int) -> None:
    # An H100 "80GB" has 81559 MiB: 79.6 GiB, not 80; 300 MiB in use is not "0.3".
    busy = replace(_gpu(0, pci="0000:01:00.0"), memory_used=71 * 2**30)
    light = replace(
        _gpu(1, pci="0000:02:00.0"), memory_total=81559 * 2**20, memory_used=300 * 2**20
    )
    inv = Inventory(gpus=(busy, light))
    _, first, second = _render(build_table(inv, resolve(None, None, inv), claims={}), width)
    assert f"{format_size(71 * 2**30).split()[0]}/{format_size(80 * 2**30)}" in first
    assert "71/80 GiB" in first
    assert f"{format_size(300 * 2**20)}/{format_size(81559 * 2**20)}" in second
    assert "300 MiB/79.6 GiB" in second


def test_hosts_table_headers_match_cells_when_cuda_and_pci_orders_differ() -> None:
    # nvidia-smi's index 0 sits on the higher PCI bus: CUDA in PCI order would call it cuda:1.
    inv = Inventory(gpus=(_gpu(0, pci="0000:81:00.0"), _gpu(1, pci="0000:01:00.0")))
    reading = HostReading("gpu1", inv, claims={"GPU-1": HOLDER}, via="gpukit")
    header, *rows = _render(build_hosts_table([reading]), 200)
    assert "cuda:" not in "\n".join(rows)
    for row in rows:
        assert row.index("A100") == header.index("name")
        assert row.index("alice:") == header.index("user:pid")
    assert rows[1].index("bob (pid 4242") == header.index("claimed by")


def test_hosts_table_at_80_columns_shows_who_uses_each_gpu() -> None:
    inv = Inventory(gpus=(_gpu(0, pci="0000:01:00.0"),))
    reading = HostReading("gpu-node-17", inv, claims={"GPU-0": HOLDER}, via="gpukit")
    down = HostReading("gpu-node-18", error="unreachable: ssh: connect to host port 22: refused")
    header, row, _blank, error = _render(build_hosts_table([reading, down]), 80)
    assert all(len(line) <= 80 for line in (header, row, error))
    assert "bob:4242 py" in row  # who, and the start of what
    assert "alice:40211 p" in row
    assert down.error is not None
    assert error.endswith(f"  -  {down.error}")  # the reason, whole


def test_a_table_of_8000_remote_gpus_is_drawn_line_by_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings = [
        HostReading(
            f"host{h}",
            Inventory(gpus=tuple(_gpu(i, pci=f"0000:{255 - i:02x}:00.0") for i in range(64))),
            via="gpukit",
        )
        for h in range(125)
    ]
    # Drawn by rich's Table, whose layout is not linear in the rows, such a table took 14 to
    # 28 s; line by line it takes about 1 s. Its speed is the bench's business; here, that no
    # rich Table is built at all.
    import rich.table

    def _no_table(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hosts table was laid out by rich's Table")

    monkeypatch.setattr(rich.table.Table, "__init__", _no_table)
    lines = _render(build_hosts_table(readings), 160)
    assert sum("A100" in line for line in lines) == 8000
