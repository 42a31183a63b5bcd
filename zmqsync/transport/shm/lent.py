"""Memory a worker lends the learner: its model's tensors, in one memfd the hub writes.

The other way round from the hub's blocks (:mod:`zmqsync.transport.shm.blocks`, which
the hub writes once and every worker maps read-only): here each worker on the learner's
host moves its own tensors into one anonymous ``memfd``, laid out as the version's
stream, and tells the hub where it is (its pid, the descriptor, the file's inode and its
size). The hub maps it writable through ``/proc`` and writes each version straight into
it, one copy per worker by the learner, where otherwise the learner writes a copy into
its own memory and every worker copies that out again.

Trust, both ways:

- The worker trusts the learner with its tensors' memory, as it trusts it with their
  values already.
- The hub trusts nothing the worker says about the memory: the file must be the memfd
  it names (same inode), sealed against shrinking (a worker that could truncate it
  would make the learner's writes fault, ``SIGBUS``), and exactly the version's size.
  A worker that lends anything else is refused (:class:`ValueError`), and the hub sends
  it versions as it sends them to any worker.
- Nobody else gets in: the descriptor is open only until the hub has mapped the memory
  (the worker closes it after the hub's first write), so no other process of the
  worker's user opens it through ``/proc/PID/fd`` later, and no peer names it as its
  own to have the learner write into it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable
from typing import Final, NamedTuple

import numpy as np

from zmqsync.transport.shm.records import Ask, Go, LentAt, Written, encode

__all__ = [
    "LENT_MIN_BYTES",
    "LENT_SEALS",
    "MAX_GOS",
    "LentMemory",
    "LentPeers",
    "TakesLentTensors",
    "Where",
    "lent_at",
    "map_lent",
]

#: Versions whose large tensors (64 KiB and more each) hold fewer bytes than this are
#: streamed, not written into lent memory: the ask and the go cost more than the copy
#: they save (measured: 1 MB to 1-8 pipe workers took 1.1-1.4x the stream's time, and
#: 2,000 tensors of 4 KB 1.1-1.3x: a lending worker wakes twice per version, a streamed
#: one once). By default a worker lends only for versions this large.
LENT_MIN_BYTES: Final = 4 * 1024 * 1024

log = logging.getLogger("zmqsync.transport")

#: Answers to asks a hub keeps for its sender at most (one per worker and version are
#: expected; more are a confused worker's, dropped).
MAX_GOS: Final = 4096

#: Seals a lent memfd must carry: it can neither shrink under the learner nor grow.
LENT_SEALS: Final = 0x0002 | 0x0004  # F_SEAL_SHRINK | F_SEAL_GROW
_F_ADD_SEALS: Final = 1033
_F_GET_SEALS: Final = 1034


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED: Final = ctypes.c_void_p(-1).value
#: Map the worker's pages (resident: its tensors are in them) in one go, in the mmap
#: call: about half what faulting them in page by page at the first write costs (128 MiB:
#: 8-9 ms against 16-18 on the 2-core machine).
_MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)


class _Mapping:
    """A writable ``MAP_SHARED`` mapping of ``nbytes`` of the file ``fd`` opens that keeps
    no descriptor (Python's ``mmap`` keeps a duplicate open for as long as it lives, and
    an open descriptor is what ``/proc/PID/fd`` hands to other processes of the user).
    Unmapped once the last array over it (:func:`_mapped`) is gone."""

    address = 0  # nothing mapped (yet)

    def __init__(self, fd: int, nbytes: int) -> None:
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE
        address = _libc.mmap(None, nbytes, prot, flags, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
        self.address, self.nbytes = address, nbytes
        #: What numpy reads: the mapping as bytes (this object stays the array's base).
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }

    def __del__(self, _munmap: Callable[..., int] = _libc.munmap) -> None:
        # (munmap held from the start: at exit the module's globals may be gone first.)
        if self.address:
            _munmap(self.address, self.nbytes)


def _mapped(fd: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of the file ``fd`` opens, mapped shared and writable, as bytes; ``fd``
    may be closed at once (the mapping lives as long as the array and its views)."""
    return np.asarray(_Mapping(fd, nbytes))


class Where(NamedTuple):
    """What a worker tells the hub of the memory it lends."""

    pid: int
    fd: int
    inode: int
    nbytes: int


class LentMemory:
    """``nbytes`` of this process's memory that a hub on this host may write into: an
    anonymous memfd sealed against resizing, mapped writable here (:attr:`array`).

    The mapping stays valid as long as :attr:`array` (or any view of it, a tensor's
    storage) lives; :meth:`close` closes the descriptor, so nobody can open it any more
    through ``/proc``, a hub included (one that mapped it already keeps writing into the
    same memory: a worker that must stop that moves its tensors to other memory). A
    worker closes it once the hub has mapped it (see :mod:`zmqsync.receiver.lent`)."""

    def __init__(self, nbytes: int, *, name: str = "zmqsync-lent") -> None:
        import fcntl

        if nbytes <= 0:
            raise ValueError(f"cannot lend {nbytes} bytes")
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, _F_ADD_SEALS, LENT_SEALS)
            #: The lent bytes, writable here.
            self.array = _mapped(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino

    def where(self) -> Where:
        """What to tell the hub (:func:`map_lent` takes it)."""
        if self.fd < 0:
            raise ValueError("this memory is no longer lent")
        return Where(os.getpid(), self.fd, self.inode, self.nbytes)

    def close(self) -> None:
        """Let nobody open it any more: close the descriptor (the mapping here, and a
        hub's that mapped it already, live on with their views)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def map_lent(where: Where, nbytes: int) -> np.ndarray:
    """Map, writable, the memory a worker on this host says it lends (``where``), if it is
    what a hub may write ``nbytes`` into: the memfd it names (same inode), sealed
    against shrinking and growing, of exactly ``nbytes``. Raises :class:`ValueError`
    for anything else, :class:`OSError` if it cannot be opened (the worker is gone, or
    this process may not look into it)."""
    pid, fd, inode, size = where
    if pid <= 0 or fd < 0 or nbytes <= 0 or size != nbytes:
        raise ValueError(f"lent memory at pid {pid}, fd {fd}: {size} bytes, not {nbytes}")
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        import fcntl

        st = os.fstat(handle)
        if st.st_ino != inode or not stat.S_ISREG(st.st_mode):
            raise ValueError(f"fd {fd} of pid {pid} is not the memory it lent")
        try:
            seals = fcntl.fcntl(handle, _F_GET_SEALS)
        except OSError as exc:  # not a memfd: no seals at all
            raise ValueError(f"fd {fd} of pid {pid} is not a sealed memfd") from exc
        if seals & LENT_SEALS != LENT_SEALS:
            raise ValueError(f"fd {fd} of pid {pid} may shrink or grow under the learner")
        if st.st_size != nbytes:
            raise ValueError(f"fd {fd} of pid {pid} is {st.st_size} bytes, not {nbytes}")
        mapped = _mapped(handle, nbytes)
    finally:
        with contextlib.suppress(OSError):
            os.close(handle)  # the learner keeps no descriptor of a worker's memory
    return mapped


class LentPeers:
    """What a hub knows of the memory its peers lend it: where each says its tensors lie
    (its latest :class:`LentAt`), that memory once mapped, the answers to the sender's
    asks, and counts. The hub decides whom to believe (a peer it keeps, proven to be on
    this host) and forgets a peer when it does: nothing here outlives the hub's own
    table of peers. Thread-safe: the hub's reader and the sender both use it.

    Counts (``counts()``): ``lent_peers`` (peers lending now), ``lent_writes`` (versions
    written into them), ``lent_refused`` (memory that was not what it must be)."""

    def __init__(self, describe: Callable[[bytes], str] = repr) -> None:
        self._describe = describe
        self._lock = threading.Lock()
        #: Peer -> where it says its tensors lie, and that memory once mapped.
        self._lends: dict[bytes, tuple[LentAt, np.ndarray | None]] = {}
        self._gos: list[tuple[bytes, int, int, bool]] = []
        #: Peer -> the memory it lent that the hub refused: said again, it stays refused.
        self._refused_at: dict[bytes, LentAt] = {}
        self._refused = 0
        self._writes = 0

    def said(self, peer: bytes, record: LentAt) -> None:
        """``peer`` lends the memory ``record`` names (none, if its size is 0): mapped,
        from what it says now, when next used. Said again, the same memory stays mapped,
        or refused."""
        with self._lock:
            if record.nbytes <= 0:
                self._lends.pop(peer, None)
                self._refused_at.pop(peer, None)
            elif record != self._refused_at.get(peer):
                kept = self._lends.get(peer)
                if kept is None or kept[0] != record:
                    self._lends[peer] = (record, None)
                self._refused_at.pop(peer, None)

    def answered(self, peer: bytes, record: Go) -> None:
        """``peer``'s answer to an ask, kept for :meth:`take_gos`."""
        with self._lock:
            if len(self._gos) < MAX_GOS:
                self._gos.append((peer, record.version, record.epoch, record.ok))

    def forget(self, peer: bytes) -> None:
        """``peer`` is gone: its memory is unmapped with the last view of it."""
        with self._lock:
            self._lends.pop(peer, None)
            self._refused_at.pop(peer, None)

    def peers(self, layout: bytes) -> list[bytes]:
        """The peers lending memory laid out as versions of ``layout`` (a digest)."""
        with self._lock:
            return [p for p, (at, _) in self._lends.items() if at.layout == layout]

    def take_gos(self) -> list[tuple[bytes, int, int, bool]]:
        with self._lock:
            gos, self._gos = self._gos, []
        return gos

    def memory(self, peer: bytes, nbytes: int) -> np.ndarray | None:
        """The memory ``peer`` lends, mapped writable (:func:`map_lent`) for a version of
        ``nbytes``; None if it lends none, or none the hub may write (then it is
        forgotten until it says something else)."""
        with self._lock:
            found = self._lends.get(peer)
        if found is None:
            return None
        at, mapped = found
        if mapped is not None and mapped.nbytes == nbytes:
            return mapped
        try:
            mapped = map_lent(Where(at.pid, at.fd, at.inode, at.nbytes), nbytes)
        except (OSError, ValueError) as exc:
            log.warning("%s lends memory the learner cannot use: %s", self._describe(peer), exc)
            with self._lock:
                self._refused += 1
                if self._lends.get(peer, (None,))[0] is at:
                    del self._lends[peer]
                    self._refused_at[peer] = at
            return None
        with self._lock:
            if self._lends.get(peer, (None,))[0] is at:  # unless it said something since
                self._lends[peer] = (at, mapped)
        return mapped

    def written(self, ok: bool) -> None:
        if ok:
            with self._lock:
                self._writes += 1

    def counts(self) -> dict[str, int]:
        """The counts, once any is not zero (else none)."""
        with self._lock:
            lending, refused, writes = len(self._lends), self._refused, self._writes
        if not (lending or refused or writes):
            return {}
        return {"lent_peers": lending, "lent_refused": refused, "lent_writes": writes}


class TakesLentTensors:
    """What a hub that peers lend their tensors to answers its sender (the lent-tensor
    methods of :class:`~zmqsync.transport.base.Lends`), from its :class:`LentPeers`
    table (``_lent``); each hub sends a record to a peer its own way
    (:meth:`_lent_record`) and says which peers it still serves (``lent_peers``). List
    it before ``Lends`` among a hub's bases."""

    _lent: LentPeers

    def _lent_record(self, peer: bytes, record: bytes, *, unmaps: bool = False) -> None:
        """Send ``record`` to ``peer``; ``unmaps``: it is a version written in, after which
        the peer forgets the hub's blocks it maps (a hub that hands blocks over once
        hands them again)."""
        raise NotImplementedError

    def ask_lent(self, peer: bytes, version: int, epoch: int, layout: bytes) -> None:
        self._lent_record(peer, encode(Ask(version, epoch, layout)))

    def take_gos(self) -> list[tuple[bytes, int, int, bool]]:
        return self._lent.take_gos()

    def lent_memory(self, peer: bytes, nbytes: int) -> np.ndarray | None:
        return self._lent.memory(peer, nbytes)

    def written(
        self,
        peer: bytes,
        version: int,
        epoch: int,
        ok: bool,
        metadata: bytes,
        unusable: bool = False,
    ) -> None:
        self._lent.written(ok)
        record = Written(version, epoch, ok, metadata, unusable=unusable)
        self._lent_record(peer, encode(record), unmaps=ok)


def lent_at(where: Where | None, layout: bytes) -> LentAt:
    """What a spoke tells its hub of the memory its tensors lie in (``where``, laid out
    as versions of ``layout``); None: it lends none any more."""
    if where is None:
        return LentAt(os.getpid(), 0, 0, 0, bytes(16))
    return LentAt(where.pid, where.fd, where.inode, where.nbytes, layout)
