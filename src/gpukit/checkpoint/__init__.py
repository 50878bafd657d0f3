"""Checkpoints that load anywhere: save without wrapper prefixes, load into any model on any device.

>>> import gpukit as gk, torch
>>> model = torch.nn.DataParallel(torch.nn.Linear(4, 2))
>>> path = gk.save(model, "linear.safetensors")      # keys "weight", "bias": no "module."
>>> report = gk.load(torch.nn.Linear(4, 2), "linear.safetensors")
>>> report.ok
True

``api`` holds save / load; ``io`` reads and writes files (format sniffing, atomic writes);
``keys`` finds the state dict in a checkpoint and cleans its keys; ``report`` says what loaded;
``safetensors_format`` writes safetensors files.
"""

from gpukit.checkpoint.api import LoadReport, clean_state_dict, load, save

__all__ = ["LoadReport", "clean_state_dict", "load", "save"]
