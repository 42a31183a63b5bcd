"""Large byte copies split over a few threads, where the process has cores to spare.

On a 2-core host a learner writing a chunk and a worker copying one out each copy on
one thread: the learner and its workers already take every core. On a host with many
cores one thread leaves most of them idle while a version crosses (16 cores: one thread
copies at about a sixth of what torch's pooled ``copy_`` does). numpy lets go
of the GIL while it copies plain bytes, so a large piece cut into slices, one per
thread, copies at several threads' speed; the threads wait on a queue between copies,
never spinning, so they take no core from the model's own work.

How many threads: a quarter of the cores this process may run on (its affinity, and no
more than a container's CPU quota), at most :data:`MAX_THREADS`: one on up to 7 cores
(the calling thread alone, as before), 4 on 16. The learner and each worker count
alike, since a learner streaming to K workers shares the host with them.
``ZMQSYNC_COPY_THREADS`` sets the number for a process (1: never split).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Final

import numpy as np

__all__ = ["COPY_THREADS_ENV", "Copier", "copier", "default_threads", "usable_cores"]

#: The environment variable that sets how many threads a process copies with.
COPY_THREADS_ENV: Final = "ZMQSYNC_COPY_THREADS"
#: Most threads one copy is split over.
MAX_THREADS: Final = 8
#: Cores per copy thread: a quarter of the cores, so that the learner and its workers on
#: one host together stay near the core count.
CORES_PER_THREAD: Final = 4
#: Pieces smaller than this are copied on the calling thread (handing a slice to another
#: thread costs tens of microseconds); each slice of a split copy is at least half of it.
SPLIT_MIN_BYTES: Final = 1 << 20
#: Slices start on this boundary (a cache line).
_ALIGN: Final = 64
#: Where a cgroup v2 system keeps the process's CPU quota ("max" or "QUOTA PERIOD").
CGROUP_CPU_MAX: Final = "/sys/fs/cgroup/cpu.max"
#: A slice not copied within this many seconds means the process is wedged: raise.
_TIMEOUT: Final = 60.0


def default_threads() -> int:
    """Threads this process copies large pieces with (see the module)."""
    env = os.environ.get(COPY_THREADS_ENV, "").strip()
    if env:
        try:
            return max(1, min(MAX_THREADS, int(env)))
        except ValueError:
            raise ValueError(f"{COPY_THREADS_ENV}={env!r}: expected a whole number") from None
    return max(1, min(MAX_THREADS, usable_cores() // CORES_PER_THREAD))


def usable_cores() -> int:
    """The cores this process may run on: its affinity, and no more than its cgroup's
    CPU quota (a container started with ``--cpus 2`` on a 64-core host has 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota)) if quota is not None else cores


def _cgroup_quota() -> int | None:
    """Whole cores the cgroup (v2) this process runs in may use, rounded up; None when
    it has no quota (or this is no cgroup v2 system)."""
    try:
        with open(CGROUP_CPU_MAX) as f:
            fields = f.read().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None


class Copier:
    """Copies byte arrays, splitting large ones over ``threads`` threads (the calling
    one included). Its helper threads start at the first split copy."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def copy_function(self) -> Callable[[np.ndarray, np.ndarray], object]:
        """:meth:`copy`, or ``np.copyto`` itself where nothing is ever split (one
        thread): a chunk of thousands of small pieces pays no extra call per piece."""
        return np.copyto if self.threads == 1 else self.copy

    def copy(self, dest: np.ndarray, source: np.ndarray) -> None:
        """``dest[:] = source``: two 1-d byte arrays of one length."""
        n = dest.nbytes
        if self.threads == 1 or n < SPLIT_MIN_BYTES:
            np.copyto(dest, source)
            return
        parts = min(self.threads, n // (SPLIT_MIN_BYTES // 2))
        per_part = -(-n // parts)
        step = -(-per_part // _ALIGN) * _ALIGN
        pool = self._executor()
        futures = [
            pool.submit(np.copyto, dest[at : at + step], source[at : at + step])
            for at in range(step, n, step)
        ]
        np.copyto(dest[:step], source[:step])
        done, late = concurrent.futures.wait(futures, timeout=_TIMEOUT)
        if late:
            raise TimeoutError(f"a {n}-byte copy's slices took over {_TIMEOUT:g}s")
        for future in done:
            future.result()  # a slice's error is the copy's

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="zmqsync-copy"
                )
            return self._pool

    def close(self) -> None:
        """Let the helper threads end (they finish the slices they hold); a later split
        copy starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def forget_threads(self) -> None:
        """In a forked child: the parent's threads are not there; make new ones when
        needed (the old executor would queue slices nobody takes)."""
        self._pool = None
        self._lock = threading.Lock()


_copier: Copier | None = None


def copier() -> Copier:
    """This process's copier, with :func:`default_threads` threads."""
    global _copier
    if _copier is None:
        _copier = Copier(default_threads())
    return _copier


def _after_fork() -> None:
    if _copier is not None:
        _copier.forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
