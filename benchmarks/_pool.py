"""Worker processes driven over control pipes: the learner's :class:`WorkerPool`, and
:func:`worker_main`, the loop every benchmark's worker process runs.

A worker is built in its own process by a ``setup`` callable (its sessions, receivers or
relay: whatever :class:`Served` object the benchmark needs), then answers the commands
that object names, one at a time. The control pipes (multiprocessing ``Pipe``, pickle)
only set things up, tear them down and collect digests or checks; weights never travel
over them, and nothing on them is timed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import torch

#: Every benchmark's worker processes are spawned (a fork would inherit the learner's
#: threads and sockets).
SPAWN: Final = mp.get_context("spawn")
#: How long a worker may take to start (spawn + import torch) on a loaded 2-core box.
WORKER_START_SECONDS: Final = 120.0
#: Extra seconds workers get to answer a command that opens a session: they connect
#: within the session's own timeout, and their reply must not lose that race.
OPEN_MARGIN_SECONDS: Final = 10.0
#: How often an idle worker looks whether its parent is still there.
PARENT_CHECK_SECONDS: Final = 1.0
#: How long :meth:`WorkerPool.close` waits for the workers to exit before ending them.
EXIT_SECONDS: Final = 5.0
#: How long it then waits after each terminate and kill.
END_SECONDS: Final = 2.0


class Served(Protocol):
    """What a worker process holds: the commands it answers, and its cleanup (run when
    the process ends, whatever ends it)."""

    def commands(self) -> Mapping[str, Callable[..., Any]]: ...

    def close(self) -> object: ...


class WorkerError(RuntimeError):
    """A worker process failed a command (its traceback is in the message)."""


def worker_main(
    conn: Any,
    parent_pid: int,
    torch_threads: int | None,
    setup: Callable[..., Served],
    args: tuple[Any, ...],
) -> None:
    """Entry point of a spawned worker: builds ``setup(*args)``, then answers commands;
    returns (and the process ends) on "exit", when the control pipe breaks, or when the
    parent is gone.

    Every worker answers ``("start", ())`` with ``"ready"`` (so the first reply comes
    once the set-up is done), and ``("exit", ())`` with nothing: it returns.
    """
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    # Ctrl-C goes to the whole process group: the parent cleans up, workers just follow.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        served = setup(*args)
    except Exception:  # the answer to "start": the parent reports it, with this traceback
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        return
    handlers: dict[str, Callable[..., Any]] = {"start": lambda: "ready", **served.commands()}
    try:
        while True:
            if not conn.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != parent_pid:
                    return
                continue
            try:
                command, command_args = conn.recv()
            except EOFError:
                return
            if command == "exit":
                return
            try:
                handler = handlers.get(command)
                if handler is None:
                    raise ValueError(f"unknown command {command!r}")
                reply = handler(*command_args)
            except Exception:  # the parent reports it, with this traceback
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", reply))
    except (EOFError, BrokenPipeError, OSError):
        return
    finally:
        served.close()


class WorkerPool:
    """Spawned worker processes, one per entry of ``args``, each built by
    ``setup(*args[i])`` (see :func:`worker_main`).

    Starting a process that imports torch takes seconds on a small machine; a pool that
    serves a whole run keeps the run's time on the measurements. Every command has a
    deadline, and :meth:`close` ends every process (exit, then terminate, then kill).
    """

    def __init__(
        self,
        setup: Callable[..., Served],
        args: Sequence[tuple[Any, ...]],
        *,
        torch_threads: int | None = None,
        name: str = "bench-worker",
    ) -> None:
        self.size = len(args)
        self.torch_threads = torch_threads
        self._setup = setup
        self._args = list(args)
        self._name = name
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def spawn(self) -> None:
        """Start the processes (without waiting for them: :meth:`start` does)."""
        for idx, args in enumerate(self._args):
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(
                target=worker_main,
                args=(child, os.getpid(), self.torch_threads, self._setup, args),
                name=f"{self._name}-{idx}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def start(self, timeout: float = WORKER_START_SECONDS) -> None:
        """Spawn the processes and return once every one is set up."""
        self.spawn()
        self.call(range(self.size), "start", (), timeout)

    @property
    def pids(self) -> list[int]:
        """The processes' ids, in worker order (their memory is read from /proc)."""
        return [int(proc.pid) for proc in self._procs]

    def alive(self) -> bool:
        """Whether every process is still running."""
        return all(proc.is_alive() for proc in self._procs)

    def post(
        self, workers: Iterable[int], command: str, args: Sequence[Any] | dict[int, Any]
    ) -> list[int]:
        """Send ``command`` without waiting: :meth:`collect` the replies later (always:
        an uncollected reply would answer the next command). ``args`` is one tuple for
        all, or ``{worker: tuple}``. Returns the workers it went to."""
        ids = list(workers)
        for i in ids:
            a = args[i] if isinstance(args, dict) else args
            self._conns[i].send((command, tuple(a)))
        return ids

    def call(
        self,
        workers: Iterable[int],
        command: str,
        args: Sequence[Any] | dict[int, Any],
        timeout: float,
    ) -> list[Any]:
        """Send ``command`` to each worker, then collect every reply (in worker order)."""
        return self.collect(self.post(workers, command, args), command, timeout)

    def collect(self, ids: Iterable[int], command: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        replies = []
        for i in ids:
            conn = self._conns[i]
            remaining = max(0.0, deadline - time.monotonic())
            if not conn.poll(remaining):
                proc = self._procs[i]
                state = "alive" if proc.is_alive() else f"dead, exit code {proc.exitcode}"
                raise TimeoutError(
                    f"worker {i} did not answer {command!r} within {timeout:g}s ({state})"
                )
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                raise WorkerError(
                    f"worker {i} died during {command!r} (exit code {self._procs[i].exitcode})"
                ) from None
            if status != "ok":
                raise WorkerError(f"worker {i} failed {command!r}:\n{payload}")
            replies.append(payload)
        return replies

    def close(self, timeout: float = EXIT_SECONDS) -> None:
        """End every worker: ask, then terminate, then kill. Idempotent."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                conn.send(("exit", ()))
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(END_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join(END_SECONDS)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
