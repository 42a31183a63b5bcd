"""CUDA IPC handles as bytes: what a worker needs to open a device block of its hub.

``UntypedStorage._share_cuda_()`` gives a storage's handle as plain values (the memory
handle, sizes, the reference counter's file and the event's handle); they travel as one
record of fixed fields and bounded byte strings, and the worker rebuilds the storage
with ``UntypedStorage._new_shared_cuda`` (what ``torch.multiprocessing`` does, without
its pickle). GPUs are named by their UUID: two processes may number the same GPU
differently (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass
from typing import Any, Final

import torch

from zmqsync.transport.shm.records import NO_DEVICE

__all__ = [
    "DEVICE_IDS",
    "GONE",
    "IPC",
    "MAX_HANDLE_BYTES",
    "CudaIpc",
    "DeviceHandle",
    "gpu_name",
    "lent_device",
    "local_index",
    "open_block",
]

log = logging.getLogger("zmqsync.transport.cuda")

#: Device blocks are numbered from here (shared-memory blocks from 1): one lease names
#: both kinds, and a release says which pool it is for by the id alone.
DEVICE_IDS: Final = 1 << 30
#: Bytes of each handle field (CUDA's are 64; the reference counter's is a file name).
MAX_HANDLE_BYTES: Final = 512
#: GPU UUID digest, storage bytes, offset, reference counter offset, event sync, and the
#: lengths of the memory handle, the reference counter's handle and the event handle.
_HEAD: Final = struct.Struct("<16sQQQ?HHH")


@dataclass(frozen=True, slots=True)
class DeviceHandle:
    """What opens one device block in another process."""

    uuid: bytes
    handle: bytes
    size: int
    offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool

    @staticmethod
    def max_size() -> int:
        return _HEAD.size + 3 * MAX_HANDLE_BYTES

    def encode(self) -> bytes:
        head = _HEAD.pack(
            self.uuid,
            self.size,
            self.offset,
            self.ref_offset,
            self.event_sync,
            len(self.handle),
            len(self.ref_handle),
            len(self.event_handle),
        )
        return head + self.handle + self.ref_handle + self.event_handle

    @classmethod
    def decode(cls, raw: bytes) -> DeviceHandle:
        """The handle in ``raw``; ValueError if it is malformed."""
        if len(raw) < _HEAD.size:
            raise ValueError(f"a device handle of {len(raw)} bytes")
        uuid, size, offset, ref_offset, sync, n_handle, n_ref, n_event = _HEAD.unpack_from(raw)
        if max(n_handle, n_ref, n_event) > MAX_HANDLE_BYTES:
            raise ValueError("a device handle over the limits")
        if len(raw) != _HEAD.size + n_handle + n_ref + n_event:
            raise ValueError(f"a device handle of {len(raw)} bytes does not match its fields")
        at = _HEAD.size
        handle, ref = raw[at : at + n_handle], raw[at + n_handle : at + n_handle + n_ref]
        event = raw[at + n_handle + n_ref :]
        return cls(bytes(uuid), handle, size, offset, ref, ref_offset, event, bool(sync))


def local_index(uuid: bytes) -> int | None:
    """This process's index of the GPU named ``uuid`` (None: it sees no such GPU)."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if IPC.uuid_of(index) == uuid:
            return index
    return None


class CudaIpc:
    """What device lending asks of the device, and the only part of it that knows
    CUDA: which devices are lent, naming a GPU, allocating, sharing and opening a
    block, waiting for the device. (Where there is no GPU, a test stands CPU shared
    memory in for it, and everything around it runs as it is.)"""

    def lendable(self, device: Any) -> bool:
        """Whether versions on ``device`` may be lent through its IPC handles (a GPU)."""
        return device is not None and torch.device(device).type == "cuda"

    def is_device(self, frame: Any) -> bool:
        """Whether ``frame`` is a tensor on a lent device (a device block's bytes)."""
        return isinstance(frame, torch.Tensor) and frame.is_cuda

    def uuid_of(self, device: torch.device | int) -> bytes:
        """A 16-byte name of the GPU ``device`` is, the same in every process of the host."""
        props = torch.cuda.get_device_properties(device)
        return hashlib.blake2b(str(props.uuid).encode(), digest_size=16).digest()

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A block: ``nbytes`` of memory on ``device``."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def share(self, tensor: torch.Tensor) -> DeviceHandle:
        """A handle of ``tensor``'s storage (a whole block: it starts at byte 0), for
        one process to open; each call counts one more opener (torch's counter)."""
        storage = tensor.untyped_storage()
        # torch's one way to a CUDA IPC handle that is not a pickle (torch.multiprocessing
        # calls it too, then pickles the fields: here they travel as DeviceHandle bytes).
        device, handle, size, offset, ref, ref_offset, event, sync = storage._share_cuda_()
        return DeviceHandle(
            self.uuid_of(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(ref),
            int(ref_offset),
            bytes(event or b""),
            bool(sync),
        )

    def open_handle(self, handle: DeviceHandle) -> torch.Tensor:
        """The block ``handle`` names, as a 1-D uint8 tensor on this process's index of
        its GPU; ValueError if this process sees no such GPU."""
        index = local_index(handle.uuid)
        if index is None:
            raise ValueError("a device block on a GPU this process does not see")
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            handle.handle,
            handle.size,
            handle.offset,
            handle.ref_handle,
            handle.ref_offset,
            handle.event_handle,
            handle.event_sync,
        )
        out = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        return out.set_(storage, 0, (handle.size,), (1,))

    def synchronize(self, device: torch.device) -> None:
        """Wait for everything queued on ``device``."""
        torch.cuda.synchronize(device)


#: The device side of lending (see :class:`CudaIpc`).
IPC = CudaIpc()


def lent_device(device: Any) -> torch.device | None:
    """``device`` as a worker names it to its hub (a GPU with its index), or None where
    versions are not lent on it (the CPU)."""
    device = torch.device(device)
    if not IPC.lendable(device):
        return None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def gpu_name(device: torch.device | None) -> bytes:
    """What a worker tells its hub its model lives on: the UUID digest of ``device``, or
    :data:`~zmqsync.transport.shm.records.NO_DEVICE` (None: it takes no device blocks)."""
    return NO_DEVICE if device is None else IPC.uuid_of(device)


#: What :func:`open_block` returns, with ``gone_ok``, for a block the device could not
#: open although it names a GPU this process sees.
GONE: Final = "gone"


def open_block(block_id: int, raw: bytes, *, gone_ok: bool = False) -> torch.Tensor | str | None:
    """Device block ``block_id`` opened from its encoded handle ``raw``; None when it
    cannot be opened here (logged: a malformed handle, a GPU this process does not see,
    or the device refused it). ``gone_ok``: where the hub may have freed the block
    since it sent the handle (a worker that was stopped), the device refusing it gives
    :data:`GONE` instead, and is not logged as a warning."""
    try:
        return IPC.open_handle(DeviceHandle.decode(raw))
    except (ValueError, RuntimeError) as exc:  # RuntimeError: what CUDA raises
        if gone_ok and isinstance(exc, RuntimeError):
            log.info("device block %d could not be opened (%s): gone meanwhile?", block_id, exc)
            return GONE
        log.warning(
            "device block %d cannot be opened here (%s): versions come through the host",
            block_id,
            exc,
        )
        return None
