"""Large private buffers a pipe end reuses from message to message.

Fresh memory costs a page fault per page when first written, which on some VMs is most
of a copy's time: large copies (the hub's) and large receive buffers (a worker's) come
from a small pool instead, and go back to it once nothing views them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from zmqsync.protocol import Buffer
from zmqsync.transport.shm.blocks import Ref, immutable
from zmqsync.transport.shm.borrowing import when_gone

__all__ = ["POOL_MIN_BYTES", "BufferPool", "owned"]

#: Messages at least this large are copied into (and read into) reused buffers.
POOL_MIN_BYTES: Final = 1024 * 1024
#: Free buffers a pool keeps for reuse.
POOL_KEEP: Final = 2


class BufferPool:
    """Large buffers, each lent with the objects that view it and free again once every
    one of them is garbage (nothing can read it any more)."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def lend(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes``: call :meth:`watch` on everything that views it."""
        if nbytes < POOL_MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            for i, buf in enumerate(self._free):
                if nbytes <= buf.nbytes <= 2 * nbytes:
                    del self._free[i]
                    return buf
        return np.empty(nbytes, dtype=np.uint8)

    def watch(self, buf: np.ndarray, holders: Sequence[object]) -> None:
        """Give ``buf`` back once every object in ``holders`` has been collected."""
        if buf.nbytes >= POOL_MIN_BYTES and holders:
            when_gone(holders, lambda: self._give_back(buf))

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < POOL_KEEP:
                self._free.append(buf)


def owned(
    frames: Sequence[Buffer | Ref], pool: BufferPool | None = None
) -> tuple[list[Buffer | Ref], Any]:
    """``frames`` safe to keep after the caller changes its memory: copied once into one
    buffer (from ``pool``, when given). Returns the frames and that buffer (or None)."""
    mutable = [i for i, f in enumerate(frames) if not immutable(f)]
    if not mutable:
        return list(frames), None
    sizes = [memoryview(frames[i]).nbytes for i in mutable]  # type: ignore[arg-type]
    total = sum(sizes)
    buf = pool.lend(total) if pool is not None else np.empty(total, dtype=np.uint8)
    out = list(frames)
    offset = 0
    for i, n in zip(mutable, sizes, strict=True):
        view = buf[offset : offset + n]
        np.copyto(view, np.frombuffer(frames[i], dtype=np.uint8))  # type: ignore[arg-type]
        out[i] = view.data
        offset += n
    return out, buf
