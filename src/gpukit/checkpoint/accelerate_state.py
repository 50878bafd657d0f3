"""Accelerate's ``save_state`` folders: the model's file beside the rest of a training state.

``Accelerator.save_state(folder)`` writes each prepared model as ``model.safetensors`` (then
``model_1.safetensors``...; ``pytorch_model.bin``... without safe serialization), each optimizer,
scheduler, sampler and stateful data loader as ``optimizer.bin``, ``scheduler.bin``,
``sampler.bin``, ``dl_state_dict.bin`` (``_1``... for the next ones), each process's random
states as ``random_states_0.pkl``, a GradScaler as ``scaler.pt`` and registered objects as
``custom_checkpoint_0.pkl``. The first model's file holds the weights; each other file is one
entry beside them, named by its stem (``optimizer``, ``model_1``, ``random_states_0``). All but
the safetensors files are torch.save pickles: they are read with ``weights_only`` unless
trusted, and an entry that needs more is left unread, with the reason, when loading a model.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpukit.checkpoint.single_file import SingleFile
from gpukit.checkpoint.single_file import read as read_file
from gpukit.checkpoint.source import Location, StoredObject
from gpukit.errors import UntrustedCheckpointError

__all__ = ["WEIGHTS_ENTRY", "AccelerateState", "is_accelerate_state", "open_accelerate_state"]

WEIGHTS_ENTRY = "model"
# The first model's file, safetensors first (Accelerator.load_state prefers it too).
_WEIGHTS_NAMES = ("model.safetensors", "pytorch_model.bin")
_OTHER_MODEL = re.compile(r"^(model|pytorch_model)_\d+\.(safetensors|bin)$")
_TRAINING_STATE = re.compile(
    r"^((optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.bin"
    r"|random_states_\d+\.pkl|scaler\.pt|custom_checkpoint_\d+\.pkl)$"
)


def is_accelerate_state(names: Collection[str]) -> bool:
    """A folder's file names as ``Accelerator.save_state`` writes them: a model and its state.

    Every such folder has ``random_states_0.pkl`` at least; a model file alone (what
    ``save_pretrained`` writes) is not one.

    >>> is_accelerate_state(["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
    True
    """
    return any(n in _WEIGHTS_NAMES for n in names) and any(_TRAINING_STATE.match(n) for n in names)


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0]


@dataclass
class AccelerateState:
    """A ``save_state`` folder, opened: the first model's weights read, the other files named.

    The :class:`~gpukit.checkpoint.source.Source` of accelerate's layout: ``content`` holds the
    weights under ``"model"`` and a :class:`~gpukit.checkpoint.source.StoredObject` for each
    other file, by its stem; a tensor's stored key is the weights file's own.
    """

    path: Path
    weights: SingleFile
    others: dict[str, Path] = field(default_factory=dict)  # entry name -> its file
    format: str = field(default="accelerate state", init=False)
    layout: str = field(default="accelerate", init=False)
    index: str | None = field(default=None, init=False)
    content: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.content[WEIGHTS_ENTRY] = self.weights.content
        self.content.update({name: StoredObject() for name in self.others})

    @property
    def files(self) -> dict[str, int]:
        """Every file of the state with its size, the weights file first."""
        paths = [self.weights.path, *self.others.values()]
        return {path.name: path.stat().st_size for path in paths}

    @property
    def size(self) -> int:
        """Bytes of every file of the state."""
        return sum(self.files.values())

    @property
    def metadata(self) -> dict[str, Any]:
        """What gk.save recorded in the weights file (nothing, when accelerate wrote it)."""
        return self.weights.metadata

    @property
    def source_devices(self) -> list[str]:
        """The devices the weights were saved from."""
        return self.weights.source_devices

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        """The device one of the weights was saved from (None: unknown)."""
        return self.weights.saved_device(tensor)

    def stored_key(self, location: Location) -> str:
        """The weights file's key of the tensor at ``("model", ...)``."""
        if location[:1] != (WEIGHTS_ENTRY,):
            raise KeyError(location)  # the plan only reads tensors of the weights
        return self.weights.stored_key(location[1:])

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each stored key's tensor (of the weights file) into its targets."""
        self.weights.read_into(targets, trust=trust)

    def _read_entry(self, name: str, trust: bool) -> Any:
        path = self.others[name]
        return read_file(path, target=torch.device("cpu"), trust=trust, folder=self.path).content

    def read_content(self, *, trust: bool, only: Collection[str] | None = None) -> dict[str, Any]:
        """The weights under ``"model"`` and every other entry, read (``only``: those entries).

        A pickle that needs code is refused (UntrustedCheckpointError) unless ``trust``.
        """
        names = [WEIGHTS_ENTRY, *self.others]
        out: dict[str, Any] = {}
        for name in names:
            if only is not None and name not in only:
                continue
            out[name] = (
                self.weights.content if name == WEIGHTS_ENTRY else self._read_entry(name, trust)
            )
        return out

    def read_extras(
        self, names: Collection[str], *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The named entries beside the weights, and those left unread, each with the reason.

        An entry whose pickle ``weights_only`` loading refuses (the random states hold numpy
        objects) is left unread rather than refused: the weights do not depend on it.
        """
        extras: dict[str, Any] = {}
        unread: dict[str, str] = {}
        for name in self.others:
            if name not in names:
                continue
            try:
                extras[name] = self._read_entry(name, trust)
            except UntrustedCheckpointError as exc:
                unread[name] = exc.message
        return extras, unread


def open_accelerate_state(folder: Path, names: Collection[str], *, trust: bool) -> AccelerateState:
    """Read the first model's file of a ``save_state`` folder; name the other files."""
    weights_name = next(name for name in _WEIGHTS_NAMES if name in names)
    weights = read_file(
        folder / weights_name, target=torch.device("cpu"), trust=trust, folder=folder
    )
    others = {
        _stem(name): folder / name
        for name in sorted(names)
        if name != weights_name and (_OTHER_MODEL.match(name) or _TRAINING_STATE.match(name))
    }
    return AccelerateState(folder, weights, others)
