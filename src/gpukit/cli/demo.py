"""``gpukit demo``: the main job, rendered: plan, replica shares, progress, accuracy, reload."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpukit.cli._args import Number, OutputFile
from gpukit.cli._output import console, print_json
from gpukit.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gpukit.demo import DemoEvent


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit demo``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--devices",
        metavar="LIST",
        help="comma-separated devices to replicate over, e.g. cpu,cpu,cpu,cpu or cuda:0,cuda:1 "
        "(default: every GPU, else 4 CPU replicas)",
    )
    where.add_argument(
        "--replicas", type=Number(1, 1024), metavar="N", help="N replicas on the CPU"
    )
    parser.add_argument(
        "--epochs", type=Number(1, 100_000), default=8, help="passes over the data (default 8)"
    )
    parser.add_argument(
        "--batch-size", type=Number(1, 10**7), default=64, help="samples a step (default 64)"
    )
    parser.add_argument(
        "--seed", type=Number(0, 2**32 - 1), default=0, help="the same seed gives the same result"
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        metavar="P",
        help="auto, bf16-mixed, fp16-mixed or fp32 (default fp32); auto picks bf16 only where "
        "the device runs it natively",
    )
    parser.add_argument(
        "--accumulate",
        type=Number(1, 10**7),
        default=1,
        metavar="K",
        help="cut each batch into K micro-batches, one optimizer step per batch (default 1)",
    )
    parser.add_argument(
        "--save",
        type=OutputFile(),
        metavar="FILE",
        help="keep the checkpoint here (.safetensors/.pt)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary for programs")


def _devices(args: argparse.Namespace) -> tuple[str, ...] | None:
    if args.replicas is not None:
        if args.replicas < 1:
            raise InvalidArgumentError(
                f"--replicas {args.replicas} must be at least 1.", hint="Try --replicas 4."
            )
        replicas: int = args.replicas
        return ("cpu",) * replicas
    if args.devices is not None:
        listed: str = args.devices
        devices = tuple(d.strip() for d in listed.split(",") if d.strip())
        if not devices:  # "" or ",": not a request for the default devices
            raise InvalidArgumentError(
                f"--devices {listed!r} names no device.",
                hint="List devices with commas, e.g. --devices cpu,cpu, or leave it out.",
            )
        return devices
    return None


class _Renderer:
    """Turns the demo's events into lines and a progress bar on stderr-free stdout."""

    def __init__(self, total_steps_hint: int = 0) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.out = console()
        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TextColumn("{task.fields[rate]:.0f} samples/s"),
            TimeElapsedColumn(),
            console=self.out,
            transient=True,
        )
        self.task: Any = None

    def __call__(self, event: DemoEvent) -> None:
        data = event.data
        out = self.out
        if event.kind == "plan":
            n = len(data["devices"])
            kinds = sorted(set(data["devices"]))
            out.print(
                f"Devices: {n} replica(s) on {', '.join(kinds)}. Data: scikit-learn digits, "
                f"{data['train_samples']} train / {data['test_samples']} test images (8x8)."
            )
            out.print(
                f"Plan: DigitsNet ({data['parameters']:,} parameters), gk.DataParallel over "
                f"{n} replica(s), {data['epochs']} epochs at batch {data['batch_size']}"
                + (
                    f" ({data['accumulate']} micro-batches a step)"
                    if data["accumulate"] > 1
                    else ""
                )
                + f", {data['precision']}."
            )
            self.task = self.progress.add_task("train", total=data["steps"], loss=0.0, rate=0.0)
        elif event.kind == "first_step":
            for size in data["replica_batch_sizes"]:
                out.print(f"  batch size in forward: {size}")
            total = sum(data["replica_batch_sizes"])
            out.print(f"  gathered output for a batch of {total}: {data['output_shape']}")
            self.progress.start()
        elif event.kind == "step":
            self.progress.update(
                self.task, advance=1, loss=data["loss"], rate=data["samples_per_second"]
            )
        elif event.kind == "epoch":
            self.progress.console.print(
                f"epoch {data['epoch']}: loss {data['loss']:.4f}, "
                f"held-out accuracy {data['acc']:.2%}"
            )
        elif event.kind == "saved":
            self.progress.stop()
            if data.get("temporary"):
                out.print(
                    f"Saved with gk.save to a temporary file: {data['path']} "
                    f"({data['bytes']:,} bytes), removed when the demo ends; --save FILE keeps it."
                )
            else:
                out.print(f"Saved with gk.save: {data['path']} ({data['bytes']:,} bytes)")
        elif event.kind == "reloaded":
            verdict = "matches" if data["matches"] else "DOES NOT MATCH"
            out.print(
                f"Reloaded into a fresh plain model with gk.load: accuracy {data['acc']:.2%} "
                f"({verdict} the trained model)"
            )


def run(args: argparse.Namespace) -> int:
    """Run the demo; print its story, or a JSON summary with ``--json``."""
    started = time.perf_counter()
    devices = _devices(args)
    if not args.json:
        # Importing torch and scikit-learn takes seconds (15 and more on a busy machine).
        console().print("Loading torch and the digits data...")
    from gpukit.checkpoint.single_file import suffix_format
    from gpukit.demo import DemoConfig, run_demo

    if args.save:  # before training, not after it
        suffix_format(Path(args.save))
    config = DemoConfig(
        devices=devices,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        checkpoint=args.save,
        precision=args.precision,
        accumulate=args.accumulate,
    )
    renderer = None if args.json else _Renderer()
    try:
        result = run_demo(config, renderer)
    finally:
        if renderer is not None:
            renderer.progress.stop()
    if args.json:
        print_json(result.to_json())
    else:
        total = time.perf_counter() - started  # loading, training, saving and reloading
        console().print(
            f"Done in {total:.1f} s (training {result.seconds:.1f} s, "
            f"{result.samples_per_second:.0f} samples/s): test accuracy {result.test_accuracy:.2%}."
        )
    return 0 if result.reloaded_accuracy == result.test_accuracy else 1
