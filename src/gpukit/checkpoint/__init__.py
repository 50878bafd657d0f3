"""Checkpoints that load anywhere: save without wrapper prefixes, load into any model on any device.

>>> import gpukit as gk, torch
>>> model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
>>> path = gk.save(model, "linear.safetensors")      # keys "weight", "bias": no "module."
>>> report = gk.load(torch.nn.Linear(4, 2), "linear.safetensors")
>>> report.ok
True
>>> gk.checkpoint.describe("linear.safetensors").parameter_count
10

``api`` holds save / load; ``conversion`` and ``description`` are gk.checkpoint.convert and
gk.checkpoint.describe; ``plan`` matches a checkpoint onto a model. Every kind of checkpoint is
a ``source`` (one interface, :class:`~gpukit.checkpoint.source.Source`): ``single_file``,
``sharded`` (Hugging Face's folders, also written), ``dcp`` and ``accelerate_state``;
``layout`` recognises which one a path holds, by content. ``atomic`` writes files and folders
atomically; ``paths`` checks paths before any work; ``keys`` finds the state dict in a
checkpoint and cleans its keys; ``report`` says what loaded; ``safetensors_format`` writes
safetensors files.

The names are resolved lazily, so that ``gpukit.checkpoint.paths`` (no torch) imports fast.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpukit.checkpoint.api import clean_state_dict, load, save
    from gpukit.checkpoint.conversion import Conversion, convert
    from gpukit.checkpoint.description import Description, describe
    from gpukit.checkpoint.report import LoadReport

_HOMES = {
    "LoadReport": "report",
    "clean_state_dict": "api",
    "load": "api",
    "save": "api",
    "Conversion": "conversion",
    "convert": "conversion",
    "Description": "description",
    "describe": "description",
}

__all__ = [
    "Conversion",
    "Description",
    "LoadReport",
    "clean_state_dict",
    "convert",
    "describe",
    "load",
    "save",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        return getattr(importlib.import_module(f"gpukit.checkpoint.{home}"), name)
    raise AttributeError(f"module 'gpukit.checkpoint' has no attribute {name!r}")
