"""The main job: train a small convolutional network on handwritten digits over every device.

It walks through what gpukit is for, end to end, with the public API only: find the devices
(``gk.system_info``, ``gk.try_all_gpus``), split each batch over replicas (``gk.DataParallel``,
over every GPU or over several CPU replicas), move batches (``gk.to_device``), seed everything
(``gk.seed_everything``), then save the wrapped model (``gk.save``) and load it into a fresh,
plain model (``gk.load``), whose accuracy must match.

The data are the 1,797 8x8 digit images that scikit-learn ships (the ``demo`` extra), so nothing
is downloaded. The library reports progress through a callback and never prints; the
``gpukit demo`` command renders it.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit.checkpoint.api import load, save
from gpukit.devices import device as parse_device
from gpukit.devices import try_all_gpus
from gpukit.errors import DeviceError, InvalidArgumentError
from gpukit.parallel.data_parallel import DataParallel
from gpukit.repro import seed_everything
from gpukit.train.precision import autocast_forward, resolve_precision
from gpukit.train.step import TrainStep
from gpukit.transfer import to_device

__all__ = ["DemoConfig", "DemoEvent", "DemoResult", "DigitsNet", "default_devices", "run_demo"]

DEFAULT_CPU_REPLICAS = 4
SHOWCASE_BATCH = 16  # the classic tutorial's batch: 4 per replica on 4 devices
_TRAINS_ON = ("cpu", "cuda", "mps")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains on and how, checked when made.

    Args:
        devices: the replicas' device specs (``"cuda:0"``, ``"cpu"``...); None or empty: every
            GPU, else four CPU replicas.
        epochs: passes over the training images, 1 or more (8).
        batch_size: samples per optimizer step, over all replicas, 1 or more (64).
        lr: Adam's learning rate, above 0 (``3e-3``).
        seed: the seed set for the run and the data split (0).
        checkpoint: where the trained model is saved and kept; None: a temporary file, removed.
        precision: ``"fp32"`` (the default), ``"auto"``, ``"bf16-mixed"`` or ``"fp16-mixed"``;
            checked when the demo runs (:func:`gpukit.train.resolve_precision`).
        accumulate: micro-batches per optimizer step, 1 to ``batch_size`` (1).

    Raises:
        InvalidArgumentError: a count below 1, a learning rate that is not positive, or more
            micro-batches than a batch has samples.
        DeviceError: a device gk.device refuses, or one the demo cannot train on ("meta",
            "xpu"...: it trains on cpu, cuda and mps devices).
    """

    devices: tuple[str, ...] | None = None  # None: every GPU, else DEFAULT_CPU_REPLICAS CPUs
    epochs: int = 8
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    checkpoint: str | None = None  # None: a temporary file, removed afterwards
    precision: str = "fp32"  # or "auto", "bf16-mixed", "fp16-mixed" (gk.train.resolve_precision)
    accumulate: int = 1  # micro-batches per optimizer step, each batch cut into this many

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "accumulate"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(
                    f"{name}={getattr(self, name)} must be at least 1.",
                    hint=f"Pass --{name.replace('_', '-')} 1 or more.",
                )
        if not self.lr > 0:
            raise InvalidArgumentError(f"lr={self.lr} must be positive.", hint="Try 3e-3.")
        if self.accumulate > self.batch_size:
            raise InvalidArgumentError(
                f"accumulate={self.accumulate} cuts a batch of {self.batch_size} into more "
                "micro-batches than it has samples.",
                hint=f"Pass --accumulate {self.batch_size} or less, or a larger --batch-size.",
            )
        if self.devices:
            for spec in self.devices:  # refused here, before the data is loaded
                _check_trainable(spec, parse_device(spec))


def _check_trainable(spec: str, dev: torch.device) -> None:
    """Refuse a device gk.device passes through unchecked ("meta", "xpu"...): the demo trains
    only where gpukit checks the device (cpu, cuda, mps), and fails midway anywhere else."""
    if dev.type in _TRAINS_ON:
        return
    if dev.type == "meta":
        why = "a meta device holds shapes but no data, so nothing can be trained or measured on it."
    else:
        why = f"it trains on {', '.join(_TRAINS_ON[:-1])} and {_TRAINS_ON[-1]} devices only."
    raise DeviceError(
        f"the demo cannot train on {spec!r}: {why}",
        hint="List cpu, cuda:N or mps devices, e.g. --devices cpu,cpu, or leave --devices out "
        f"for every GPU (else {DEFAULT_CPU_REPLICAS} CPU replicas).",
    )


@dataclass(frozen=True)
class DemoEvent:
    """One thing that happened, for the renderer: ``kind`` plus its figures.

    Args:
        kind: ``"plan"``, ``"first_step"``, ``"step"``, ``"epoch"``, ``"saved"`` or
            ``"reloaded"``.
        data: the event's figures by name (``"loss"``, ``"acc"``, ``"samples_per_second"``...).
    """

    kind: str  # plan | first_step | step | epoch | saved | reloaded
    data: dict[str, Any]


@dataclass
class DemoResult:
    """The demo's outcome, as ``gpukit demo --json`` prints it.

    Args:
        devices: the replicas' devices, as strings.
        epochs: passes over the training images.
        batch_size: samples per optimizer step.
        seed: the seed the run set.
        train_samples: how many images it trained on.
        test_samples: how many images it was tested on.
        replica_batch_sizes: each replica's share of a batch of 16, largest first.
        gathered_output_shape: the shape of that batch's gathered output.
        epoch_losses: the mean training loss of each epoch.
        epoch_accuracies: the test accuracy after each epoch, from 0 to 1.
        test_accuracy: the test accuracy after the last epoch, from 0 to 1.
        reloaded_accuracy: the test accuracy of the saved model loaded into a fresh one.
        checkpoint: where the model was saved and kept; None: a temporary file, removed.
        prefixes_removed: the key prefixes loading stripped (``"module."``).
        seconds: the training's wall time, in seconds (saving and reloading left out).
        samples_per_second: training samples per second over all epochs.
        extra: further figures: ``"precision"``, ``"accumulate"``, ``"skipped_steps"``.
    """

    devices: list[str]
    epochs: int
    batch_size: int
    seed: int
    train_samples: int
    test_samples: int
    replica_batch_sizes: list[int]
    gathered_output_shape: list[int]
    epoch_losses: list[float]
    epoch_accuracies: list[float]
    test_accuracy: float
    reloaded_accuracy: float
    checkpoint: str | None
    prefixes_removed: list[str]
    seconds: float
    samples_per_second: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with a schema field."""
        return {"schema": "gpukit.demo/1", **asdict(self)}


# Replicas are copies of the network that run in threads; a module-level recorder is the one
# thing they all share, so each can report the size of the chunk it received.
_record_lock = threading.Lock()
_recorded: list[int] | None = None


def _record_batch(size: int) -> None:
    with _record_lock:
        if _recorded is not None:
            _recorded.append(size)


class DigitsNet(nn.Module):
    """A small convolutional network for 8x8 digit images (about 40k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The 10 digits' logits, shape ``(N, 10)``.

        Args:
            x: a batch of images, shape ``(N, 1, 8, 8)``, values from 0 to 1.
        """
        _record_batch(x.shape[0])
        out: torch.Tensor = self.head(self.features(x))
        return out


def default_devices() -> list[torch.device]:
    """Every CUDA device, or four CPU replicas on a machine without one."""
    gpus = try_all_gpus()
    if gpus[0].type == "cuda":
        return gpus
    return [torch.device("cpu")] * DEFAULT_CPU_REPLICAS


def _load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise InvalidArgumentError(
            "the demo trains on scikit-learn's bundled digits, and scikit-learn is missing.",
            hint="pip install 'gpukit[demo]'.",
        ) from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=generator)
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


@torch.no_grad()
def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    device = next(model.parameters()).device
    predictions = model(to_device(images, device)).argmax(dim=1).cpu()
    model.train()
    return float((predictions == labels).float().mean())


def _showcase_step(model: DataParallel, images: torch.Tensor) -> tuple[list[int], list[int]]:
    """One forward on a batch of 16, recording the share each replica received."""
    global _recorded
    with _record_lock:
        _recorded = []
    try:
        with torch.no_grad():
            output = model(images[:SHOWCASE_BATCH])
    finally:
        with _record_lock:
            sizes, _recorded = sorted(_recorded or [], reverse=True), None
    return sizes, list(output.shape)


def run_demo(
    config: DemoConfig | None = None,
    on_event: Callable[[DemoEvent], None] | None = None,
) -> DemoResult:
    """Train, evaluate, save, reload and re-evaluate; report progress through ``on_event``.

    The random states are seeded with ``config.seed`` and restored when the demo ends.

    Args:
        config: what to train on and how; None: :class:`DemoConfig`'s defaults.
        on_event: called with each :class:`DemoEvent` as it happens; None: no reports.
    """
    config = config or DemoConfig()
    emit = on_event or (lambda event: None)
    devices: Sequence[torch.device] = (
        [parse_device(d) for d in config.devices] if config.devices else default_devices()
    )
    previous = seed_everything(config.seed)
    try:
        return _train(config, list(devices), emit)
    finally:
        previous.restore()


def _train(
    config: DemoConfig, devices: list[torch.device], emit: Callable[[DemoEvent], None]
) -> DemoResult:
    precision = resolve_precision(config.precision, devices[0])  # refused before any work
    x_train, y_train, x_test, y_test = _load_digits(config.seed)
    net = DigitsNet().to(devices[0])
    model = DataParallel(net, device_ids=[str(d) for d in devices])
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    loss_fn = nn.CrossEntropyLoss()
    autocast_forward(model, precision)
    train_step = TrainStep(model, optimizer, precision=precision, accumulate=config.accumulate)
    steps_per_epoch = -(-len(y_train) // config.batch_size)
    emit(
        DemoEvent(
            "plan",
            {
                "devices": [str(d) for d in devices],
                "train_samples": len(y_train),
                "test_samples": len(y_test),
                "epochs": config.epochs,
                "batch_size": config.batch_size,
                "precision": precision.name,
                "accumulate": config.accumulate,
                "steps": steps_per_epoch * config.epochs,
                "parameters": sum(p.numel() for p in net.parameters()),
            },
        )
    )
    sizes, shape = _showcase_step(model, x_train)
    emit(DemoEvent("first_step", {"replica_batch_sizes": sizes, "output_shape": shape}))

    generator = torch.Generator().manual_seed(config.seed)
    start = time.perf_counter()
    losses: list[float] = []
    accuracies: list[float] = []
    for epoch in range(config.epochs):
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for step in range(steps_per_epoch):
            idx = order[step * config.batch_size : (step + 1) * config.batch_size]
            inputs, targets = to_device((x_train[idx], y_train[idx]), devices[0])
            value = _train_step(model, loss_fn, train_step, inputs, targets, config.accumulate)
            total += value * len(idx)
            elapsed = time.perf_counter() - start
            done = epoch * len(y_train) + min((step + 1) * config.batch_size, len(y_train))
            emit(DemoEvent("step", {"loss": value, "samples_per_second": done / elapsed}))
        losses.append(total / len(y_train))
        accuracies.append(_accuracy(model.module, x_test, y_test))
        emit(DemoEvent("epoch", {"epoch": epoch + 1, "loss": losses[-1], "acc": accuracies[-1]}))
    seconds = time.perf_counter() - start
    accuracy = accuracies[-1]
    reloaded, prefixes, path = _save_and_reload(model, config, emit)
    reloaded_accuracy = _accuracy(reloaded, x_test, y_test)
    emit(
        DemoEvent("reloaded", {"acc": reloaded_accuracy, "matches": reloaded_accuracy == accuracy})
    )
    return DemoResult(
        devices=[str(d) for d in devices],
        epochs=config.epochs,
        batch_size=config.batch_size,
        seed=config.seed,
        train_samples=len(y_train),
        test_samples=len(y_test),
        replica_batch_sizes=sizes,
        gathered_output_shape=shape,
        epoch_losses=losses,
        epoch_accuracies=accuracies,
        test_accuracy=accuracy,
        reloaded_accuracy=reloaded_accuracy,
        checkpoint=path,
        prefixes_removed=prefixes,
        seconds=seconds,
        samples_per_second=config.epochs * len(y_train) / seconds,
        extra={
            "precision": precision.name,
            "accumulate": config.accumulate,
            "skipped_steps": train_step.skipped_steps,
        },
    )


def _train_step(
    model: nn.Module,
    loss_fn: nn.Module,
    train_step: TrainStep,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    accumulate: int,
) -> float:
    """One optimizer step on a batch cut into micro-batches, each weighed by its samples."""
    parts = [
        p
        for p in zip(inputs.tensor_split(accumulate), targets.tensor_split(accumulate), strict=True)
        if len(p[1])
    ]
    value = 0.0
    for k, (x, y) in enumerate(parts):
        # What a prepared loader does: place the micro-batch in its step, with its samples.
        train_step.begin(k, len(parts), len(y), len(targets))
        loss = loss_fn(model(x), y)
        train_step(loss)
        value += loss.item() * len(y)
    return value / len(targets)


def _save_and_reload(
    model: DataParallel, config: DemoConfig, emit: Callable[[DemoEvent], None]
) -> tuple[nn.Module, list[str], str | None]:
    with tempfile.TemporaryDirectory(prefix="gpukit-demo-") as tmp:
        path = Path(config.checkpoint) if config.checkpoint else Path(tmp) / "digits.safetensors"
        save(model, path)  # the wrapper is unwrapped: keys come out clean
        saved = {"path": str(path), "bytes": path.stat().st_size}
        emit(DemoEvent("saved", {**saved, "temporary": not config.checkpoint}))
        fresh = DigitsNet()  # a plain model on the CPU, as on a machine without GPUs
        report = load(fresh, path)
    kept = str(path) if config.checkpoint else None
    return fresh, list(report.prefixes_removed), kept
