"""Process entry points for the sharded-learner tests (importable under spawn): a rank
of an FSDP2 learner over gloo, and a worker with a plain module."""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
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


def _sharded_net(world: int, net_cls: type[nn.Module] | None = None) -> nn.Module:
    """A :class:`Net` (or ``net_cls``: :class:`WideNet`) of FSDP2 ``fully_shard``-ed
    Linear layers, ``wide`` sharded on dim 1 and ``shared`` replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same global values on every rank
    net = (net_cls or Net)()
    for layer in net.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
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


def gathered_checksum(net: nn.Module) -> str:
    """The whole model's checksum, gathered here by the test (a collective call)."""
    return _cast_checksum(net, None)


# --- what every process of these tests does: report, close, answer --------------------


@contextlib.contextmanager
def reported(conn: Any) -> Iterator[contextlib.ExitStack]:
    """The block's failure goes to the test over ``conn`` (its traceback, which the test
    raises); what the block put on the stack (a scheme, a process group) is closed after
    the failure is told, whatever happens."""
    with contextlib.ExitStack() as opened:
        try:
            yield opened
        except BaseException:
            with contextlib.suppress(Exception):
                conn.send(("error", traceback.format_exc()))


def open_scheme(opened: contextlib.ExitStack, **options: Any) -> zmqsync.ZMQWeightSyncScheme:
    """A ``state_dict`` scheme of ``options``, shut down when ``opened`` closes."""
    scheme = zmqsync.ZMQWeightSyncScheme("state_dict", **options)
    opened.callback(scheme.shutdown)
    return scheme


def join_group(opened: contextlib.ExitStack, rank: int, world: int, **options: Any) -> None:
    """Rank ``rank`` of a gloo process group (its rendezvous in the environment), left
    when ``opened`` closes, after what was opened later (a scheme) is shut down."""
    import torch.distributed as dist

    opened.callback(_leave_group)
    dist.init_process_group("gloo", rank=rank, world_size=world, **options)


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def serve(conn: Any, answer: Callable[[Any], Any]) -> None:
    """Every command on ``conn`` answered with ``answer(command)``, until ``"stop"``."""
    while True:
        command = conn.recv()
        if command == "stop":
            return
        conn.send(answer(command))


class _RankCommands:
    """A learner rank's answers to the test's commands: its model, its scheme and the
    version it is at (see :func:`run_rank`)."""

    def __init__(self, net: nn.Module, scheme: zmqsync.ZMQWeightSyncScheme, rank: int) -> None:
        self.net, self.scheme, self.rank = net, scheme, rank
        self.version = 0

    def __call__(self, command: str) -> tuple[Any, ...]:
        if command == "push":
            return self._push()
        if command == "status":
            return ("status", self.scheme.get_sender().status())
        if command == "connect":
            self.scheme.connect(timeout=60)
        elif command in ("bump", "send"):
            self.version += 1
            _bump(self.net, self.rank, self.version)
            if command == "send":
                self.scheme.send()
        return (command, self.version, gathered_checksum(self.net))

    def _push(self) -> tuple[Any, ...]:
        """The send of the version bumped to, alone (no collective)."""
        started = time.monotonic()
        try:
            self.scheme.send()
        except zmqsync.SyncTimeout as exc:
            waited = time.monotonic() - started
            reply = (exc.missing_workers, exc.missing_ranks, str(exc), waited)
            return ("timeout", self.version, *reply)
        return ("push", self.version, "")


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
    num_workers: int = 3,
) -> None:
    """Rank ``rank`` of an FSDP2 learner of ``world`` ranks, a sender of its own part
    (unless not ``sender``: it then only waits to be stopped). Commands: ``"connect"``,
    ``"send"`` (a new version), ``"stop"``; each answered with the gathered model's
    checksum. For the fault tests, a version in two steps: ``"bump"`` (a collective:
    the new version's weights, answered with its gathered checksum) and ``"push"`` (its
    send, no collective: answered ``("push", version, "")``, or ``("timeout", version,
    missing workers, missing ranks, message, seconds waited)``). ``num_workers``: the
    workers its ``connect()`` waits for (a relay is one)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with reported(conn) as opened:
        join_group(opened, rank, world)
        net = _sharded_net(world)
        if not sender:
            conn.send(("ready", 0))
            conn.recv()
            return
        scheme = open_scheme(
            opened, mode=mode, endpoint=endpoint, timeout=timeout, connect_timeout=connect_timeout
        )
        scheme.init_on_sender("policy", model=net, num_workers=num_workers)
        conn.send(("ready", scheme.get_sender().epoch))
        serve(conn, _RankCommands(net, scheme, rank))


def run_plain_worker(
    endpoint: str,
    worker_idx: int,
    conn: Any,
    mode: str,
    apply_mode: str = "auto",
    wide: bool = False,
) -> None:
    """A worker with a plain, unsharded module (a :class:`WideNet` if ``wide``), given
    rank 0's endpoint alone. Answers ``"state"`` with ``(version, checksum)``, and with
    ``wide`` the deltas applied and the wire dtype too."""
    with reported(conn) as opened:
        torch.manual_seed(1000 + worker_idx)  # not the learner's values
        model = WideNet() if wide else Net()
        scheme = open_scheme(opened, mode=mode, endpoint=endpoint)
        scheme.init_on_receiver(
            model_id="policy", model=model, worker_idx=worker_idx, apply_mode=apply_mode
        )
        scheme.connect(timeout=60)
        scheme.start_receiver_thread()
        conn.send("ready")
        receiver = scheme.get_receiver()

        def state(_: Any) -> tuple[Any, ...]:
            with scheme.lock:
                held = (receiver.version, zmqsync.checksum(model, "state_dict"))
            more = (receiver.stats["deltas"], receiver.wire_dtype) if wide else ()
            return (*held, *more)

        serve(conn, state)


def run_host_rank(
    ns: str,
    master: str,
    rank: int,
    world: int,
    port: int,
    options: dict[str, Any],
    conn: Any,
) -> None:
    """Rank ``rank`` of an FSDP2 learner on a host of its own (network namespace
    ``ns``): gloo's rendezvous at ``master:port`` (rank 0's host) and its collectives go
    over the hosts' own links, and the rank binds ``options["endpoint"]`` on its host,
    with ``options``' CURVE keys. Answers ``("ready", epoch)``; commands ``"connect"``
    and ``"send"`` (a new version) are answered with the gathered model's checksum,
    ``"status"`` with the rank's own ``status()``."""
    import datetime

    from netns import enter_netns

    with reported(conn) as opened:
        enter_netns(ns)  # before any socket: gloo's too
        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0")
        join_group(opened, rank, world, timeout=datetime.timedelta(seconds=120))
        net = _sharded_net(world)
        scheme = open_scheme(opened, **options)
        scheme.init_on_sender("policy", model=net, num_workers=2)
        conn.send(("ready", scheme.get_sender().epoch))
        serve(conn, _RankCommands(net, scheme, rank))


def run_host_worker(
    ns: str, endpoint: str, worker_idx: int, options: dict[str, Any], conn: Any
) -> None:
    """A worker with a plain module on a host of its own, given rank 0's endpoint alone
    and ``options``' CURVE keys (and ``connect_timeout``). Answers ``("ready",
    checksum)`` once connected, or ``("refused", message, checksum)`` if it could not
    (keys the ranks do not accept); then ``"state"`` with ``(version, checksum,
    received bytes)``."""
    from netns import enter_netns

    with reported(conn) as opened:
        enter_netns(ns)
        torch.manual_seed(1000 + worker_idx)  # not the learner's values
        model = Net()
        scheme = open_scheme(opened, endpoint=endpoint, **options)
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker_idx)
        receiver = scheme.get_receiver()
        try:
            scheme.connect()  # within options' connect_timeout
        except zmqsync.ZMQSyncError as exc:
            conn.send(("refused", str(exc), zmqsync.checksum(model, "state_dict")))
        else:
            scheme.start_receiver_thread()
            conn.send(("ready", zmqsync.checksum(model, "state_dict")))

        def state(_: Any) -> tuple[Any, ...]:
            with scheme.lock:
                got = int(receiver.stats.get("received_bytes", 0))
                return (receiver.version, zmqsync.checksum(model, "state_dict"), got)

        serve(conn, state)


#: What tensor-parallel worker ``half`` of 2 holds of :class:`Net`'s tensors: the rows
#: of ``a`` (uneven: 3 and 2), the columns of ``b.weight`` (3 and 2) and of ``wide`` (4
#: and 3); the rest whole. ``(dim, where half 1 begins)`` per sliced tensor.
SLICED: dict[str, tuple[int, int]] = {
    "a.weight": (0, 3),
    "a.bias": (0, 3),
    "b.weight": (1, 3),
    "wide": (1, 4),
}


def sliced_half(full: dict[str, torch.Tensor], name: str, half: int) -> torch.Tensor:
    """Worker ``half``'s slice of the whole tensor ``full[name]``."""
    t = full[name]
    if name not in SLICED:
        return t
    dim, cut = SLICED[name]
    return t.narrow(dim, 0, cut) if half == 0 else t.narrow(dim, cut, t.shape[dim] - cut)


def _slice_box(name: str, shape: tuple[int, ...], half: int) -> Any:
    """The box worker ``half``'s tensor ``name`` (of ``shape``) is of Net's tensor."""
    if name not in SLICED:
        return None
    whole = tuple(Net().state_dict()[name].shape)
    dim, cut = SLICED[name]
    offsets = [0] * len(whole)
    offsets[dim] = 0 if half == 0 else cut
    return zmqsync.protocol.Box(whole, tuple(offsets))


def run_sliced_worker(endpoint: str, half: int, conn: Any, mode: str) -> None:
    """Tensor-parallel worker ``half`` of 2 (worker id ``half``): a model of its slices
    of :class:`Net`'s tensors alone, given rank 0's endpoint. Answers ``"state"`` with
    ``(version, {name: array})``."""
    with reported(conn) as opened:
        full = Net().state_dict()
        model = {name: torch.zeros_like(sliced_half(full, name, half)) for name in full}
        scheme = open_scheme(opened, mode=mode, endpoint=endpoint)
        scheme.init_on_receiver(
            model_id="policy",
            model=model,
            worker_idx=half,
            slices=lambda name, shape: _slice_box(name, shape, half),
        )
        scheme.connect(timeout=120)
        scheme.start_receiver_thread()
        conn.send("ready")
        receiver = scheme.get_receiver()

        def state(_: Any) -> tuple[Any, ...]:
            with scheme.lock:
                return (receiver.version, {name: t.numpy().copy() for name, t in model.items()})

        serve(conn, state)


def run_dtensor_worker(
    rank: int, world: int, port: int, endpoint: str, conn: Any, mode: str
) -> None:
    """Rank ``rank`` of a tensor-parallel worker of ``world`` ranks over gloo of its own
    (worker id ``rank``): :class:`Net`'s tensors as DTensors, ``a`` sharded on rows
    (uneven), ``b.weight`` and ``wide`` on columns, ``b.bias`` and ``shared`` replicated,
    ``steps`` plain; it declares its local boxes and receives into its local shards.
    Answers ``"state"`` (a collective) with ``(version, checksum of the gathered model)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from zmqsync.tensors.slices import dtensor_slices

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    placements = {"a.weight": Shard(0), "a.bias": Shard(0), "b.weight": Shard(1)}
    placements.update({"wide": Shard(1), "b.bias": Replicate(), "shared": Replicate()})
    with reported(conn) as opened:
        join_group(opened, rank, world)
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(2000)  # not the learner's values; the same on every rank
        tensors: dict[str, torch.Tensor] = {
            name: distribute_tensor(t.detach(), mesh, [placements[name]])
            if name in placements
            else t.detach().clone()
            for name, t in Net().state_dict().items()
        }
        local, boxes = dtensor_slices(tensors)
        scheme = open_scheme(opened, mode=mode, endpoint=endpoint)
        scheme.init_on_receiver(model_id="policy", model=local, worker_idx=rank, slices=boxes)
        scheme.connect(timeout=120)
        scheme.start_receiver_thread()
        conn.send("ready")
        receiver = scheme.get_receiver()

        def state(_: Any) -> tuple[Any, ...]:
            with scheme.lock:
                version = receiver.version
                full = {
                    name: t.full_tensor() if isinstance(t, DTensor) else t
                    for name, t in tensors.items()
                }
            return (version, zmqsync.checksum(full, "state_dict"))

        serve(conn, state)


# --- delta=True and wire_dtype= on a sharded learner ------------------------------------


class WideNet(nn.Module):
    """Large enough for deltas of 64 KiB blocks: ``a`` (257 rows of 4 KiB, uneven FSDP2
    shards), ``wide`` sharded on dim 1 (4099 columns: uneven too), a replicated
    ``shared`` and a buffer ``steps``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1024, 257)
        self.wide = nn.Parameter(torch.randn(16, 4099))
        self.shared = nn.Parameter(torch.randn(64))
        self.register_buffer("steps", torch.zeros(3))


def _cast_checksum(net: nn.Module, wire: torch.dtype | None) -> str:
    """The whole model's checksum as workers hold it: gathered here (a collective call),
    each float cast to ``wire`` and back, as the plain path defines it."""
    from torch.distributed.tensor import DTensor

    full = {}
    for name, t in net.state_dict(keep_vars=True).items():
        whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if wire is not None and whole.is_floating_point():
            whole = whole.to(wire).to(whole.dtype)
        full[name] = whole
    return zmqsync.checksum(full, "state_dict")


def _touch(net: nn.Module, rank: int, version: int, who: int) -> None:
    """Version ``version``: every value changes (``who`` < 0), or only one row of rank
    ``who``'s shard of ``a.weight`` (the others change nothing)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if who >= 0:
            if rank == who:
                net.a.weight.to_local()[5].add_(float(version))
            return
        for t in net.state_dict(keep_vars=True).values():
            (t.to_local() if isinstance(t, DTensor) else t).add_(float(version))


def run_delta_rank(
    rank: int, world: int, port: int, endpoint: str, conn: Any, mode: str, wire: str
) -> None:
    """Rank ``rank`` of an FSDP2 learner with ``delta=True`` and ``wire_dtype=wire``.
    Commands: ``"connect"``; ``("send", who)`` (a version, see :func:`_touch`);
    ``"stop"``. Each answered with ``(command, version, cast checksum, bytes sent)``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dtype = getattr(torch, wire)
    with reported(conn) as opened:
        join_group(opened, rank, world)
        net = _sharded_net(world, WideNet)
        scheme = open_scheme(opened, mode=mode, endpoint=endpoint, timeout=30, connect_timeout=120)
        scheme.init_on_sender(
            "policy", model=net, num_workers=2, delta=True, wire_dtype=dtype, chunk_bytes=65536
        )
        conn.send(("ready", scheme.get_sender().epoch))
        version = 0

        def answer(command: Any) -> tuple[Any, ...]:
            nonlocal version
            if command == "connect":
                scheme.connect(timeout=60)
            else:
                version += 1
                _touch(net, rank, version, command[1])
                scheme.send()
            sent = scheme.get_sender().status()["totals"]["bytes_sent"]
            return ("done", version, _cast_checksum(net, dtype), sent)

        serve(conn, answer)


def run_wide_worker(endpoint: str, worker_idx: int, conn: Any, mode: str, apply_mode: str) -> None:
    """A worker with a plain :class:`WideNet`, given rank 0's endpoint alone. Answers
    ``"state"`` with ``(version, checksum, deltas applied, wire dtype)``."""
    run_plain_worker(endpoint, worker_idx, conn, mode, apply_mode, wide=True)
