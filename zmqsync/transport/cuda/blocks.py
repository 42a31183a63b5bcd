"""The hub's device blocks: a learner's versions on its GPU, lent to workers on it.

A :class:`DevicePool` is a :class:`~zmqsync.transport.shm.blocks.BlockPool` whose blocks
are device memory: lent to the sender to write a version into, located by address when
the version's frames are sent, leased to each worker a lease names them to, and free
again once no lease and no tensor of this process holds them. Its blocks are numbered
from :data:`~.handles.DEVICE_IDS`, so leases and releases name both kinds alike.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

import torch

from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.shm.blocks import BlockPool, Ref

__all__ = ["DeviceBlock", "DevicePool"]

log = logging.getLogger("zmqsync.transport.cuda")

#: Device blocks alive at once: each is model-sized device memory (the version being
#: written, the one served to late joiners, one a slow worker still reads).
MAX_DEVICE_BLOCKS: Final = 3
#: Free device blocks kept for reuse (the next version's).
KEEP_FREE_DEVICE: Final = 1


def _uses(tensor: torch.Tensor) -> int:
    """How many tensors hold ``tensor``'s storage (views of it count)."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


class DeviceBlock:
    """One block of device memory, its CUDA IPC handles, and the leases workers hold on
    it.

    Each worker gets a handle of its own (:meth:`handle_for_peer`): torch counts the
    processes that opened a shared block with one counter per handle, and frees the
    block's memory only once each of them let go of it, or never (a warning at exit).
    """

    fd: Final = -1  # a lease's entry names no descriptor, no inode
    inode: Final = 0
    #: What the pool tracks of a host block's pages (BlockPool.unwritten): a device
    #: block is never lent for a version that went only into tensors workers lend.
    fresh = False
    fresh_when_lent = False
    discard = False

    def __init__(self, block_id: int, size: int, device: torch.device) -> None:
        self.id = block_id
        self.size = size
        self.kind = device
        ipc = handles.IPC
        lent = ipc.lendable(device)
        #: The GPU it is on, as workers name theirs (``uuid_of``).
        self.uuid = ipc.uuid_of(device) if lent else b""
        self.array: torch.Tensor = ipc.allocate(size, device)
        self.address: int = self.array.data_ptr()
        self.leases: Counter[Any] = Counter()
        # The first handle is made now, before the block's own references are counted.
        self._first: bytes | None = ipc.share(self.array).encode() if lent else None
        self._own = _uses(self.array)

    def handle_for_peer(self) -> bytes:
        """An encoded :class:`~.handles.DeviceHandle` for one more worker to open the
        block with (see the class)."""
        first, self._first = self._first, None
        return first if first is not None else handles.IPC.share(self.array).encode()

    def viewed_here(self) -> bool:
        return _uses(self.array) > self._own

    def free(self) -> bool:
        return not self.leases and not self.viewed_here()

    def close(self) -> None:
        # Memory a worker still maps stays allocated until it lets go (torch counts the
        # other processes' references to shared device memory).
        on_gpu = self.kind.type == "cuda"
        self.array = None  # type: ignore[assignment]
        if on_gpu:
            torch.cuda.ipc_collect()  # frees what workers let go of since


class DevicePool(BlockPool):
    """Device blocks, lent on any device (see the module)."""

    def __init__(
        self, *, max_blocks: int = MAX_DEVICE_BLOCKS, keep_free: int = KEEP_FREE_DEVICE
    ) -> None:
        super().__init__(max_blocks=max_blocks, keep_free=keep_free)
        self._ids = itertools.count(DEVICE_IDS)
        #: Blocks it could not allocate: the device had no room.
        self.refused = 0

    def lend_on(self, nbytes: int, device: torch.device) -> tuple[DeviceBlock, torch.Tensor] | None:
        """A free block of at least ``nbytes`` on ``device`` and a view of its first
        ``nbytes``; None when every block is busy and no more may be made, or the
        device has no room for one."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        try:
            return self._lend(nbytes, device)
        except torch.OutOfMemoryError as exc:
            # The learner's own work comes first: this version goes through the host.
            self.refused += 1
            if self.refused == 1:
                log.warning(
                    "no device block of %d bytes on %s (%s): versions go through the host "
                    "while the device has no room",
                    nbytes,
                    device,
                    str(exc).splitlines()[0] if str(exc) else "out of memory",
                )
            return None

    def _make(self, block_id: int, size: int, kind: Any) -> DeviceBlock:
        return DeviceBlock(block_id, size, kind)

    def locate(self, frame: Any) -> tuple[Any, int] | None:
        start, n = frame.data_ptr(), frame.nbytes
        with self._lock:
            for block in self._blocks.values():
                if (
                    block.kind == frame.device
                    and block.address <= start
                    and start + n <= block.address + block.size
                ):
                    return block, start - block.address
        return None

    def place_device(self, frames: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """``frames`` with each device tensor that lies in a block as a :class:`Ref`
        (any other device tensor as its bytes, copied to the host), and what keeps their
        blocks lent until leased."""
        out: list[Any] = list(frames)
        keep: list[Any] = []
        for i, frame in enumerate(frames):
            if not handles.IPC.is_device(frame):
                continue
            found = self.locate(frame)
            if found is None:
                out[i] = frame.cpu().numpy().tobytes()
                continue
            out[i] = Ref(found[0], found[1], frame.nbytes)
            keep.append(frame)
        return out, keep
