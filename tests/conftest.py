"""Shared fixtures: free endpoints, spawned worker processes, and leak checks."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
from collections.abc import Iterator

import pytest

from zmqsync.testing import memory_fleet  # noqa: F401 - re-exported for tests

SPAWN = mp.get_context("spawn")


def free_port() -> int:
    """A free port ``p``, with ``p + 1`` free too (a ZeroMQ hub binds its data socket
    there), below the kernel's ephemeral range.

    A port the kernel hands out (``bind`` to port 0) lies in the ephemeral range, and
    until the test binds it any outgoing connection (a worker reconnecting, say) may
    take it, or the port after it, as its local port: the test's bind then fails, or a
    restarted learner's bind of the same address does. Outgoing connections never take
    a port below that range.
    """
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 20000), low - 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two free ports below the ephemeral range")


@pytest.fixture
def ipc_endpoint(tmp_path) -> str:  # type: ignore[no-untyped-def]
    return f"ipc://{tmp_path}/sender"


@pytest.fixture
def tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request, tmp_path) -> str:  # type: ignore[no-untyped-def]
    if request.param == "ipc":
        return f"ipc://{tmp_path}/sender"
    return "tcp://127.0.0.1:*"


class Fleet:
    """Worker processes started with `spawn`, each driven over a local control pipe
    (test harness only: the weights travel over zmqsync's own transports)."""

    def __init__(self) -> None:
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.conns: dict[int, object] = {}

    def start(
        self,
        scheme,
        worker_idx: int,
        *,
        kind: str = "mlp",
        connect_timeout: float = 30.0,  # type: ignore[no-untyped-def]
        init_kwargs: dict | None = None,
        target=None,  # type: ignore[no-untyped-def]
    ):
        """Start worker ``worker_idx`` (the harness's key for it); ``init_kwargs`` go to
        its ``init_on_receiver`` (a pipe worker's ``pipe=``, ``worker_idx=None``...).
        ``target``: another entry point taking ``run_worker``'s arguments."""
        from _workers import run_worker

        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(
            target=target or run_worker,
            args=(scheme, worker_idx, kind, child, connect_timeout, init_kwargs),
            daemon=True,
        )
        proc.start()
        child.close()  # the worker holds it: if the worker dies, ask() fails at once
        self.procs[worker_idx], self.conns[worker_idx] = proc, parent
        return proc

    def ask(self, worker_idx: int, command: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
        conn = self.conns[worker_idx]
        conn.send(command)  # type: ignore[attr-defined]
        if not conn.poll(timeout):  # type: ignore[attr-defined]
            raise TimeoutError(f"worker {worker_idx} did not answer {command!r} in {timeout}s")
        reply = conn.recv()  # type: ignore[attr-defined]
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise AssertionError(f"worker {worker_idx} failed: {reply[1]}")
        return reply

    def wait_ready(self, worker_idx: int, timeout: float = 60.0) -> None:
        conn = self.conns[worker_idx]
        if not conn.poll(timeout):  # type: ignore[attr-defined]
            raise TimeoutError(f"worker {worker_idx} did not start in {timeout}s")
        reply = conn.recv()  # type: ignore[attr-defined]
        assert reply == "ready", f"worker {worker_idx}: {reply}"

    def over_pipes(self, model, kind: str, workers: int = 2, **options):  # type: ignore[no-untyped-def]
        """A ``MultiProcessWeightSyncScheme`` (given ``options``) sending ``model`` to
        ``workers`` pipe workers of ``kind`` (started here, ready when it returns); shut
        it down after."""
        from zmqsync import MultiProcessWeightSyncScheme

        pipes = [SPAWN.Pipe() for _ in range(workers)]
        scheme = MultiProcessWeightSyncScheme(timeout=30, **options)
        ends = [p for p, _ in pipes]
        scheme.init_on_sender("policy", pipes=ends, model=model, num_workers=workers)
        try:
            for i, (_, child) in enumerate(pipes):
                self.start(scheme, i, kind=kind, init_kwargs={"pipe": child, "worker_idx": None})
                child.close()
            for i in range(workers):
                self.wait_ready(i, timeout=120)
        except BaseException:
            scheme.shutdown()
            raise
        return scheme

    def each_version_exact(self, scheme, model, workers: int, versions: int = 3) -> list:  # type: ignore[no-untyped-def]
        """Bump ``model`` and send it ``versions`` times: after each send every worker
        holds exactly that version. Returns the workers' last states."""
        from _workers import bump

        import zmqsync

        states: list = []
        for version in range(1, versions + 1):
            bump(model)
            scheme.send()
            expected = zmqsync.checksum(model)
            states = [self.ask(i, "state") for i in range(workers)]
            for i, state in enumerate(states):
                assert (state["version"], state["checksum"]) == (version, expected), i
        return states

    def all_hold(self, workers: int, want: tuple[int, str], within: float = 30.0) -> list:
        """Wait until workers ``0 .. workers - 1`` all hold ``want`` (version,
        checksum); returns their states."""
        import time

        deadline = time.monotonic() + within
        while True:
            states = [self.ask(i, "state") for i in range(workers)]
            if all((s["version"], s["checksum"]) == want for s in states):
                return states
            assert time.monotonic() < deadline, [(s["version"], s["checksum"]) for s in states]
            time.sleep(0.1)

    def stop(self, worker_idx: int, timeout: float = 30.0) -> None:
        """Stop a worker the polite way: it shuts its scheme down and exits."""
        self.conns[worker_idx].send("stop")  # type: ignore[attr-defined]
        proc = self.procs[worker_idx]
        proc.join(timeout)
        assert proc.exitcode == 0, f"worker {worker_idx} did not exit cleanly: {proc.exitcode}"

    def kill(self, worker_idx: int) -> None:
        proc = self.procs[worker_idx]
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)

    def close(self) -> None:
        for idx, proc in self.procs.items():
            if proc.is_alive():
                with contextlib.suppress(OSError):  # BrokenPipeError is one
                    self.conns[idx].send("stop")  # type: ignore[attr-defined]
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def on_the_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process (the learner) lends "device" blocks of the stand-in for CUDA IPC
    (``tests/_device_standin.py``), and flattens its CPU model as a GPU's is: left where
    it is, written into the lent block a chunk at a time."""
    from _device_standin import CpuIpc

    from zmqsync.tensors.flatten import Flattener
    from zmqsync.transport.cuda import handles

    monkeypatch.setattr(handles, "IPC", CpuIpc())
    monkeypatch.setattr(Flattener, "_prepare", lambda self, tensors: self._prepare_staged(tensors))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the whole test session (starting one takes seconds).

    Test modules that define actor classes register themselves with
    ``ray.cloudpickle.register_pickle_by_value``: Ray's workers cannot import them.
    """
    import ray

    if ray.is_initialized():  # started by the code under test: leave it to its owner
        yield
        return
    # Ray's memory monitor kills the actor that uses most when the machine's memory
    # runs short, which a test then reports as some unrelated failure; the memory tests
    # bound what they use themselves (and read MemAvailable), so it is off here.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()


#: How long a new actor may take to start, and to take its first zmqsync call (a process
#: that imports torch, then zmqsync and tensordict): 1.5 s each on an idle 2-core
#: machine, 46-57 s each with two busy loops beside it. Set-up, not a promise under test.
ACTOR_START_TIMEOUT = 180.0


def actors_started(actors) -> None:  # type: ignore[no-untyped-def]
    """Wait until every one of ``actors`` is up (its ``__init__`` has run)."""
    import ray

    ray.get([a.__ray_ready__.remote() for a in actors], timeout=ACTOR_START_TIMEOUT)


def kill_actor(actor, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """``ray.kill``, then wait until the actor is really gone (the kill is asynchronous)."""
    import time

    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "the killed actor still answers"
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every sender pump and receiver thread a test starts is stopped by its end (the
    process's copy threads, idle between copies, live as long as the process)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [
        t.name
        for t in threading.enumerate()
        if t.ident not in before
        and t.is_alive()
        and t.name.startswith("zmqsync-")
        and not t.name.startswith("zmqsync-copy")
    ]
    assert not leaked, f"threads left running: {leaked}"
