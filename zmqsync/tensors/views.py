"""Tensors as bytes: the protocol's dtype names, and byte views that copy nothing.

The protocol names dtypes by string (``"bfloat16"``); these map them to torch's, view a
tensor's memory (or a received frame's) as flat uint8, and wait for the copies queued
into or out of an accelerator.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Final

import torch

from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import DTYPE_ITEMSIZE, Weights

__all__ = [
    "address",
    "byte_view",
    "bytes_of",
    "dtype_name",
    "read_view",
    "source_views",
    "synchronize",
    "torch_dtype",
]

_TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    name: getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name)
}
_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {dt: name for name, dt in _TORCH_DTYPES.items()}


def address(array: Any) -> int:
    """The address of a numpy array's first byte."""
    return int(array.__array_interface__["data"][0])


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise SchemaMismatchError(f"dtype {dtype} cannot be sent by zmqsync") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a protocol dtype name."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise SchemaMismatchError(
            f"dtype {name!r} is not available in this torch ({torch.__version__})"
        ) from None


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view if it is contiguous)."""
    return byte_view(tensor if tensor.is_contiguous() else tensor.contiguous())


def read_view(buf: Any) -> torch.Tensor | None:
    """A uint8 tensor viewing received bytes (None if there are none), to read from.

    Received frames may be read-only, which torch warns about; we never write to them.
    """
    if not len(buf):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def source_views(message: Weights) -> list[torch.Tensor | None]:
    """:func:`read_view` of each of a message's buffers."""
    return [read_view(buf) for buf in message.buffers]


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the work queued on these accelerators (copies into or out of them)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            backend = getattr(torch, device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()
