"""A learner in this process and N worker processes on this host, syncing a demo MLP
(what ``zmqsync demo`` runs).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from zmqsync.closing import ClosesOnExit
from zmqsync.errors import SyncTimeout
from zmqsync.vocabulary import Mode

if TYPE_CHECKING:
    import torch

    from zmqsync.schemes import ZMQWeightSyncScheme

__all__ = ["DEMO_TRANSPORTS", "DemoTransport", "LocalFleet", "demo_model"]

#: Where the demo's learner listens: an ipc path in a private directory, or tcp on
#: 127.0.0.1.
DemoTransport = Literal["ipc", "tcp"]
DEMO_TRANSPORTS: Final[tuple[DemoTransport, ...]] = get_args(DemoTransport)
#: Seconds between looks at which workers have connected, while :meth:`LocalFleet.start`
#: waits for them.
CONNECT_POLL: Final = 0.05
#: Seconds between a demo worker's looks at whether it was told to stop.
STOP_POLL: Final = 0.2
#: Widths of the demo MLP's input and output layers (its middle layer is sized to
#: reach the requested megabytes).
DEMO_IN: Final = 64
DEMO_OUT: Final = 16


def demo_model(size_mb: float = 1.0, *, seed: int = 0) -> torch.nn.Module:
    """A three-layer float32 MLP of about ``size_mb`` megabytes (MiB) of weights."""
    import torch

    if size_mb <= 0:
        raise ValueError(f"size_mb must be positive; got {size_mb}")
    params = size_mb * 1024 * 1024 / 4  # float32
    # params = h*h + (IN + OUT + 1)*h + OUT: solve for the hidden width h (OUT is small).
    linear = DEMO_IN + DEMO_OUT + 1
    hidden = max(1, int((-linear + (linear * linear + 4 * params) ** 0.5) / 2))
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(DEMO_IN, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, DEMO_OUT),
    )


def _demo_worker(
    scheme: ZMQWeightSyncScheme, worker_idx: int, size_mb: float, stop: Any, timeout: float
) -> None:
    """A demo worker process: holds a demo model and applies versions until told to stop."""
    import torch

    torch.set_num_threads(1)  # N workers on a laptop: one core each is plenty
    parent = multiprocessing.process.parent_process()
    try:
        scheme.init_on_receiver(
            model_id="policy", model=demo_model(size_mb, seed=1 + worker_idx), worker_idx=worker_idx
        )
        scheme.connect(timeout=timeout)
        scheme.start_receiver_thread()
        # Stop when told to, or when the learner is gone (killed without cleaning up).
        while not stop.wait(STOP_POLL):
            if parent is not None and not parent.is_alive():
                break
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group; the learner cleans up
    finally:
        scheme.shutdown()


class LocalFleet(ClosesOnExit):
    """A learner in this process and ``num_workers`` worker processes on this host.

    What ``zmqsync demo`` runs. The learner binds when the fleet is made; close it (or
    use ``with``) to stop the workers and unbind. Workers are ``spawn``\\ ed processes
    that receive the scheme (it pickles with its endpoint) and apply every version to
    their own MLP.

    Example::

        with LocalFleet(num_workers=4, size_mb=1) as fleet:
            fleet.start()
            for _ in range(3):
                seconds = fleet.step()       # one "training step", then a synced send
            print(fleet.status())
    """

    def __init__(
        self,
        num_workers: int = 4,
        *,
        size_mb: float = 1.0,
        mode: Mode = "pubsub",
        transport: DemoTransport = "ipc",
        timeout: float = 60.0,
    ) -> None:
        from zmqsync.schemes import ZMQWeightSyncScheme

        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1; got {num_workers}")
        if transport not in DEMO_TRANSPORTS:
            raise ValueError(f"transport must be 'ipc' or 'tcp'; got {transport!r}")
        self.num_workers = num_workers
        self.size_mb = size_mb
        self.timeout = timeout
        self.model = demo_model(size_mb)
        endpoint = "tcp://127.0.0.1:*" if transport == "tcp" else None
        self.scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode=mode,
            endpoint=endpoint,
            timeout=timeout,
        )
        self.nbytes = sum(p.numel() * p.element_size() for p in self.model.state_dict().values())
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = self._ctx.Event()
        self._procs: list[Any] = []
        # Bind now, so status() works (and shows every worker missing) before start().
        self.scheme.init_on_sender("policy", model=self.model, num_workers=num_workers)

    @property
    def endpoint(self) -> str:
        """Where the learner listens (``zmqsync status`` can ask it)."""
        return str(self.scheme.endpoint)

    def start(self, on_progress: Callable[[], None] | None = None) -> None:
        """Start the worker processes and wait until every one has connected.

        ``on_progress()`` is called while waiting (to refresh a display). Raises
        :class:`SyncTimeout` if the workers do not connect within the timeout, and
        ``RuntimeError`` if a worker process dies first.
        """
        for i in range(self.num_workers):
            proc = self._ctx.Process(
                target=_demo_worker,
                name=f"zmqsync-demo-worker-{i}",
                args=(self.scheme, i, self.size_mb, self._stop, self.timeout),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        deadline = time.monotonic() + self.timeout
        while True:
            connected = self.scheme.get_sender().connected_workers()
            if len(connected) >= self.num_workers:
                return
            for i, proc in enumerate(self._procs):
                if proc.exitcode is not None:
                    raise RuntimeError(
                        f"demo worker {i} exited with code {proc.exitcode} before connecting"
                    )
            if time.monotonic() >= deadline:
                missing = set(range(self.num_workers)) - connected
                raise SyncTimeout(
                    f"demo workers {sorted(missing)} did not connect within {self.timeout:g}s; "
                    "the machine may be overloaded: try --timeout with more seconds",
                    missing_workers=missing,
                )
            if on_progress is not None:
                on_progress()
            time.sleep(CONNECT_POLL)

    def step(self) -> float:
        """Change the weights (a stand-in for a training step), send them to every
        worker, and return the seconds the synced send took."""
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.99).add_(0.01)
        started = time.perf_counter()
        self.scheme.send()
        return time.perf_counter() - started

    def status(self) -> dict[str, Any]:
        """The learner's sync state (see :meth:`zmqsync.WeightSender.status`)."""
        return self.scheme.status()

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker process (terminate, then kill, the stubborn) and unbind.

        Idempotent; returns within about ``2 * timeout`` seconds whatever the workers do.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout / 2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout / 2)
        self._procs.clear()
        self.scheme.shutdown()
