"""Bytes each rank of a sharded learner sends per version, with ``delta=True`` (and,
optionally, a ``wire_dtype``): each rank digests its own part and sends its changed
blocks only.

``M`` ranks of an FSDP2 learner over gloo (spawned processes, ``--ranks``), a model of
``--mib`` MiB (16 square float32 layers, each ``fully_shard``-ed on dim 0, plus their
biases), ``--workers`` plain workers in this process (unsharded modules, given rank 0's
``ipc://`` endpoint alone). Version 1 changes every element; each later version changes
``--share`` of the layers (whole layers, a different stretch each version), so every
rank's part changes by about that share; it moves in blocks of 256 KiB (the chunk size).
Each rank's bytes are its sender's own counter (``status()["totals"]["bytes_sent"]``,
every worker's chunks' payloads); every worker's checksum is checked against the
gathered model (cast as the wire dtype says) after every version.

Run ``python -m benchmarks.sharded_delta --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Final

import torch
from torch import nn

import zmqsync

#: The model: this many square layers (and their biases).
LAYERS: Final = 16
#: How long a rank or a worker may take to start, join and answer.
ANSWER_SECONDS: Final = 300.0
MIB: Final = 1 << 20
#: Chunks, and so digest blocks: a change moves whole blocks of this size.
CHUNK_BYTES: Final = 256 * 1024


class _Layers(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))


def _width(mib: int) -> int:
    return max(64, int(math.sqrt(mib * MIB / 4 / LAYERS)))


def _checksum(net: nn.Module, wire: torch.dtype | None) -> str:
    """The whole model as workers hold it (gathered here: a collective call)."""
    from torch.distributed.tensor import DTensor

    full = {}
    for name, t in net.state_dict(keep_vars=True).items():
        whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if wire is not None and whole.is_floating_point():
            whole = whole.to(wire).to(whole.dtype)
        full[name] = whole
    return zmqsync.checksum(full, "state_dict")


def _change(net: _Layers, version: int, share: float) -> None:
    """Every element (version 1), or ``share`` of the layers, a different run of them
    each version (each rank its own shard of them)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        count = LAYERS if version == 1 else max(1, round(share * LAYERS))
        first = 0 if version == 1 else (version * count) % LAYERS
        for i in range(first, first + count):
            layer = net.layers[i % LAYERS]
            assert isinstance(layer, nn.Linear)
            for t in (layer.weight, layer.bias):
                (t.to_local() if isinstance(t, DTensor) else t).add_(0.5)


def _rank(
    rank: int, world: int, port: int, endpoint: str, mib: int, wire: str, share: float, conn: Any
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    scheme = None
    dtype = getattr(torch, wire) if wire else None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        net = _Layers(_width(mib))
        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        scheme = zmqsync.ZMQWeightSyncScheme(
            "state_dict", mode="router", endpoint=endpoint, timeout=120, connect_timeout=300
        )
        options: dict[str, Any] = {"delta": True, "chunk_bytes": CHUNK_BYTES}
        if dtype is not None:
            options["wire_dtype"] = dtype
        scheme.init_on_sender("policy", model=net, **options)
        sender = scheme.get_sender()
        conn.send(("ready",))
        version = 0
        while True:
            command = conn.recv()
            if command == "stop":
                break
            if command == "connect":
                scheme.connect(timeout=300)
            else:
                version += 1
                _change(net, version, share)
                scheme.send()
            sent = sender.status()["totals"]["bytes_sent"]
            conn.send((command, version, _checksum(net, dtype), sent))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if scheme is not None:
            scheme.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _answer(conn: Any) -> Any:
    if not conn.poll(ANSWER_SECONDS):
        raise TimeoutError(f"no answer in {ANSWER_SECONDS:.0f}s")
    reply = conn.recv()
    if reply[0] == "error":
        raise RuntimeError(f"a rank failed:\n{reply[1]}")
    return reply


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(ranks: int, mib: int, workers: int, versions: int, share: float, wire: str) -> list[str]:
    """One learner of ``ranks`` ranks: a line per version."""
    spawn = mp.get_context("spawn")
    port = _free_port()
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        endpoints = [f"ipc://{tmp}/rank{r}" for r in range(ranks)]
        procs, conns, schemes = [], [], []
        try:
            for r in range(ranks):
                parent, child = spawn.Pipe()
                args = (r, ranks, port, endpoints[r], mib, wire, share, child)
                proc = spawn.Process(target=_rank, args=args, daemon=True)
                proc.start()
                child.close()
                procs.append(proc)
                conns.append(parent)
            for c in conns:
                _answer(c)
            models = []
            for w in range(workers):
                models.append(_Layers(_width(mib)))
                scheme = zmqsync.ZMQWeightSyncScheme(
                    "state_dict", mode="router", endpoint=endpoints[0], timeout=120
                )
                scheme.init_on_receiver(model_id="policy", model=models[-1], worker_idx=w)
                schemes.append(scheme)
            for c in conns:
                c.send("connect")
            for s in schemes:
                s.connect(timeout=300)
                s.start_receiver_thread()
            sent = [_answer(c)[3] for c in conns]
            whole = sum(t.nbytes for t in models[0].state_dict().values())
            itemsize = getattr(torch, wire).itemsize if wire else 4
            part = whole * itemsize / 4 / ranks / MIB
            for version in range(1, versions + 1):
                for c in conns:
                    c.send("send")
                answers = [_answer(c) for c in conns]
                expected = answers[0][2]
                for s, m in zip(schemes, models, strict=True):
                    with s.lock:
                        got = zmqsync.checksum(m, "state_dict")
                    if (s.get_receiver().version, got) != (version, expected):
                        raise AssertionError(f"worker not exact at version {version}")
                per = [(a[3] - b) / workers / MIB for a, b in zip(answers, sent, strict=True)]
                sent = [a[3] for a in answers]
                changed = 1.0 if version == 1 else max(1, round(share * LAYERS)) / LAYERS
                lines.append(
                    f"| {ranks} | {version} | {changed:.1%} | {part:.1f} | "
                    + " / ".join(f"{p:.2f}" for p in per)
                    + f" | {sum(per) / ranks / part:.1%} |"
                )
        finally:
            for s in schemes:
                s.shutdown()
            for c in conns:
                with contextlib.suppress(OSError):
                    c.send("stop")
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_delta", description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--share", type=float, default=0.125)
    parser.add_argument("--wire", default="bfloat16", help="a torch dtype name, or ''")
    args = parser.parse_args(argv)
    print(
        "| ranks | version | layers changed | each rank's part (MiB) "
        "| MiB each rank sent per worker | of its part |"
    )
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for line in run(ranks, args.mib, args.workers, args.versions, args.share, args.wire):
            print(line, flush=True)
        print(f"ranks={ranks} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
