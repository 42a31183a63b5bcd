"""Worker processes for the lent tensors tests (importable under spawn)."""

from __future__ import annotations

import os
import re
import traceback
from typing import Any

import torch

import zmqsync

#: The name a worker's lent memory carries in /proc/PID/maps.
LENT = "/memfd:zmqsync-lent"


#: A hub's shared-memory block as /proc/PID/maps names it (lent memory is named
#: otherwise; block 0 is the page that ZeroMQ and Ray hubs probe their peers with).
_HUB_BLOCK = re.compile(r"/memfd:zmqsync-[1-9]\d* ")


def hub_blocks(pid: int) -> tuple[int, int]:
    """How many of the hub's blocks process ``pid`` maps, and how many KiB of them are
    resident there."""
    mapped = resident = 0
    with open(f"/proc/{pid}/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line
                inside = _HUB_BLOCK.search(line + " ") is not None
                mapped += inside
            elif inside and head == "Rss:":
                resident += int(line.split()[1])
    return mapped, resident


def in_lent_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s first byte lies in memory this process lends, writable."""
    address = tensor.data_ptr()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return "w" in fields[1] and len(fields) == 6 and fields[5].startswith(LENT)
    return False


def run_lending_worker(
    conn: Any,
    control: Any,
    worker_idx: int,
    lend: bool | None,
    chunk_timeout: float = 5.0,
    kind: str = "wide",
) -> None:
    """A worker (over its pipe ``conn``, or ZeroMQ: ``conn`` is ``(mode, endpoint)``)
    with a ``make_model(kind)`` that lends its tensors (``lend``: the receiver's
    ``lend_tensors``; None, its default) and applies versions in the
    background; says, for each question on ``control``, every version it applied with
    the checksum of what the model held then, and its counts. Told ``"move"``, it gives
    its first weight new storage (``p.data = ...``), as user code may."""
    from _workers import make_model

    from zmqsync import WeightReceiver
    from zmqsync.transport.pipe import PipeSpoke
    from zmqsync.transport.zmq_pubsub import PubSubSpoke
    from zmqsync.transport.zmq_router import RouterSpoke

    try:
        model = make_model(kind, seed=1000 + worker_idx)
        params = list(model.parameters())
        if isinstance(conn, tuple):  # (mode, endpoint): ZeroMQ
            mode, endpoint = conn
            spoke: Any = (PubSubSpoke if mode == "pubsub" else RouterSpoke)(endpoint)
        else:
            spoke = PipeSpoke(conn)
        receiver = WeightReceiver(
            spoke,
            model=model,
            strategy="state_dict",
            worker_idx=worker_idx,
            lend_tensors=lend,
            timeout=30,
            chunk_timeout=chunk_timeout,
        )
        applied: list[tuple[int, str, Any]] = []
        receiver.on_applied.append(
            lambda epoch, version: applied.append(
                (version, zmqsync.checksum(model, "state_dict"), receiver.metadata)
            )
        )
        receiver.connect(timeout=30)
        receiver.start()
        while True:
            if not control.poll(60):
                return
            question = control.recv()
            if question == "stop":
                break
            if question == "move":
                with receiver.lock:
                    first = params[0]
                    first.data = first.data.clone()
                continue
            same = all(a is b for a, b in zip(params, model.parameters(), strict=True))
            stats = {k: v for k, v in receiver.stats.items() if isinstance(v, int | float)}
            control.send(("ok", list(applied), stats, same))
        receiver.close()
        control.send(("closed", None, None, None))
    except Exception:
        control.send(("error", traceback.format_exc(), None, None))
