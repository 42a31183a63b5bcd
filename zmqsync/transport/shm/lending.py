"""The hub's side of lending blocks: the probe a peer proves itself on, and leases."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from zmqsync.transport.shm.blocks import Block, Ref
from zmqsync.transport.shm.records import FAN_OUT, TOKEN_BYTES, Entry, Join, Lease, Offer

__all__ = ["ProbeBlock", "lease_of"]

#: Bytes of a probe block (one page).
PROBE_BYTES: Final = 4096


class ProbeBlock:
    """A small block holding a random token. The :attr:`offer` says where the block
    is, never the token: a peer that answers with the token (a :class:`Join`) has opened
    the block, so it can map this process's blocks."""

    def __init__(self) -> None:
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._block = Block(0, PROBE_BYTES)
        self._block.array[:TOKEN_BYTES] = np.frombuffer(self._token, dtype=np.uint8)
        self.offer = Offer(os.getpid(), self._block.fd, self._block.inode)

    def proves(self, join: Join) -> bool:
        """Whether ``join`` carries the token."""
        return secrets.compare_digest(join.token, self._token)

    def close(self) -> None:
        self._block.close()


def lease_of(
    placed: Sequence[Any],
    *,
    pid: int,
    live: Sequence[int],
    seq: int = 0,
    channel: int = FAN_OUT,
    slots: Sequence[int] = (),
) -> tuple[Lease, list[Any]]:
    """The lease naming ``placed`` (frames, the large ones as :class:`Ref`, from
    :meth:`~zmqsync.transport.shm.blocks.BlockPool.place`), and its inline frames."""
    entries: list[Entry] = []
    inline: list[Any] = []
    for frame in placed:
        if isinstance(frame, Ref):
            b = frame.block
            entries.append(Entry(b.id, b.fd, b.inode, b.size, frame.offset, frame.length))
        else:
            entries.append(Entry(-1, length=memoryview(frame).nbytes))
            inline.append(frame)
    base, bits = Lease.bitmap(slots)
    return Lease(pid, tuple(entries), tuple(live), seq, channel, base, bits), inline
