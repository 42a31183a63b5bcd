"""The learner's (or a worker's) peak extra memory over a block of sends, sampled on a
thread of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

#: How often the memory meter samples the process's memory.
MEMORY_SAMPLE_SECONDS: Final = 0.001
#: How long the meter waits for its sampling thread to stop.
STOP_SECONDS: Final = 5.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc(name: str) -> Any:
    """glibc's function ``name`` (through ctypes), or None where there is none."""
    path = ctypes.util.find_library("c")
    if not path or not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


def _heap_reader() -> Callable[[], int] | None:
    """Bytes this process holds from malloc now (glibc >= 2.33), or None elsewhere."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)  # in use on the heaps + mmapped blocks

    return read


def _anon_rss_reader() -> Callable[[], int] | None:
    """Anonymous resident bytes now (resident minus file-backed), or None without /proc."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> int:
        fields = os.pread(fd, 256, 0).split()
        return (int(fields[1]) - int(fields[2])) * page

    return read


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def give_back_freed() -> bool:
    """Collect garbage and hand the memory glibc keeps for reuse back to the system
    (``malloc_trim(0)``), so what a closed session freed is free for the next one; False
    where glibc is not there to ask."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def proc_kib_field(path: str, key: bytes) -> int | None:
    """The figure in kiB on the line ``key`` of a /proc file (``/proc/meminfo``,
    ``/proc/PID/smaps_rollup``), in bytes; None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available_bytes() -> int | None:
    """The machine's ``MemAvailable`` (what can be allocated without swapping), bytes;
    None without /proc."""
    return proc_kib_field("/proc/meminfo", b"MemAvailable:")


@functools.cache
def _readers() -> dict[str, Callable[[], int]]:
    """What the meter reads, best first ("heap" is what the table shows); built once, so
    the process holds one open /proc/self/statm however many meters it makes."""
    made = {"heap": _heap_reader(), "rss_anon": _anon_rss_reader()}
    return {name: read for name, read in made.items() if read is not None}


class PeakMemoryMeter:
    """Peak increase of this process's memory over a ``with`` block, sampled every ~1 ms.

    Two measures, each as ``extra[name]`` (peak minus the value when the block began) and
    ``retained[name]`` (what the block left allocated, e.g. a snapshot kept for late
    joiners):

    - ``"heap"``: bytes held from malloc (glibc's ``mallinfo2``), which is where torch,
      numpy and libzmq put every buffer. It counts a copy even when malloc serves it from
      memory freed earlier, which RSS does not see: the figure to judge "is there a copy
      of the model" by.
    - ``"rss_anon"``: anonymous resident memory from ``/proc/self/statm`` (file-backed
      pages, such as libtorch's code paged in on first use, are left out). What the
      machine feels; it can read low when a copy reuses freed memory.

    A measure this platform lacks is absent from the dicts.
    """

    def __init__(self, interval: float = MEMORY_SAMPLE_SECONDS) -> None:
        self.interval = interval
        self._readers = _readers()
        self.base: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, int]:
        return {name: read() for name, read in self._readers.items()}

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            for name, value in self._read().items():
                if value > self.peak[name]:
                    self.peak[name] = value

    def __enter__(self) -> PeakMemoryMeter:
        gc.collect()
        self.base = self._read()
        self.peak = dict(self.base)
        if self._readers:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=STOP_SECONDS)
            self._thread = None
        self.end = self._read()
        for name, value in self.end.items():
            self.peak[name] = max(self.peak[name], value)

    @property
    def extra(self) -> dict[str, int]:
        return {name: self.peak[name] - self.base[name] for name in self.base}

    @property
    def retained(self) -> dict[str, int]:
        return {name: self.end[name] - self.base[name] for name in self.base}
