"""Checkpoints that load anywhere: save without wrapper prefixes, load into any model on any device.

>>> import gpukit as gk, torch
>>> model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
>>> path = gk.save(model, "linear.safetensors")      # keys "weight", "bias": no "module."
>>> report = gk.load(torch.nn.Linear(4, 2), "linear.safetensors")
>>> report.ok
True

``api`` holds save / load; ``plan`` matches a checkpoint onto a model; ``layout`` recognises
what a path holds (a file, a sharded folder, a DCP folder, an accelerate ``save_state`` folder);
``single_file`` reads single files (format by content); ``sharded`` and ``dcp`` read and write folders,
``accelerate_state`` reads accelerate's; ``atomic`` writes files and folders
atomically; ``paths`` checks paths before any work; ``keys`` finds the state dict in a checkpoint
and cleans its keys; ``report`` says what loaded; ``safetensors_format`` writes safetensors files.

The names are resolved lazily, so that ``gpukit.checkpoint.paths`` (no torch) imports fast.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpukit.checkpoint.api import LoadReport, clean_state_dict, load, save

__all__ = ["LoadReport", "clean_state_dict", "load", "save"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpukit.checkpoint import api

        return getattr(api, name)
    raise AttributeError(f"module 'gpukit.checkpoint' has no attribute {name!r}")
