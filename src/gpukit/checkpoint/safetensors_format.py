"""Writing the safetensors format straight into an open file.

``safetensors.torch.save_file`` replaces the file it is given (so an fsync through another
handle misses it) and ``safetensors.torch.save`` builds the whole file in memory; writing the
simple format ourselves streams each tensor's bytes into the atomic temporary file instead.
Format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets; ``__metadata__`` -> strings), then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from typing import BinaryIO

import torch

from gpukit.errors import CheckpointError

__all__ = ["DTYPES", "write_safetensors"]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def _dense(key: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise CheckpointError(
            f"Cannot save {key!r} to safetensors: a {tensor.layout} tensor on {tensor.device} "
            "has no dense data to store.",
            hint="Save it as .pt/.pth, or materialise the tensor first.",
        )
    if tensor.dtype not in DTYPES:
        raise CheckpointError(
            f"Cannot save {key!r} to safetensors: it has no code for dtype {tensor.dtype}.",
            hint="Save it as .pt/.pth, or convert the tensor to a supported dtype.",
        )
    return tensor.detach().to("cpu").contiguous()


def write_safetensors(
    handle: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> None:
    """Write ``tensors`` and ``metadata`` to ``handle`` in the safetensors format."""
    if sys.byteorder != "little":  # the format is little-endian; let the library swap bytes
        from safetensors.torch import save

        handle.write(save(dict(tensors), metadata=dict(metadata)))
        return
    dense = {key: _dense(key, tensor) for key, tensor in tensors.items()}
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, tensor in dense.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the library does
    handle.write(struct.pack("<Q", len(encoded)))
    handle.write(encoded)
    for tensor in dense.values():
        if tensor.numel():
            handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
