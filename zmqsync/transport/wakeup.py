"""A self-pipe: one thread wakes another that waits on file descriptors."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Final

__all__ = ["Wakeup"]

#: Bytes read off the pipe at a time while draining it.
_DRAIN_READ: Final = 4096


class Wakeup:
    """A non-blocking pipe: :meth:`wake` makes its read end readable until :meth:`drain`.

    The waiting thread waits on :meth:`fileno` beside its other descriptors. Waking is
    thread-safe, never blocks (a full pipe already holds a wake-up) and does nothing
    once closed.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()  # a descriptor is never written once closed
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def wake(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._write, b"\0")

    def drain(self) -> None:
        """Take every wake-up so far."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, _DRAIN_READ):
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._read, self._write):
                with contextlib.suppress(OSError):
                    os.close(fd)
