"""What a load did: the LoadReport, and the error that explains a checkpoint that does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpukit.checkpoint.keys import nearest
from gpukit.errors import CheckpointError

__all__ = ["LoadReport", "mismatch_error"]

_SHOWN = 8


@dataclass(frozen=True)
class LoadReport:
    """The outcome of :func:`gpukit.load`.

    ``loaded`` holds the model's names that received a tensor; ``missing`` the model's names the
    file lacks; ``unexpected`` the file's names (after cleaning) the model lacks; ``mismatched``
    maps a name to ``(shape in file, shape in model)``. ``prefixes_removed`` lists what was
    stripped from the file's keys (``"module."``, ``"_orig_mod."``, ``"_fsdp_wrapped_module."``,
    ``"_checkpoint_wrapped_module."``, ``"_forward_module."``, ``"model."``; ``".module."`` for
    wrapped submodules). ``source_devices`` are the devices the tensors were saved from;
    ``device`` is where they were loaded. ``extras`` holds the other entries of a container
    checkpoint (optimizer state, epoch, ...), on ``device`` as well (from a DCP folder too; a
    sharded folder holds only weights). ``tied`` maps a model key that was filled
    from another (tied weights, stored once) to that key. ``weights_at_top_level`` says the
    weights were the checkpoint's top-level tensors, found beside its other entries
    (torchtitan's layout) rather than under ``container_key``. ``unread`` names the entries
    left out of ``extras`` unread, each with the reason (an ``Accelerator.save_state`` pickle
    that only ``trust=True`` reads).

    Args:
        path: the checkpoint loaded, as named (a file or a folder).
        format: what its bytes are (``"safetensors"``, ``"torch"``, ``"dcp"``...).
        loaded: the model's keys that received a tensor.
        missing: the model's keys the checkpoint lacks.
        unexpected: the checkpoint's keys (after cleaning) the model lacks.
        mismatched: key -> ``(shape in file, shape in model)``.
        prefixes_removed: the prefixes stripped from the checkpoint's keys.
        source_devices: the devices the tensors were saved from, where known.
        device: where the tensors were loaded (``"cuda:0"``).
        container_key: the entry the weights were under (``"model"``); None: none.
        metadata: what gk.save recorded (empty when something else wrote it).
        extras: the other entries of a container checkpoint, read onto ``device``.
        tied: model key -> the key it was filled from (tied weights, stored once).
        weights_at_top_level: whether the weights were top-level tensors beside other entries.
        unread: the entries left out of ``extras`` unread -> the reason.
    """

    path: Path
    format: str
    loaded: list[str]
    missing: list[str]
    unexpected: list[str]
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    prefixes_removed: list[str]
    source_devices: list[str]
    device: str
    container_key: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    weights_at_top_level: bool = False
    unread: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every key of the model was loaded and the file had nothing else."""
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        parts = [f"loaded {len(self.loaded)} tensors from {self.path.name} onto {self.device}"]
        if self.prefixes_removed:
            parts.append("removed prefixes " + ", ".join(self.prefixes_removed))
        if self.source_devices:
            parts.append("saved on " + ", ".join(self.source_devices))
        if self.weights_at_top_level:
            parts.append("weights taken from the top-level tensors (no nested state dict)")
            if self.extras:
                parts.append(f"{_listed(list(self.extras))} in extras")
        if self.unread:
            parts.append(
                f"left unread: {_listed(list(self.unread))} (pickles; trust=True reads them)"
            )
        for label, items in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("mis-shaped", list(self.mismatched)),
        ):
            if items:
                parts.append(f"{len(items)} {label}: {_listed(items)}")
        return "; ".join(parts)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _with_nearest(names: list[str], others: list[str], other_side: str) -> str:
    described = []
    for name in names[:_SHOWN]:
        close = nearest(name, others)
        described.append(f"{name} (nearest {other_side}: {close})" if close else name)
    more = len(names) - _SHOWN
    return ", ".join(described) + (f" and {more} more" if more > 0 else "")


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith(("s", "sh", "ch")) else f"{n} {word}s"


def mismatch_error(report: LoadReport, model_name: str) -> CheckpointError:
    """A CheckpointError listing what does not fit, with the nearest names on the other side."""
    problems = []
    if report.missing:
        problems.append(
            f"{_plural(len(report.missing), 'missing key')}: "
            + _with_nearest(report.missing, report.unexpected, "in the file")
        )
    if report.unexpected:
        problems.append(
            f"{_plural(len(report.unexpected), 'unexpected key')}: "
            + _with_nearest(report.unexpected, report.missing, "in the model")
        )
    if report.mismatched:
        shapes = [
            f"{name} (file {list(saved)}, model {list(wanted)})"
            for name, (saved, wanted) in list(report.mismatched.items())[:_SHOWN]
        ]
        problems.append(
            f"{_plural(len(report.mismatched), 'shape mismatch')}: " + ", ".join(shapes)
        )
    removed = (
        f" (after removing {', '.join(report.prefixes_removed)})" if report.prefixes_removed else ""
    )
    return CheckpointError(
        f"{report.path} does not fit {model_name}{removed}: " + "; ".join(problems) + ".",
        hint=f"Fix the layer names or sizes, or pass strict=False to load the "
        f"{len(report.loaded)} tensors that fit and get a LoadReport listing the rest.",
    )
