"""Process entry points for the sharded-learner tests (importable under spawn): a rank
of an FSDP2 learner over gloo, and a worker with a plain module."""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any

import torch
from torch import nn

import zmqsync


class Net(nn.Module):
    """Uneven shards (``a``'s 5 rows, ``b``'s 3 over 2 or 4 ranks), a tensor sharded
    on dim 1 (``wide``), a replicated one (``shared``) and a buffer (``steps``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.wide = nn.Parameter(torch.randn(3, 7))
        self.shared = nn.Parameter(torch.randn(4))
        self.register_buffer("steps", torch.zeros(3))


def _sharded_net(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same global values on every rank
    net = Net()
    fully_shard(net.a, mesh=mesh)
    fully_shard(net.b, mesh=mesh)
    net.wide = nn.Parameter(distribute_tensor(net.wide.detach(), mesh, [Shard(1)]))
    net.shared = nn.Parameter(distribute_tensor(net.shared.detach(), mesh, [Replicate()]))
    return net


def _bump(net: nn.Module, rank: int, version: int) -> None:
    """A new version, each rank changing its own shards in place (replicas alike)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, t in net.state_dict(keep_vars=True).items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if name == "shared" or name == "steps":
                local.add_(version)  # replicas stay equal on every rank
            else:
                g = torch.Generator().manual_seed(version * 1000 + rank)
                local.add_(torch.randn(local.shape, generator=g))


def _gathered_checksum(net: nn.Module) -> str:
    """The whole model's checksum, gathered here by the test (a collective call)."""
    from torch.distributed.tensor import DTensor

    full = {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        for name, t in net.state_dict(keep_vars=True).items()
    }
    return zmqsync.checksum(full, "state_dict")


def run_rank(
    rank: int,
    world: int,
    port: int,
    endpoint: str,
    conn: Any,
    mode: str,
    sender: bool = True,
    connect_timeout: float = 120.0,
    timeout: float = 30.0,
) -> None:
    """Rank ``rank`` of an FSDP2 learner of ``world`` ranks, a sender of its own part
    (unless not ``sender``: it then only waits to be stopped). Commands: ``"connect"``,
    ``"send"`` (a new version), ``"stop"``; each answered with the gathered model's
    checksum. For the fault tests, a version in two steps: ``"bump"`` (a collective:
    the new version's weights, answered with its gathered checksum) and ``"push"`` (its
    send, no collective: answered ``("push", version, "")``, or ``("timeout", version,
    missing workers, missing ranks, message, seconds waited)``)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    scheme = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        net = _sharded_net(world)
        if not sender:
            conn.send(("ready", 0))
            conn.recv()
            return
        scheme = zmqsync.ZMQWeightSyncScheme(
            "state_dict",
            mode=mode,
            endpoint=endpoint,
            timeout=timeout,
            connect_timeout=connect_timeout,
        )
        scheme.init_on_sender("policy", model=net, num_workers=3)
        conn.send(("ready", scheme.get_sender().epoch))
        version = 0
        while True:
            command = conn.recv()
            if command == "stop":
                break
            if command == "connect":
                scheme.connect(timeout=60)
            elif command == "bump":
                version += 1
                _bump(net, rank, version)
            elif command == "push":
                started = time.monotonic()
                try:
                    scheme.send()
                except zmqsync.SyncTimeout as exc:
                    waited = time.monotonic() - started
                    reply = (exc.missing_workers, exc.missing_ranks, str(exc), waited)
                    conn.send(("timeout", version, *reply))
                else:
                    conn.send(("push", version, ""))
                continue
            elif command == "send":
                version += 1
                _bump(net, rank, version)
                scheme.send()
            conn.send((command, version, _gathered_checksum(net)))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if scheme is not None:
            scheme.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_plain_worker(
    endpoint: str, worker_idx: int, conn: Any, mode: str, apply_mode: str = "auto"
) -> None:
    """A worker with a plain, unsharded module, given rank 0's endpoint alone. Answers
    ``"state"`` with ``(version, checksum)``."""
    scheme = None
    try:
        torch.manual_seed(1000 + worker_idx)  # not the learner's values
        model = Net()
        scheme = zmqsync.ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=endpoint)
        scheme.init_on_receiver(
            model_id="policy", model=model, worker_idx=worker_idx, apply_mode=apply_mode
        )
        scheme.connect(timeout=60)
        scheme.start_receiver_thread()
        conn.send("ready")
        while True:
            command = conn.recv()
            if command == "stop":
                break
            receiver = scheme.get_receiver()
            with scheme.lock:
                conn.send((receiver.version, zmqsync.checksum(model, "state_dict")))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if scheme is not None:
            scheme.shutdown()
