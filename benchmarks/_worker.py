"""A benchmark worker process: holds sessions (zmqsync receivers, baseline receivers).

Driven over its control pipe by :class:`benchmarks._harness.WorkerPool`. Each session
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
import os
import signal
import traceback
from typing import Any

import torch

from benchmarks._baseline import BaselineWorker
from benchmarks._harness import SIZES, digest, make_state_dict

#: How often an idle worker looks whether its parent is still there.
PARENT_CHECK_SECONDS = 1.0


class _Sessions:
    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.zmqsync: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.baseline: dict[str, BaselineWorker] = {}

    def open_zmqsync(self, name: str, scheme: Any, size: str, idx: int, timeout: float) -> str:
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self.zmqsync[name] = (scheme, state_dict)
        scheme.init_on_receiver(model_id="policy", model=state_dict, worker_idx=idx)
        scheme.connect(timeout=timeout)
        scheme.start_receiver_thread()
        return name

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
        scheme, state_dict = self.zmqsync[name]
        receiver = scheme.get_receiver()
        with scheme.lock:
            return {
                "digest": digest(state_dict),
                "version": receiver.version,
                "stats": dict(receiver.stats),
            }

    def close(self) -> int:
        closed = len(self.zmqsync) + len(self.baseline)
        for scheme, _ in self.zmqsync.values():
            with contextlib.suppress(Exception):
                scheme.shutdown()
        for b in self.baseline.values():
            with contextlib.suppress(Exception):
                b.close()
        self.zmqsync.clear()
        self.baseline.clear()
        return closed


def worker_main(worker: int, conn: Any, parent_pid: int, torch_threads: int | None) -> None:
    """Entry point of a spawned worker; returns (and the process ends) on "exit", when
    the control pipe breaks, or when the parent is gone."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    # Ctrl-C goes to the whole process group: the parent cleans up, workers just follow.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sessions = _Sessions(worker)
    try:
        while True:
            if not conn.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != parent_pid:
                    return
                continue
            try:
                command, args = conn.recv()
            except EOFError:
                return
            if command == "exit":
                return
            try:
                if command == "start":
                    reply: Any = "ready"
                elif command == "open_zmqsync":
                    reply = sessions.open_zmqsync(*args)
                elif command == "open_baseline":
                    reply = sessions.open_baseline(*args)
                elif command == "digest":
                    reply = sessions.digest(*args)
                elif command == "close":
                    reply = sessions.close()
                else:
                    raise ValueError(f"unknown command {command!r}")
            except Exception:  # the parent reports it, with this traceback
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", reply))
    except (EOFError, BrokenPipeError, OSError):
        return
    finally:
        sessions.close()
