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
    "read_only_storage",
    "read_view",
    "source_views",
    "synchronize",
    "torch_dtype",
    "word_spans",
    "word_view",
    "word_width",
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


#: The integer dtype torch copies a byte range as, by its alignment: torch's copy of
#: ``uint8`` runs 10-20% slower than the same bytes as ``int64`` (measured on one thread
#: and on two), and a copy of raw bytes keeps every bit whatever the integer width.
_WORDS: Final = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def word_width(*spans: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every number in ``spans``."""
    for width, _ in _WORDS:
        if not any(n % width for n in spans):
            return width
    return 1


def word_spans(data: torch.Tensor) -> tuple[int, int, int]:
    """What must be a multiple of a word for ``data`` (flat ``uint8``) to be viewed as
    words of it: its address, its offset in its storage and its length."""
    return data.data_ptr(), int(data.storage_offset()), data.numel()


def word_view(data: torch.Tensor, width: int) -> torch.Tensor:
    """A flat ``uint8`` tensor's bytes as integers of ``width`` bytes (no copy; every
    number in its :func:`word_spans` must be a multiple of ``width``)."""
    for size, dtype in _WORDS:
        if size == width:
            return data.view(dtype) if width > 1 else data
    raise ValueError(f"no integer dtype of {width} bytes")


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view if it is contiguous)."""
    return byte_view(tensor if tensor.is_contiguous() else tensor.contiguous())


class _WarnsOnce:
    """A torch call that warns, once per process, when handed read-only memory (torch's
    ``TORCH_WARN_ONCE``): the first such call runs with that warning silenced, the later
    ones as they are (silencing costs more than the call, on every received chunk)."""

    def __init__(self) -> None:
        self._warned = False

    def __call__(self, make: Any, *args: Any, read_only: bool, **kwargs: Any) -> Any:
        if self._warned or not read_only:
            return make(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only on purpose
            made = make(*args, **kwargs)
        self._warned = True
        return made


_FROM_BUFFER = _WarnsOnce()
_FROM_NUMPY = _WarnsOnce()


def read_view(buf: Any) -> torch.Tensor | None:
    """A uint8 tensor viewing received bytes (None if there are none), to read from.

    Received frames may be read-only, which torch warns about; we never write to them.
    """
    if not len(buf):
        return None
    read_only = memoryview(buf).readonly
    return _FROM_BUFFER(torch.frombuffer, buf, dtype=torch.uint8, read_only=read_only)


def read_only_storage(array: Any) -> torch.UntypedStorage:
    """The storage of a tensor over a numpy array that may be read-only (a mapping of a
    shared version: a write through it faults, on purpose)."""
    return _FROM_NUMPY(
        torch.from_numpy, array, read_only=not array.flags.writeable
    ).untyped_storage()


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
