"""Helpers for the fault tests: deadlines, stopped processes, raw hostile sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq


def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail saying ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until the kernel says it is stopped."""
    os.kill(pid, signal.SIGSTOP)

    def state() -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    until(lambda: state() == "T", 5, f"process {pid} stopped")


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process is stopped for the block (SIGCONT after, whatever happens)."""
    stop(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


#: How long a raw socket's send may wait for a connection to queue to.
RAW_SEND_TIMEOUT_MS = 10_000


@contextlib.contextmanager
def raw_sockets(*targets: tuple[int, str], keys: Any = None) -> Iterator[list[zmq.Socket[Any]]]:
    """Plain pyzmq sockets connected where a hostile local process would connect
    (with CURVE client ``keys``, if given). A send that cannot be queued within
    :data:`RAW_SEND_TIMEOUT_MS` raises ``zmq.Again`` (a DEALER with no connection, as
    after a refused handshake, blocks its sends): the test fails, never hangs."""
    ctx = zmq.Context.instance()
    socks = []
    try:
        for kind, address in targets:
            sock = ctx.socket(kind)
            sock.linger = 0
            sock.sndtimeo = RAW_SEND_TIMEOUT_MS
            if keys is not None:
                keys.apply(sock)
            sock.connect(address)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close(linger=0)


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def squatter(addresses: list[str]) -> Iterator[list[str]]:
    """A thread that tries to bind each of ``addresses`` every few milliseconds for the
    block; yields the list of those it managed to bind (a learner must leave none)."""
    import threading

    bound: list[str] = []
    done = threading.Event()

    def squat() -> None:
        ctx = zmq.Context.instance()
        while not done.is_set():
            for address in addresses:
                with ctx.socket(zmq.PULL) as sock:
                    sock.linger = 0
                    with contextlib.suppress(zmq.ZMQError):
                        sock.bind(address)
                        bound.append(address)
            done.wait(0.003)

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    try:
        yield bound
    finally:
        done.set()
        thread.join(10)
