"""Worker-process entry points for the end-to-end tests (importable under spawn)."""

from __future__ import annotations

import contextlib
import traceback
from typing import Any

import torch
from torch import nn

import zmqsync


def make_model(kind: str = "mlp", seed: int | None = None) -> nn.Module:
    """The test model: an MLP with a BatchNorm (so buffers travel too).

    ``kind`` may name a device after an ``@`` (``"mlp@cuda"``): the model is moved there.
    """
    kind, _, device = kind.partition("@")
    if seed is not None:
        torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    elif kind == "wide":  # 64 KiB weights: large enough for shared memory over ipc
        model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 64))
    elif kind == "big":  # 32 MiB: more than the kernel's socket buffers hold
        model = nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 4))
    else:
        raise ValueError(kind)
    return model.to(device) if device else model


def bump(model: nn.Module) -> None:
    """A new version of the model, in place: every parameter and float buffer changes."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(1.0)


def run_worker(
    scheme: Any,
    worker_idx: int,
    kind: str,
    conn: Any,
    connect_timeout: float,
    init_kwargs: dict[str, Any] | None = None,
) -> None:
    """Join the fleet, apply versions in the background, answer the test's questions.

    ``init_kwargs`` adds to (or overrides) what ``init_on_receiver`` gets: a pipe
    worker's ``pipe=``, or ``worker_idx=None`` for a worker the sender numbers.
    """
    try:
        model = make_model(kind, seed=1000 + worker_idx)  # differs from the sender's
        options = {"model": model, "worker_idx": worker_idx, **(init_kwargs or {})}
        scheme.init_on_receiver(model_id="policy", **options)
        receiver = scheme.get_receiver()
        # Every version applied, with the checksum of what the model then held: called
        # under the receiver's lock, right after the version is in.
        applied: list[tuple[int, int, str]] = []
        receiver.on_applied.append(
            lambda epoch, version: applied.append(
                (epoch, version, zmqsync.checksum(model, scheme.strategy))
            )
        )
        scheme.connect(timeout=connect_timeout)
        scheme.start_receiver_thread()
        conn.send("ready")
        while True:
            if not conn.poll(0.05):
                continue
            command = conn.recv()
            if command == "stop":
                break
            with scheme.lock:
                if command == "checksum":
                    conn.send(zmqsync.checksum(model, scheme.strategy))
                elif command == "applied":
                    conn.send(list(applied))
                elif command == "state":
                    conn.send(
                        {
                            "worker_idx": scheme.worker_idx,
                            "version": receiver.version,
                            "epoch": receiver.epoch,
                            "checksum": zmqsync.checksum(model, scheme.strategy),
                            "stats": dict(receiver.stats),
                            "devices": sorted({str(t.device) for t in model.state_dict().values()}),
                            "transport": receiver.transport.counters(),
                        }
                    )
                else:
                    conn.send(("error", f"unknown command {command!r}"))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        scheme.shutdown()


def run_leaves(endpoints: list[str], ids: list[int], conn: Any, timeout: float) -> None:
    """Many light workers in one process: a receiver per id (each its own thread and
    sockets), worker ``i`` under ``endpoints[i % len(endpoints)]``. Answers ``"state"``
    with ``{id: (version, checksum)}``."""
    from zmqsync.transport.zmq_pubsub import PubSubSpoke

    receivers: dict[int, Any] = {}
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for i in ids:
            models[i] = {"w": torch.zeros(1024), "b": torch.zeros(16)}
            receivers[i] = zmqsync.WeightReceiver(
                PubSubSpoke(endpoints[i % len(endpoints)], identity=f"leaf{i}"),
                model=models[i],
                strategy="state_dict",
                worker_idx=i,
                timeout=timeout,
            )
        for r in receivers.values():
            r.connect(timeout=timeout)
            r.start()
        conn.send("ready")
        while True:
            if not conn.poll(0.05):
                continue
            command = conn.recv()
            if command == "stop":
                break
            state = {}
            for i, r in receivers.items():
                with r.lock:
                    state[i] = (r.version, zmqsync.checksum(models[i], "state_dict"))
            conn.send(state)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        for r in receivers.values():
            with contextlib.suppress(Exception):
                r.close()


def run_and_leave_open(conn: Any, worker_idx: int) -> None:
    """A worker that connects over its pipe and returns with its receiver still open, as
    torchrl's collector workers do: its process then exits on its own."""
    from zmqsync import WeightReceiver
    from zmqsync.transport.pipe import PipeSpoke

    receiver = WeightReceiver(
        PipeSpoke(conn), model=make_model(), strategy="state_dict", worker_idx=worker_idx
    )
    receiver.connect()
    receiver.start()
