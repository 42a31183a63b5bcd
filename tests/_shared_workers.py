"""Worker processes for the shared read-only weights tests (importable under spawn)."""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any

import torch
from torch import nn

import zmqsync
from zmqsync import WeightReceiver
from zmqsync.transport.pipe import PipeSpoke
from zmqsync.transport.zmq_pubsub import PubSubSpoke
from zmqsync.transport.zmq_router import RouterSpoke


def shared_model(seed: int) -> nn.Module:
    """About 330 KB of weights (large enough to travel in shared memory) and a buffer."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    model.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
    return model


def _spoke(kind: str, where: Any, idx: int) -> Any:
    if kind == "pipe":
        return PipeSpoke(where)
    cls = PubSubSpoke if kind == "pubsub" else RouterSpoke
    return cls(where, identity=f"w{idx}")


def _state(model: nn.Module, receiver: WeightReceiver, objects: list[int]) -> dict[str, Any]:
    tensors = list(model.parameters()) + list(model.buffers())
    return {
        "version": receiver.version,
        "checksum": zmqsync.checksum(model),
        "stats": dict(receiver.stats),
        "same_objects": [id(t) for t in tensors] == objects,
        "read_only": all(_read_only(t) for t in tensors),
        "transport": receiver.transport.counters(),
        "rejections": list(receiver.rejections),
    }


def _read_only(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s first byte lies in a mapping this process cannot write."""
    address = tensor.data_ptr()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return "w" not in perms
    return False


def run_shared_worker(kind: str, where: Any, idx: int, conn: Any) -> None:
    """A worker whose model maps the learner's versions read-only; answers the test's
    questions over ``conn`` ("state", "hold:<seconds>", "write", "stop")."""
    try:
        model = shared_model(100 + idx)
        tensors = list(model.parameters()) + list(model.buffers())
        objects = [id(t) for t in tensors]
        receiver = WeightReceiver(
            _spoke(kind, where, idx), model=model, worker_idx=idx, apply_mode="shared", timeout=30
        )
        receiver.connect()
        receiver.start()
        conn.send("ready")
        while True:
            if not conn.poll(0.05):
                continue
            command = conn.recv()
            if command == "stop":
                break
            if command == "write":
                conn.send("writing")
                with torch.no_grad():
                    model[0].weight.add_(1.0)  # a fault: the mapping is read-only
                conn.send("wrote")  # never reached
            with receiver.lock:
                if command.startswith("hold:"):
                    # Keep the version held (no new one is re-pointed meanwhile), then
                    # say what its memory holds now: still that version's bytes?
                    before = _state(model, receiver, objects)
                    time.sleep(float(command[5:]))
                    conn.send((before, _state(model, receiver, objects)))
                    continue
                conn.send(_state(model, receiver, objects))
        receiver.close()
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


def run_scheme_worker(scheme: Any, pipe: Any, conn: Any) -> None:
    """A pipe worker joined through ``MultiProcessWeightSyncScheme`` in the shared mode:
    answers ``(version, checksum, versions mapped)`` for each "state"."""
    try:
        model = shared_model(7)
        scheme.init_on_receiver(model_id="policy", pipe=pipe, model=model, apply_mode="shared")
        scheme.connect(timeout=60)
        scheme.start_receiver_thread()
        receiver = scheme.get_receiver()
        conn.send("ready")
        while conn.recv() == "state":
            with scheme.lock:
                stats = receiver.stats
                conn.send((receiver.version, zmqsync.checksum(model), stats["shared_mapped"]))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        scheme.shutdown()
