"""Shared-memory blocks a hub lends for large frames, and lends again once free.

Used by the pipe transport: a large frame is written into a block once, the block's file
descriptor travels to each worker once (``SCM_RIGHTS`` over the pipe's Unix socket), and
every later message only names the block and an offset. Workers map blocks read-only and
copy from them straight into their model, so a version crosses no kernel socket.

A block is free again when nobody holds it:

- here, no Python object views it (its array's reference count is back to its own);
- there, every worker it was sent to has released it (a record sent back once the
  worker's frames are garbage), or has been lost (its pipe broke).

Blocks are anonymous ``memfd`` files: they vanish with the last process that maps them,
so a crash leaves nothing behind in ``/dev/shm``. They are sealed against resizing, and
against new writable mappings once the hub has its own, so a confused worker can neither
shrink a block under the learner (``SIGBUS``) nor write into it.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

import numpy as np

__all__ = [
    "SHM_AVAILABLE",
    "SHM_MIN_FRAME",
    "Block",
    "PeerBlocks",
    "Ref",
    "ShmPool",
    "map_peer_block",
]

#: Whether this platform has anonymous shared memory files (Linux).
SHM_AVAILABLE: Final = hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")
#: Blocks alive at once (free or not). Past this, a hub sends through the socket.
MAX_BLOCKS: Final = 4
#: Free blocks kept for reuse; the others are returned to the system.
KEEP_FREE: Final = 2
#: Frames at least this large travel through shared memory.
SHM_MIN_FRAME: Final = 64 * 1024
#: Each frame copied into a block starts on this boundary (a cache line).
ALIGN: Final = 64
#: Linux's F_SEAL_FUTURE_WRITE (not named in Python's fcntl): no new writable mappings.
_F_SEAL_FUTURE_WRITE: Final = 0x0010


class Block:
    """One shared-memory block: its file, its mapping, and who holds it."""

    def __init__(self, block_id: int, size: int) -> None:
        import fcntl

        self.id = block_id
        self.size = size
        self.fd = os.memfd_create(f"zmqsync-{block_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            with contextlib.suppress(OSError):  # kernels before 5.1 lack it
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        #: Unique among live files: tells this block from a later one that got its fd number.
        self.inode: int = os.fstat(self.fd).st_ino
        self.address: int = self.array.__array_interface__["data"][0]
        #: Messages naming this block that each peer has not released yet.
        self.readers: Counter[Any] = Counter()
        self._own_refs = sys.getrefcount(self.array)

    def viewed_here(self) -> bool:
        """True while some object in this process views the block."""
        return sys.getrefcount(self.array) > self._own_refs

    def free(self) -> bool:
        return not self.readers and not self.viewed_here()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1
        self.array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still exists: the GC unmaps later
            self._mm.close()


@dataclass(frozen=True, slots=True)
class Ref:
    """A frame that lies in a shared-memory block: sent as its place, not its bytes."""

    block: Block
    offset: int
    length: int


def immutable(frame: Any) -> bool:
    """Whether ``frame`` never changes: bytes, a read-only view (a memoryview or a
    numpy array, as a sender lends its own copies), or a place in a block."""
    if isinstance(frame, bytes | Ref):
        return True
    if isinstance(frame, memoryview):
        return frame.readonly
    return isinstance(frame, np.ndarray) and not frame.flags.writeable


class ShmPool:
    """The hub's blocks: lent for large messages, located by address, freed on release."""

    def __init__(self, *, max_blocks: int = MAX_BLOCKS, keep_free: int = KEEP_FREE) -> None:
        self._blocks: dict[int, Block] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._max_blocks = max_blocks
        self._keep_free = keep_free
        #: Blocks given back to the system; the hub tells workers to unmap them.
        self.retired: list[int] = []
        self.fallbacks = 0

    def lend(self, nbytes: int) -> tuple[Block, np.ndarray] | None:
        """A free block of at least ``nbytes`` and a writable view of its first ``nbytes``,
        or None when every block is busy and no more may be made (send inline then)."""
        with self._lock:
            free = [b for b in self._blocks.values() if b.free()]
            for block in free:
                if nbytes <= block.size <= 2 * nbytes:
                    return block, block.array[:nbytes]
            # No free block fits: give back a free one of the wrong size, then make one.
            if len(self._blocks) >= self._max_blocks and free:
                self._retire(free[0])
            if len(self._blocks) >= self._max_blocks:
                self.fallbacks += 1
                return None
            block = Block(next(self._ids), max(nbytes, 1))
            self._blocks[block.id] = block
            view = block.array[:nbytes]  # viewed now: _trim keeps it
            self._trim()
            return block, view

    def locate(self, frame: Any) -> tuple[Block, int] | None:
        """The block ``frame`` lies in and its offset there, or None."""
        view = np.frombuffer(frame, dtype=np.uint8)
        start = view.__array_interface__["data"][0]
        with self._lock:
            for block in self._blocks.values():
                if block.address <= start and start + view.nbytes <= block.address + block.size:
                    return block, start - block.address
        return None

    @overload
    def share(self, frames: Sequence[Any]) -> tuple[list[Any], list[Any]]: ...
    @overload
    def share(self, frames: Sequence[Any], *, copy: bool) -> tuple[list[Any], list[Any]] | None: ...

    def share(
        self, frames: Sequence[Any], *, copy: bool = True
    ) -> tuple[list[Any], list[Any]] | None:
        """``frames`` with the large ones as :class:`Ref`: a read-only frame that already
        lies in a block (a snapshot carved from :meth:`lend`) as it is, the others copied
        into one lent block (or left as they are when every block is busy).

        Returns the frames and what keeps their blocks lent: hold on to it until each
        peer's hold is counted (:meth:`hold`). ``copy=False``: copy nothing; None if a
        large frame does not already lie in a block.
        """
        out: list[Any] = list(frames)
        keep: list[Any] = []
        to_copy: list[tuple[int, int]] = []
        for i, frame in enumerate(frames):
            n = memoryview(frame).nbytes
            if n < SHM_MIN_FRAME:
                continue
            if immutable(frame):
                found = self.locate(frame)
                if found is not None:
                    out[i] = Ref(found[0], found[1], n)
                    keep.append(frame)
                    continue
            if not copy:
                return None
            to_copy.append((i, n))
        if to_copy:
            total = sum(-(-n // ALIGN) * ALIGN for _, n in to_copy)
            lent = self.lend(total)
            if lent is None:
                return out, keep  # every block busy: these go as bytes
            block, view = lent
            keep.append(view)
            offset = 0
            for i, n in to_copy:
                np.copyto(view[offset : offset + n], np.frombuffer(frames[i], dtype=np.uint8))
                out[i] = Ref(block, offset, n)
                offset += -(-n // ALIGN) * ALIGN
        return out, keep

    def live_ids(self) -> list[int]:
        """Ids of the blocks that exist now (a worker may forget any other)."""
        with self._lock:
            return list(self._blocks)

    def hold(self, block: Block, peer: Any) -> bool:
        """Count one message naming ``block`` as held by ``peer``; False if retired."""
        with self._lock:
            if block.id not in self._blocks:
                return False
            block.readers[peer] += 1
            return True

    def release(self, block_id: int, peer: Any) -> bool:
        """``peer`` is done with one message naming ``block_id``; False if it held none."""
        with self._lock:
            block = self._blocks.get(block_id)
            if block is None or block.readers[peer] <= 0:  # a Counter lookup adds no key
                return False
            block.readers[peer] -= 1
            if block.readers[peer] == 0:
                del block.readers[peer]
            return True

    def drop_hold(self, block_id: int, peer: Any) -> None:
        """``peer`` holds nothing in ``block_id`` any more (however many it held)."""
        with self._lock:
            block = self._blocks.get(block_id)
            if block is not None:
                block.readers.pop(peer, None)

    def abandon(self, peer: Any, block_ids: Iterable[int]) -> None:
        """``peer`` may still read these blocks and will never say when it stops: retire
        them, so they are never rewritten (their pages live on while it maps them)."""
        with self._lock:
            for block_id in block_ids:
                block = self._blocks.get(block_id)
                if block is not None:
                    self._retire(block)

    def forget(self, peer: Any) -> None:
        """``peer`` is gone: it holds nothing any more."""
        with self._lock:
            for block in self._blocks.values():
                block.readers.pop(peer, None)

    def nbytes(self) -> int:
        """Bytes of shared memory this pool maps."""
        with self._lock:
            return sum(b.size for b in self._blocks.values())

    def _trim(self) -> None:
        free = [b for b in self._blocks.values() if b.free()]
        for block in free[self._keep_free :]:
            self._retire(block)

    def _retire(self, block: Block) -> None:
        del self._blocks[block.id]
        self.retired.append(block.id)
        block.close()

    def take_retired(self) -> list[int]:
        with self._lock:
            out, self.retired = self.retired, []
            return out

    def close(self, blocks: Iterable[Block] | None = None) -> None:
        with self._lock:
            for block in list(self._blocks.values()) if blocks is None else blocks:
                self._blocks.pop(block.id, None)
                block.close()


# --- a reader in another process ---------------------------------------------------------


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


class PeerBlocks:
    """Another process's blocks as this one maps them (read-only, each mapped once, by
    owner pid and block id), for readers that open them through ``/proc``."""

    def __init__(self, limit: int = 8) -> None:
        self._maps: dict[tuple[int, int], np.ndarray] = {}
        self._limit = limit

    def keep_only(self, pid: int, alive: set[int]) -> None:
        """Forget every mapping but those of ``pid``'s blocks in ``alive`` (the others
        are unmapped once no frame views them)."""
        for key in [k for k in self._maps if k[0] != pid or k[1] not in alive]:
            del self._maps[key]

    def view(
        self,
        pid: int,
        block_id: int,
        fd: int,
        size: int,
        start: int,
        length: int,
        inode: int | None = None,
    ) -> np.ndarray:
        """Bytes ``start .. start + length`` of the block, mapping it first if need be."""
        mapped = self._maps.get((pid, block_id))
        if mapped is None:
            mapped = map_peer_block(pid, fd, size, inode)
            while len(self._maps) >= self._limit:
                del self._maps[next(iter(self._maps))]
            self._maps[(pid, block_id)] = mapped
        if start + length > mapped.nbytes:
            raise ValueError(f"a frame names bytes past the end of block {block_id}")
        return mapped[start : start + length]

    def clear(self) -> None:
        self._maps.clear()
