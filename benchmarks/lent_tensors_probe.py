"""A design probe for issue 35: one copy per worker, written by the learner into memory
the worker lends.

zmqsync's default mode makes K + 1 copies of a version on one host (the learner's into
shared memory, then each worker's out of it) where torchrl's shared-memory scheme makes
K; on two cores the two copies of each chunk share the cores with the learner's spinning
OpenMP threads. This probe measures the other way round, outside the library: each
worker moves its tensors into a sealed ``memfd`` and passes the descriptor to the learner
over its pipe (``SCM_RIGHTS``); for every version the learner asks each worker in turn
to take its lock ("write"), waits for its "go", copies its own tensors straight into the
worker's with ``torch._foreach_copy_`` (on the learner's own, hot, thread pool) and says
"done" (the worker then reads two values back, as a check). Against it, in the same run
and taking turns: ``memcpy``, K serial ``_foreach_copy_`` in the learner, the peers
benchmark's bound (``benchmarks.transports``' memcpy variant).

It is not the product: no versions, leases, faults or timeouts, one process per worker
doing nothing else. It answers one question: is one copy per worker, by the learner, near
memcpy on this machine? Median ms per version, each made by an in-place ``add_`` on the
learner's model first, as the peers benchmark makes its versions.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Final

import torch

from benchmarks._models import SIZES, Layout

PROG: Final = "python -m benchmarks.lent_tensors_probe"
_F_ADD_SEALS: Final = 1033
_F_GET_SEALS: Final = 1034
_F_SEAL_SHRINK: Final = 0x0002
_TIMEOUT_S: Final = 30.0


def _views(buf: mmap.mmap, layout: Layout) -> list[torch.Tensor]:
    """``layout``'s tensors, one after another on ``buf``."""
    flat = torch.frombuffer(buf, dtype=torch.float32)
    numel = layout.tensor_bytes // 4
    return [flat[i * numel : (i + 1) * numel].view(layout.shape) for i in range(layout.count)]


def _worker(conn: Connection, layout: Layout, threads: int) -> None:
    """Lend a sealed memfd holding this worker's tensors; then, per version, "go" and
    wait for "done" (the lock would be held in between), and read two values back."""
    import fcntl

    torch.set_num_threads(threads)
    fd = os.memfd_create("zmqsync-probe", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, layout.nbytes)
    fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_SHRINK)
    buf = mmap.mmap(fd, layout.nbytes)
    tensors = _views(buf, layout)
    for t in tensors:
        t.zero_()
    reduction.send_handle(conn, fd, os.getppid())
    while True:
        if not conn.poll(_TIMEOUT_S):
            raise TimeoutError("the learner went quiet")
        if conn.recv() is None:
            return
        conn.send("go")
        if not conn.poll(_TIMEOUT_S) or conn.recv() != "done":
            raise TimeoutError("no done from the learner")
        conn.send(float(tensors[0].view(-1)[0]) + float(tensors[-1].view(-1)[-1]))


class _Fleet:
    """K workers, each lending its tensors to this process."""

    def __init__(self, layout: Layout, workers: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.ends: list[tuple[Connection, mp.process.BaseProcess, list[torch.Tensor]]] = []
        self._maps: list[mmap.mmap] = []
        import fcntl

        for _ in range(workers):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(there, layout, threads), daemon=True)
            proc.start()
            if not here.poll(_TIMEOUT_S):
                raise TimeoutError("a worker did not lend its tensors")
            fd = reduction.recv_handle(here)
            if not fcntl.fcntl(fd, _F_GET_SEALS) & _F_SEAL_SHRINK:
                raise RuntimeError("a worker's memfd can shrink under the learner")
            if os.fstat(fd).st_size < layout.nbytes:
                raise RuntimeError("a worker's memfd is too small")
            buf = mmap.mmap(fd, layout.nbytes)
            os.close(fd)
            self._maps.append(buf)
            self.ends.append((here, proc, _views(buf, layout)))

    def send(self, model: list[torch.Tensor]) -> None:
        for conn, _, _ in self.ends:
            conn.send(1)
        for conn, _, theirs in self.ends:
            if not conn.poll(_TIMEOUT_S) or conn.recv() != "go":
                raise TimeoutError("a worker did not take its lock")
            torch._foreach_copy_(theirs, model)
            conn.send("done")
        want = float(model[0].view(-1)[0]) + float(model[-1].view(-1)[-1])
        for conn, _, _ in self.ends:
            if not conn.poll(_TIMEOUT_S):
                raise TimeoutError("a worker did not read its version back")
            if abs(conn.recv() - want) > 1e-3:
                raise AssertionError("a worker holds another version")

    def close(self) -> None:
        for conn, proc, _ in self.ends:
            conn.send(None)
            proc.join(_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
        self.ends = []


def measure(layout: Layout, workers: int, repeats: int, threads: int) -> dict[str, float]:
    """Median ms per version of memcpy and of the lent tensors, taking turns."""
    gen = torch.Generator().manual_seed(0)
    model = [torch.randn(layout.shape, generator=gen) for _ in range(layout.count)]
    copies = [[torch.zeros(layout.shape) for _ in model] for _ in range(workers)]
    fleet = _Fleet(layout, workers, threads)
    times: dict[str, list[float]] = {"memcpy": [], "lent": []}
    try:
        for _ in range(repeats):
            for t in model:
                t.add_(1.0)
            t0 = time.perf_counter()
            for c in copies:
                torch._foreach_copy_(c, model)
            times["memcpy"].append(time.perf_counter() - t0)
            for t in model:
                t.add_(1.0)
            t0 = time.perf_counter()
            fleet.send(model)
            times["lent"].append(time.perf_counter() - t0)
    finally:
        fleet.close()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1MB,16MB,128MB,2000x4KB")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    print(f"{os.cpu_count()} cores, torch threads {threads}; median ms per version")
    print("| size | K | memcpy | lent (one copy per worker) | lent / memcpy |")
    print("|---|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        for k in (int(x) for x in args.workers.split(",")):
            got = measure(SIZES[size], k, args.repeats, threads)
            ratio = got["lent"] / got["memcpy"]
            print(f"| {size} | {k} | {got['memcpy']:.2f} | {got['lent']:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
