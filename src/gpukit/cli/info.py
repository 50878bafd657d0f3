"""``gpukit info``: everything torch and the driver know about this machine."""

from __future__ import annotations

import argparse
from typing import Any

from gpukit.cli._lock_folder import read_lock_folder
from gpukit.cli._output import console, human_bytes, na, print_json, say_if_fake


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit info``."""
    parser.add_argument("--json", action="store_true", help="print a JSON report for programs")


def collect() -> tuple[dict[str, Any], list[Any]]:
    """The whole report (torch's view of the devices beside the driver's) and memory reports."""
    from gpukit.errors import NoDriverError, NvmlError
    from gpukit.gpus.inventory import inventory
    from gpukit.sysinfo import system_info

    info = system_info()
    reports = _memory_reports(info)
    info["memory"] = [report.to_json() for report in reports]
    try:
        info["nvml"] = inventory().to_json()
    except (NoDriverError, NvmlError) as exc:
        info["nvml"] = {"available": False, "reason": str(exc)}
    info["lock_dir"] = read_lock_folder(with_claims=False).to_json()
    return info, reports


def _memory_reports(info: dict[str, Any]) -> list[Any]:
    from gpukit.memory.report import memory_report

    devices = ["cpu"] + [f"cuda:{d['index']}" for d in info["cuda"]["devices"]]
    return [memory_report(device, top=5) for device in devices]


def run(args: argparse.Namespace) -> int:
    """Print the report as tables, or as JSON with ``--json``."""
    say_if_fake("info")
    info, memory = collect()
    if args.json:
        print_json(info)
        return 0
    _render(info)
    for report in memory:
        console().print(f"\n{report}")
    return 0


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def _render(info: dict[str, Any]) -> None:
    out = console()
    cuda = info["cuda"]
    cudnn = info["cudnn"]
    env = info["environment"]
    cpu = info["cpu"]
    if cuda["available"]:
        headline = f"CUDA is available: {cuda['device_count']} device(s)."
    elif cuda["built_with"] is None:
        headline = "No GPU: this torch was built without CUDA, so everything runs on the CPU."
    else:
        headline = "No GPU: torch has CUDA support but sees no CUDA device (driver or devices)."
    out.print(headline)
    out.print()
    out.print(
        _kv_table(
            "torch",
            [
                ("python", info["python"]),
                ("torch", info["torch"]),
                ("built with CUDA", na(cuda["built_with"])),
                ("CUDA available", str(cuda["available"])),
                ("device count", str(cuda["device_count"])),
                ("current device", na(cuda["current_device"])),
                ("arch list", " ".join(cuda["arch_list"]) or "n/a"),
                ("MPS available", str(info["mps"]["available"])),
            ],
        )
    )
    out.print()
    out.print(
        _kv_table(
            "cuDNN",
            [
                ("available", str(cudnn["available"])),
                ("version", na(cudnn["version"])),
                ("benchmark", str(cudnn["benchmark"])),
                ("deterministic", str(cudnn["deterministic"])),
            ],
        )
    )
    out.print()
    out.print(
        _kv_table(
            "environment and CPU",
            [(name, na(value)) for name, value in env.items()]
            + [
                ("CPU", str(cpu["model"])),
                ("cores (usable)", f"{cpu['logical_cores']} ({na(cpu['usable_cores'])})"),
                ("torch threads", str(cpu["torch_threads"])),
            ],
        )
    )
    if cuda["devices"]:
        _render_devices(out, cuda["devices"])
    _render_nvml(out, info["nvml"])
    _render_lock_dir(out, info["lock_dir"])


def _render_lock_dir(out: Any, lock: dict[str, Any]) -> None:
    from rich.text import Text

    out.print()
    if lock["path"] is not None:
        out.print(Text(f"lock folder (claims of gpukit run): {lock['path']} ({lock['source']})"))
    if lock.get("warning"):
        out.print(Text(f"warning: {lock['warning']}", style="yellow"))
    if lock["error"]:
        out.print(Text(f"error: {lock['error']}", style="red"))


def _render_nvml(out: Any, nvml: dict[str, Any]) -> None:
    from gpukit.cli._gpu_table import build_table
    from gpukit.gpus.inventory import Inventory
    from gpukit.gpus.visible import visible_devices

    out.print()
    if nvml.get("available") is False:
        out.print(f"NVML (the driver's view): not available. {nvml['reason']}")
        return
    inv = Inventory.from_json(nvml)
    out.print(
        f"NVML (the driver's view, nvidia-smi's numbering): driver {na(inv.driver_version)}, "
        f"CUDA driver {na(inv.cuda_driver_version)}, {len(inv.gpus)} GPU(s)"
    )
    out.print(build_table(inv, visible_devices(inv)))


def _render_devices(out: Any, devices: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="CUDA devices (torch's numbering)", title_justify="left")
    for column in ("cuda", "name", "capability", "SMs", "free / total", "allocated", "reserved"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for dev in devices:
        table.add_row(
            f"cuda:{dev['index']}",
            dev["name"],
            dev["compute_capability"],
            str(dev["multiprocessors"]),
            f"{human_bytes(dev['free_memory'])} / {human_bytes(dev['total_memory'])}",
            human_bytes(dev["allocated"]),
            human_bytes(dev["reserved"]),
        )
    out.print()
    out.print(table)
