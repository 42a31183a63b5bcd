"""The hub's shared-memory blocks: lent for large frames, and lent again once free.

A large frame is written into a block once; peers map the block read-only and copy from
it straight into their model, so a version crosses no kernel socket. A block is free
again when nobody holds it: here, no Python object views it (its array's reference count
is back to its own); there, every lease a peer had on it was released, or the peer was
lost.

Blocks are anonymous ``memfd`` files: they vanish with the last process that maps them,
so a crash leaves nothing behind in ``/dev/shm``. They are sealed against resizing, and
against new writable mappings once the hub has its own, so a confused peer can neither
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

__all__ = ["ALIGN", "LEND_MIN_FRAME", "SHM_AVAILABLE", "Block", "BlockPool", "Ref", "immutable"]

#: Whether this platform has anonymous shared memory files (Linux).
SHM_AVAILABLE: Final = hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")
#: Blocks alive at once (free or not). Past this, a hub sends through its socket.
MAX_BLOCKS: Final = 4
#: Free blocks kept for reuse; the others are returned to the system.
KEEP_FREE: Final = 2
#: Frames at least this large travel through shared memory.
LEND_MIN_FRAME: Final = 64 * 1024
#: Each frame copied into a block starts on this boundary (a cache line).
ALIGN: Final = 64
#: Linux's F_SEAL_FUTURE_WRITE (not named in Python's fcntl): no new writable mappings.
_F_SEAL_FUTURE_WRITE: Final = 0x0010


class Block:
    """One shared-memory block: its file, its mapping, and the leases peers hold on it."""

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
        #: Leases each peer holds on the block (one per message naming it, until released).
        self.leases: Counter[Any] = Counter()
        self._own_refs = sys.getrefcount(self.array)
        #: No page of it was ever written: it holds no memory (a sealed block's pages
        #: cannot be given back but with the block).
        self.fresh = True
        #: Whether it was fresh when last lent (see :meth:`BlockPool.unwritten`).
        self.fresh_when_lent = True
        #: Retire it once free rather than lend it again: it holds pages nobody reads.
        self.discard = False

    #: Where its memory is: the host (a device block says which device).
    kind: Any = None

    def viewed_here(self) -> bool:
        """True while some object in this process views the block."""
        return sys.getrefcount(self.array) > self._own_refs

    def free(self) -> bool:
        return not self.leases and not self.viewed_here()

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


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BlockPool:
    """The hub's blocks: lent for large messages, located by address, and free again
    once every lease on them is released."""

    def __init__(self, *, max_blocks: int = MAX_BLOCKS, keep_free: int = KEEP_FREE) -> None:
        self._blocks: dict[int, Block] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._max_blocks = max_blocks
        self._keep_free = keep_free
        #: Blocks wanted while every one was busy (their frames then went inline).
        self.fallbacks = 0

    def lend(self, nbytes: int) -> tuple[Block, np.ndarray] | None:
        """A free block of at least ``nbytes`` and a writable view of its first ``nbytes``,
        or None when every block is busy and no more may be made (send inline then)."""
        return self._lend(nbytes, None)

    def _lend(self, nbytes: int, kind: Any) -> Any:
        """:meth:`lend`, of a block of ``kind`` (a subclass's: where its memory is)."""
        with self._lock:
            free = []
            for block in [b for b in self._blocks.values() if b.free()]:
                if block.discard:
                    self._retire(block)
                else:
                    free.append(block)
            fits = [b for b in free if b.kind == kind and nbytes <= b.size <= 2 * nbytes]
            if fits:
                # One that held a version first: its pages are there, where a fresh
                # one's first write costs a page fault per page.
                block = next((b for b in fits if not b.fresh), fits[0])
                block.fresh_when_lent, block.fresh = block.fresh, False
                return block, block.array[:nbytes]
            # No free block fits: give back a free one of the wrong size, then make one.
            if len(self._blocks) >= self._max_blocks and free:
                self._retire(free[0])
            if len(self._blocks) >= self._max_blocks:
                self.fallbacks += 1
                return None
            block = self._make(next(self._ids), max(nbytes, 1), kind)
            block.fresh = False  # lent now: written, as far as the pool knows
            self._blocks[block.id] = block
            view = block.array[:nbytes]  # viewed now: _trim keeps it
            self._trim()
            return block, view

    def _make(self, block_id: int, size: int, kind: Any) -> Any:
        return Block(block_id, size)

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
    def place(self, frames: Sequence[Any]) -> tuple[list[Any], list[Any]]: ...
    @overload
    def place(self, frames: Sequence[Any], *, copy: bool) -> tuple[list[Any], list[Any]] | None: ...

    def place(
        self, frames: Sequence[Any], *, copy: bool = True
    ) -> tuple[list[Any], list[Any]] | None:
        """``frames`` with the large ones as :class:`Ref`: a read-only frame that already
        lies in a block (a snapshot carved from :meth:`lend`) as it is, the others copied
        into one lent block (or left as they are when every block is busy).

        Returns the frames and what keeps their blocks lent: hold on to it until each
        peer's lease is counted (:meth:`lease`). ``copy=False``: copy nothing; None if a
        large frame does not already lie in a block.
        """
        out: list[Any] = list(frames)
        keep: list[Any] = []
        to_copy: list[tuple[int, int]] = []
        for i, frame in enumerate(frames):
            if isinstance(frame, Ref):  # placed already (in a device block)
                continue
            n = memoryview(frame).nbytes
            if n < LEND_MIN_FRAME:
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
            lent = self.lend(sum(_aligned(n) for _, n in to_copy))
            if lent is None:
                return out, keep  # every block busy: these go as bytes
            block, view = lent
            keep.append(view)
            offset = 0
            for i, n in to_copy:
                np.copyto(view[offset : offset + n], np.frombuffer(frames[i], dtype=np.uint8))
                out[i] = Ref(block, offset, n)
                offset += _aligned(n)
        return out, keep

    def unwritten(self, memory: Any) -> None:
        """``memory``, which :meth:`lend` gave, was never written and never will be: every
        peer took its version another way (into tensors it lends the hub). Versions go
        that way now, so the pool keeps no pages nobody will read: every other free
        block that was written is retired (its memory goes back to the system once no
        peer maps it either), and so is ``memory``'s block once free, if it held a
        version before; a fresh one stays, for the next version, at no cost."""
        found = self.locate(memory)
        with self._lock:
            if found is not None:
                block = found[0]
                if block.fresh_when_lent:
                    block.fresh = True
                else:
                    block.discard = True  # retired at the next lend that finds it free
            for block in [b for b in self._blocks.values() if b.free() and not b.fresh]:
                self._retire(block)

    def live_ids(self) -> list[int]:
        """Ids of the blocks that exist now (a peer may forget any other)."""
        with self._lock:
            return list(self._blocks)

    def lease(self, block: Block, peer: Any) -> bool:
        """Count one message naming ``block`` as leased to ``peer``; False if retired."""
        with self._lock:
            if block.id not in self._blocks:
                return False
            block.leases[peer] += 1
            return True

    def release(self, block_id: int, peer: Any) -> bool:
        """``peer`` released one lease on ``block_id``; False if it held none."""
        with self._lock:
            block = self._blocks.get(block_id)
            if block is None or block.leases[peer] <= 0:  # a Counter lookup adds no key
                return False
            block.leases[peer] -= 1
            if block.leases[peer] == 0:
                del block.leases[peer]
            return True

    def release_all(self, block_id: int, peer: Any) -> None:
        """Every lease ``peer`` holds on ``block_id`` ends, however many."""
        with self._lock:
            block = self._blocks.get(block_id)
            if block is not None:
                block.leases.pop(peer, None)

    def held_by(self, peer: Any) -> int:
        """How many blocks ``peer`` holds a lease on."""
        with self._lock:
            return sum(1 for b in self._blocks.values() if b.leases.get(peer, 0) > 0)

    def forget(self, peer: Any) -> None:
        """``peer`` is gone (its process too): every lease it held ends."""
        with self._lock:
            for block in self._blocks.values():
                block.leases.pop(peer, None)

    def retire(self, block_ids: Iterable[int]) -> None:
        """Some peer may still read these blocks and will never say when it stops:
        never rewrite them (their pages live on while it maps them)."""
        with self._lock:
            for block_id in block_ids:
                block = self._blocks.get(block_id)
                if block is not None:
                    self._retire(block)

    def nbytes(self) -> int:
        """Bytes of shared memory this pool holds: its blocks but those no version was
        ever written into (they are mapped, and hold no page)."""
        with self._lock:
            return sum(b.size for b in self._blocks.values() if not b.fresh)

    def _trim(self) -> None:
        free = [b for b in self._blocks.values() if b.free()]
        for block in free[self._keep_free :]:
            self._retire(block)

    def _retire(self, block: Block) -> None:
        del self._blocks[block.id]
        block.close()

    def close(self) -> None:
        with self._lock:
            for block in self._blocks.values():
                block.close()
            self._blocks.clear()
