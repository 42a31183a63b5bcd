"""A worker process of the sync-latency benchmark: holds sessions (zmqsync receivers,
baseline receivers).

Driven over its control pipe by :class:`benchmarks._pool.WorkerPool`. Each session
has its own preallocated state_dict, received into in place by a background thread
(``scheme.start_receiver_thread()`` for zmqsync, :class:`BaselineWorker` for the
baseline). Commands::

    ("start", ())                                   -> "ready"
    ("open_zmqsync", (name, scheme, size, idx, timeout))   -> name, once connected
    ("open_baseline", (name, mode, data_ep, ack_ep, size, idx)) -> name
    ("digest", (name,))                             -> digest of the session's tensors
    ("close", ())                                   -> how many sessions it closed
    ("exit", ())
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks._baseline import BaselineWorker
from benchmarks._models import SIZES, digest, make_state_dict
from benchmarks._sessions import ZmqsyncSessions


class Sessions:
    """A worker's sessions, by name (served by :func:`benchmarks._pool.worker_main`)."""

    def __init__(self) -> None:
        self.zmqsync = ZmqsyncSessions()
        self.baseline: dict[str, BaselineWorker] = {}

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {
            "open_zmqsync": self.open_zmqsync,
            "open_baseline": self.open_baseline,
            "digest": self.digest,
            "close": self.close,
        }

    def open_zmqsync(self, name: str, scheme: Any, size: str, idx: int, timeout: float) -> str:
        return self.zmqsync.open(
            name,
            scheme,
            size,
            lambda state_dict: scheme.init_on_receiver(
                model_id="policy", model=state_dict, worker_idx=idx
            ),
            timeout,
        )

    def open_baseline(
        self, name: str, mode: str, data_ep: str, ack_ep: str, size: str, idx: int
    ) -> str:
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self.baseline[name] = BaselineWorker(idx, mode, data_ep, ack_ep, state_dict)
        return name

    def digest(self, name: str) -> dict[str, Any]:
        if name in self.baseline:
            b = self.baseline[name]
            if b.error:
                raise RuntimeError(f"baseline receiver failed:\n{b.error}")
            with b.lock:
                return {"digest": digest(b.state_dict), "version": b.version}
        return self.zmqsync.digest(name)

    def close(self) -> int:
        closed = self.zmqsync.close() + len(self.baseline)
        for b in self.baseline.values():
            with contextlib.suppress(Exception):
                b.close()
        self.baseline.clear()
        return closed
