"""Calls with a deadline: torchrl's schemes wait without one, so the transports benchmark
makes every call (theirs and zmqsync's alike) on a thread of its own and waits for it
with one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Final

#: Longest wait for a hung call's cleanup (a scheme's shutdown, an actor's close).
CLEANUP_SECONDS: Final = 10.0
#: A call is given up on this long after ``--timeout``: zmqsync's own timeout errors
#: (which name the missing workers) then arrive first.
DEADLINE_MARGIN: Final = 5.0


class Hung(TimeoutError):
    """A call did not return within its deadline (it is left running on its thread)."""


class CallRunner:
    """Runs calls one at a time on a thread of its own; the caller waits with a deadline.

    torchrl's schemes wait without deadlines (``queue.get()``, ``ray.get()``), so the only
    way to give their ``send()`` one is to wait for it from another thread. zmqsync's
    sends go through the same runner, so both pay the same (untimed) handoff; the time
    recorded is taken on the runner's thread, around the call itself. A call's untimed
    ``before`` runs on that thread first: what a training loop does on the thread that
    sends (the optimizer's step), so that torch's thread pool is the one the send finds.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.hung: str | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"bench-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, before, done, box = job
            start = time.perf_counter()
            try:
                if before is not None:
                    before()
                    start = time.perf_counter()
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            box["elapsed"] = time.perf_counter() - start
            done.set()

    def call(
        self,
        fn: Callable[[], Any],
        timeout: float,
        what: str,
        before: Callable[[], Any] | None = None,
    ) -> tuple[Any, float]:
        """``fn()``'s value and its duration (``before()`` first, untimed, on the same
        thread); raises what either raised, or :class:`Hung`."""
        if self.hung is not None:
            raise Hung(f"{self.name}: an earlier call never returned ({self.hung})")
        done = threading.Event()
        box: dict[str, Any] = {}
        self._jobs.put((fn, before, done, box))
        if not done.wait(timeout):
            self.hung = f"{what} did not return within {timeout:g}s"
            raise Hung(f"{self.name}: {self.hung}")
        if "error" in box:
            raise box["error"]
        return box.get("value"), box["elapsed"]

    def close(self) -> None:
        if self.hung is None:
            self._jobs.put(None)


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on a throwaway thread, waited for at most ``timeout`` seconds."""
    runner = CallRunner(what)
    try:
        return runner.call(fn, timeout, what)[0]
    finally:
        runner.close()
