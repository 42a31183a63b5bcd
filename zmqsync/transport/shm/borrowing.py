"""A peer's side of lent blocks: mapping them, reading leases, releasing once unviewed."""

from __future__ import annotations

import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np

from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.shm.records import TOKEN_BYTES, Entry, Lease, Offer, RecordError

__all__ = [
    "MAX_MAPS",
    "PeerBlocks",
    "borrow",
    "map_peer_block",
    "read_token",
    "release_when_gone",
    "when_gone",
]

#: Blocks a peer keeps mapped that it opened itself; the hub's live list trims it sooner.
MAX_MAPS: Final = 8


def map_peer_block(pid: int, fd: int, size: int, inode: int | None = None) -> np.ndarray:
    """Map block ``fd`` of process ``pid`` read-only, through ``/proc``; checks its size
    and, if given, its inode (a descriptor number the owner reused names another file)."""
    if pid <= 0 or fd < 0 or size <= 0:
        raise ValueError(f"no block at pid {pid}, fd {fd}, size {size}")
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(handle)
        if inode is not None and st.st_ino != inode:
            raise ValueError(f"fd {fd} of pid {pid} is no longer the block it was")
        if st.st_size < size:
            raise ValueError(f"block fd {fd} of pid {pid} is {st.st_size} bytes, not {size}")
        mapped = mmap.mmap(handle, size, prot=mmap.PROT_READ)
    finally:
        os.close(handle)
    return np.frombuffer(mapped, dtype=np.uint8)


def read_token(offer: Offer) -> bytes:
    """The token in the probe block ``offer`` names (OSError/ValueError: unreadable)."""
    return bytes(map_peer_block(offer.pid, offer.fd, TOKEN_BYTES, offer.inode)[:TOKEN_BYTES])


class PeerBlocks:
    """One hub's blocks as this process maps them, read-only, each once: opened through
    ``/proc`` when a lease first names them, or handed over (:meth:`add`: a descriptor
    passed on a pipe).

    A mapping is known by its block id *and* the inode the lease names: a hub restarted
    in the same process (the same pid) numbers its new blocks from the start again, and
    a block id alone would name the old life's bytes."""

    def __init__(self, limit: int | None = MAX_MAPS) -> None:
        self._maps: dict[int, tuple[int, np.ndarray]] = {}  # block -> (inode, mapping)
        self._owner = 0  # the hub's pid
        self._limit = limit

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._maps

    def add(self, block_id: int, mapped: Any, owner: int | None = None) -> None:
        """A block handed over (a descriptor on a pipe, a device block's handle): no
        inode named. ``owner``: the pid of the hub it is from, where leases name one (a
        new hub's block makes this forget the blocks of the one before)."""
        if owner is not None and owner != self._owner:
            self._maps.clear()
            self._owner = owner
        self._maps.pop(block_id, None)
        while self._limit is not None and len(self._maps) >= self._limit:
            del self._maps[next(iter(self._maps))]
        self._maps[block_id] = (0, mapped)

    def keep_only(self, pid: int, live: Sequence[int]) -> None:
        """Forget every mapping but those of ``pid``'s blocks in ``live`` (the others
        are unmapped once no frame views them)."""
        if pid != self._owner:
            self._maps.clear()
            self._owner = pid
        for block_id in self._maps.keys() - set(live):
            del self._maps[block_id]

    def view(self, entry: Entry) -> np.ndarray:
        """The bytes ``entry`` names, mapping its block first if need be (again, if the
        block of that id mapped before is another file)."""
        known = self._maps.get(entry.block)
        # A block handed over on its own pipe (no inode named: 0) is that pipe's hub's.
        if known is not None and entry.inode and known[0] and known[0] != entry.inode:
            del self._maps[entry.block]  # another life's block of the same id
            known = None
        if known is None:
            mapped = map_peer_block(self._owner, entry.fd, entry.size, entry.inode)
            while self._limit is not None and len(self._maps) >= self._limit:
                del self._maps[next(iter(self._maps))]
            self._maps[entry.block] = (entry.inode, mapped)
        else:
            mapped = known[1]
        end = entry.offset + entry.length
        if end > mapped.nbytes:
            raise ValueError(f"a frame names bytes past the end of block {entry.block}")
        return mapped[entry.offset : end]

    def forget_host(self) -> None:
        """Forget every mapping of a shared-memory block (not a device block's): the
        hub wrote a version into this worker's lent tensors, and may retire the blocks
        it read versions from before (they are unmapped once no frame views them, and
        mapped again if named again)."""
        for block_id in [b for b in self._maps if b < DEVICE_IDS]:
            del self._maps[block_id]

    def clear(self) -> None:
        self._maps.clear()


def borrow(
    lease: Lease, inline: Iterator[Any], maps: PeerBlocks
) -> tuple[list[Any], dict[int, list[np.ndarray]]]:
    """The frames of ``lease``: read-only views of the hub's blocks (numpy arrays) and
    the ``inline`` frames in their places; and, per block, the views of it. Blocks the
    lease does not list as live are unmapped first (once no frame views them).

    Raises :class:`RecordError` when the inline frames do not match the lease, and
    OSError/ValueError when a block cannot be mapped.
    """
    maps.keep_only(lease.pid, lease.live)
    frames: list[Any] = []
    views: dict[int, list[np.ndarray]] = {}
    for entry in lease.entries:
        if entry.block < 0:
            frame = next(inline, None)
            if frame is None:
                raise RecordError("a lease names more inline frames than it carries")
            frames.append(frame)
            continue
        view = maps.view(entry)
        views.setdefault(entry.block, []).append(view)
        frames.append(view)
    if next(inline, None) is not None:
        raise RecordError("a lease carries more inline frames than it names")
    return frames, views


def when_gone(objects: Sequence[object], then: Callable[[], None]) -> None:
    """Call ``then`` once every one of ``objects`` is garbage (on whichever thread lets
    go of the last one): what views lent memory tells that the memory is free again."""
    left = [len(objects)]
    lock = threading.Lock()

    def one_gone() -> None:
        with lock:
            left[0] -= 1
            done = left[0] == 0
        if done:
            then()

    for obj in objects:
        weakref.finalize(obj, one_gone)


def release_when_gone(
    views: Mapping[int, Sequence[np.ndarray]], release: Callable[[int], None]
) -> None:
    """``release(block_id)`` once every view of that block in ``views`` is garbage."""
    for block_id, of_block in views.items():
        when_gone(of_block, functools.partial(release, block_id))
