"""Process entry points for the sharded-learner memory tests (importable under spawn): a
rank of an FSDP2 learner that samples its own memory, and a worker with a plain module."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from _sharded import gathered_checksum, join_group, open_scheme, reported, serve
from torch import nn

import zmqsync

#: The memory test's model: ``Linear(MEMORY_IN, MEMORY_OUT)`` layers of 16 MiB each
#: (1023 rows: uneven shards over 2 ranks).
MEMORY_IN = 4096
MEMORY_OUT = 1023
#: How often the memory sampler reads the heap (seconds).
MEMORY_SAMPLE_SECONDS = 0.002


def memory_model(layers: int) -> nn.Module:
    """The same seeded model on every rank and worker."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(MEMORY_IN, MEMORY_OUT) for _ in range(layers)])


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, looked up once (finding libc runs ``ldconfig``)."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )]  # fmt: skip

    function = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    function.restype = MallInfo2
    return function


def _memory_now() -> dict[str, int]:
    """Bytes held from malloc (glibc's ``mallinfo2``: torch's and libzmq's buffers, a
    copy counted even where it reuses freed memory) and anonymous resident bytes."""
    info = _mallinfo2()()
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page = os.sysconf("SC_PAGE_SIZE")
    shmem = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                shmem = int(line.split()[1]) * 1024
    return {
        "heap": int(info.uordblks + info.hblkhd),
        "rss": (int(fields[1]) - int(fields[2])) * page,
        "shmem": shmem,
    }


class PeakMemory:
    """The most each of :func:`_memory_now`'s measures rose over a ``with`` block, sampled
    on a thread of its own (a chunk copy lives for milliseconds)."""

    def __init__(self) -> None:
        import threading

        self.base = _memory_now()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_SECONDS):
            for name, value in _memory_now().items():
                self.peak[name] = max(self.peak[name], value)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for name, value in _memory_now().items():
            self.peak[name] = max(self.peak[name], value)

    @property
    def extra(self) -> dict[str, int]:
        return {name: self.peak[name] - self.base[name] for name in self.base}


def run_memory_rank(
    rank: int,
    world: int,
    port: int,
    endpoint: str,
    conn: Any,
    layers: int,
    retain: bool,
    chunk_bytes: int,
    versions: int,
) -> None:
    """Rank ``rank`` of an FSDP2 learner of ``layers`` layers: its peak extra memory from
    just before ``init_on_sender`` through ``connect()`` and ``versions`` sends, with
    ``retain_snapshot=retain``. Says ``("bound", endpoint)`` once bound, then
    ``("done", extra, shard_bytes, model_bytes, checksum)``: ``extra`` per measure."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with reported(conn) as opened:
        join_group(opened, rank, world)
        mesh = init_device_mesh("cpu", (world,))
        net = memory_model(layers)
        for layer in net.children():
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        tensors = net.state_dict()
        model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        shard_bytes = sum(
            t.to_local().numel() * t.element_size() for t in tensors.values()
            if isinstance(t, DTensor)
        )  # fmt: skip
        del tensors
        gc.collect()
        with PeakMemory() as meter:
            scheme = open_scheme(
                opened, endpoint=endpoint, timeout=60, connect_timeout=120,
                retain_snapshot=retain, chunk_bytes=chunk_bytes,
            )  # fmt: skip
            scheme.init_on_sender("policy", model=net, num_workers=1)
            conn.send(("bound", scheme.endpoint))
            scheme.connect(timeout=120)
            for _ in range(versions):
                _bump_all(net)
                scheme.send()
        conn.send(("done", meter.extra, shard_bytes, model_bytes, gathered_checksum(net)))
        conn.recv()  # "stop"


def _bump_all(net: nn.Module) -> None:
    """A new version: every element of this rank's shards + 1.0."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in net.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).add_(1.0)


def run_memory_worker(endpoint: str, layers: int, conn: Any) -> None:
    """A worker with a plain module of the memory test's model, given rank 0's endpoint.
    Answers ``"state"`` with ``(version, checksum)``."""
    with reported(conn) as opened:
        model = memory_model(layers)
        scheme = open_scheme(opened, endpoint=endpoint, timeout=60)
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=0)
        scheme.connect(timeout=120)
        scheme.start_receiver_thread()
        receiver = scheme.get_receiver()

        def state(_: Any) -> tuple[Any, ...]:
            with scheme.lock:
                return (receiver.version, zmqsync.checksum(model, "state_dict"))

        serve(conn, state)
