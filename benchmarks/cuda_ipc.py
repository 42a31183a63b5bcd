"""A learner's version to K workers on its own GPU: zmqsync's pipes and ZeroMQ ``ipc://``
against hand-written CUDA IPC, in one run (issue 35, item 3).

zmqsync's pipe and ``ipc://`` hubs lend workers on the learner's GPU blocks of device
memory: the
version is written once into one on the device, and each worker copies it from there
device to device (see docs/gpus.md). Code written by hand for such workers does the
least there is: one flat device buffer shared once through CUDA IPC (torch's
``reduce_tensor`` handles, as ``torch.multiprocessing`` pickles a CUDA tensor), one
device-to-device copy into it per version, and one out of it per worker. This script
measures both:

- ``zmqsync-pipe``: ``MultiProcessWeightSyncScheme("state_dict")`` with its defaults, the
  learner's and every worker's state_dict on the device; ``send()`` returns once every
  worker applied the version (its device synchronized before the ack); the table's
  ``device chunks`` is the fewest chunks any worker copied from the hub's device blocks;
- ``zmqsync-ipc``: ``ZMQWeightSyncScheme("state_dict")`` over ``ipc://`` (pubsub, its
  defaults), the same way, into a third state_dict of each worker;
- ``cuda-ipc``: the learner copies its tensors into the shared buffer with one
  ``_foreach_copy_``, synchronizes, and tells each worker over a pipe; each worker copies
  the buffer into its own tensors with one ``_foreach_copy_``, synchronizes, and acks.
  No checks, no versions, no late joiners: the floor, not a product.

Before each version the learner changes one tensor in place and synchronizes, so both
variants start from an idle device. The variants take turns version by version. After
each variant's sends every worker's tensors are compared with the learner's.

    python -m benchmarks.cuda_ipc --sizes 16MB,128MB,1GB --workers 1,2,4 --repeats 10

``--device cpu`` runs the same on the CPU (the buffer then lies in shared memory), which
is how this script is tested where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Final

import torch
import torch.multiprocessing as tmp

from zmqsync import MultiProcessWeightSyncScheme, ZMQWeightSyncScheme

#: name -> (tensor count, shape of each float32 tensor)
SIZES: Final[dict[str, tuple[int, tuple[int, int]]]] = {
    "16MB": (8, (1024, 512)),
    "128MB": (16, (2048, 1024)),
    "1GB": (16, (16384, 1024)),
}
#: Seconds any one step may take (a set-up, a version, an answer).
TIMEOUT: Final = 60.0


def _state_dict(size: str, device: str, *, seed: int | None) -> dict[str, torch.Tensor]:
    count, shape = SIZES[size]
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return {
        f"w{i}": (torch.randn(shape, generator=gen) if gen else torch.zeros(shape)).to(device)
        for i in range(count)
    }


def _sums(state_dict: dict[str, torch.Tensor]) -> list[float]:
    return [float(t.double().sum()) for t in state_dict.values()]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _worker(
    control: Any,
    pipe: Any,
    scheme: Any,
    zscheme: Any,
    index: int,
    flat: torch.Tensor,
    size: str,
    device: str,
) -> None:
    """One worker: two zmqsync receivers on their background threads (a pipe's, an
    ``ipc://`` one's), and a hand-written CUDA IPC reader of ``flat`` driven over
    ``control``."""
    zmq_model = _state_dict(size, device, seed=None)
    ipc_model = _state_dict(size, device, seed=None)
    z_model = _state_dict(size, device, seed=None)
    scheme.init_on_worker("policy", pipe=pipe, model=zmq_model)
    scheme.connect(timeout=TIMEOUT)
    scheme.start_receiver_thread()
    zscheme.init_on_receiver(model_id="policy", model=z_model, worker_idx=index)
    zscheme.connect(timeout=TIMEOUT)
    zscheme.start_receiver_thread()
    views = _views(flat, ipc_model)
    targets = list(ipc_model.values())
    try:
        while True:
            if not control.poll(TIMEOUT * 10):
                return
            what = control.recv()
            if what == "copy":
                torch._foreach_copy_(targets, views)
                _sync(device)
                control.send("done")
            elif what == "sums":
                with scheme.lock, zscheme.lock:
                    lent = scheme.get_receiver().stats["device_chunks"]
                    zlent = zscheme.get_receiver().stats["device_chunks"]
                    control.send((_sums(zmq_model), _sums(z_model), _sums(ipc_model), lent, zlent))
            else:
                return
    finally:
        scheme.shutdown()
        zscheme.shutdown()


def _views(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``'s bytes shaped as ``like``'s tensors, one after another."""
    out, offset = [], 0
    for t in like.values():
        n = t.numel() * t.element_size()
        out.append(flat[offset : offset + n].view(t.dtype).view(t.shape))
        offset += n
    return out


def _bump(model: dict[str, torch.Tensor], step: int, device: str) -> None:
    tensors = list(model.values())
    tensors[step % len(tensors)].add_(1)
    _sync(device)


def run_cell(size: str, workers: int, repeats: int, device: str) -> dict[str, Any]:
    ctx = tmp.get_context("spawn")
    model = _state_dict(size, device, seed=1234)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if not device.startswith("cuda"):
        flat.share_memory_()
    views = _views(flat, model)
    scheme = MultiProcessWeightSyncScheme("state_dict")
    pipes = [ctx.Pipe() for _ in range(workers)]
    controls = [ctx.Pipe() for _ in range(workers)]
    scheme.init_on_sender("policy", pipes=[p[0] for p in pipes], model=model, num_workers=workers)
    where = tempfile.mkdtemp(prefix="zmqsync-bench-")
    zscheme = ZMQWeightSyncScheme("state_dict", endpoint=f"ipc://{where}/learner")
    zscheme.init_on_sender("policy", model=model, num_workers=workers)
    procs = [
        ctx.Process(
            target=_worker,
            args=(controls[i][1], pipes[i][1], scheme, zscheme, i, flat, size, device),
            daemon=True,
        )
        for i in range(workers)
    ]
    times: dict[str, list[float]] = {"zmqsync-pipe": [], "zmqsync-ipc": [], "cuda-ipc": []}
    #: Per worker: chunks it took from device memory the hub lent (CUDA IPC), per
    #: zmqsync variant.
    device_chunks: dict[str, list[int]] = {"zmqsync-pipe": [], "zmqsync-ipc": []}
    try:
        for p in procs:
            p.start()
        scheme.connect(timeout=TIMEOUT)
        zscheme.connect(timeout=TIMEOUT)

        def ipc_send() -> None:
            torch._foreach_copy_(views, list(model.values()))
            _sync(device)
            for c, _ in controls:
                c.send("copy")
            for c, _ in controls:
                if not c.poll(TIMEOUT) or c.recv() != "done":
                    raise TimeoutError("a cuda-ipc worker did not answer")

        sends = {"zmqsync-pipe": scheme.send, "zmqsync-ipc": zscheme.send, "cuda-ipc": ipc_send}
        step = 0
        for i in range(repeats + 2):  # two untimed warm-ups
            order = list(sends) if i % 2 == 0 else list(reversed(sends))
            for name in order:
                _bump(model, step, device)
                step += 1
                start = time.perf_counter()
                sends[name]()
                took = time.perf_counter() - start
                if i >= 2:
                    times[name].append(took * 1000)
        expected = _sums(model)
        # Each variant sends the model as it is now once more, then every worker's two
        # state_dicts must equal it.
        scheme.send()
        zscheme.send()
        ipc_send()
        for c, _ in controls:
            c.send("sums")
        for c, _ in controls:
            if not c.poll(TIMEOUT):
                raise TimeoutError("a worker did not answer")
            got_pipe, got_z, got_ipc, lent, zlent = c.recv()
            device_chunks["zmqsync-pipe"].append(lent)
            device_chunks["zmqsync-ipc"].append(zlent)
            got_all = (("zmqsync-pipe", got_pipe), ("zmqsync-ipc", got_z), ("cuda-ipc", got_ipc))
            for name, got in got_all:
                if got != expected:
                    raise AssertionError(f"{name}: a worker's tensors differ from the learner's")
    finally:
        for c, _ in controls:
            with contextlib.suppress(OSError):  # a worker already gone
                c.send("exit")
        for p in procs:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
        scheme.shutdown()
        zscheme.shutdown()
        shutil.rmtree(where, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "size": size,
        "workers": workers,
        "bytes": nbytes,
        "median_ms": med,
        "ratio": med["zmqsync-pipe"] / med["cuda-ipc"],
        "ratio_ipc": med["zmqsync-ipc"] / med["cuda-ipc"],
        "device_chunks": device_chunks,
        "times_ms": times,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cuda_ipc", description=__doc__)
    p.add_argument("--sizes", default="16MB,128MB,1GB")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            p.error(f"unknown size {s}: one of {', '.join(SIZES)}")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"# {name}, torch {torch.__version__}, {args.repeats} sends each", file=sys.stderr)
    print(
        "| size | K | zmqsync-pipe ms | zmqsync-ipc ms | cuda-ipc ms | pipe / cuda-ipc "
        "| ipc / cuda-ipc | device chunks (pipe, ipc) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    cells = []
    for size in sizes:
        for k in (int(w) for w in args.workers.split(",")):
            cell = run_cell(size, k, args.repeats, args.device)
            cells.append(cell)
            m = cell["median_ms"]
            chunks = cell["device_chunks"]
            print(
                f"| {size} | {k} | {m['zmqsync-pipe']:.2f} | {m['zmqsync-ipc']:.2f} "
                f"| {m['cuda-ipc']:.2f} | {cell['ratio']:.2f} | {cell['ratio_ipc']:.2f} "
                f"| {min(chunks['zmqsync-pipe'])}, {min(chunks['zmqsync-ipc'])} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "cells": cells}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
