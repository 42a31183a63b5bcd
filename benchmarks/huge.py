"""A model of several GiB to workers over tcp: time, throughput and peak extra memory of
zmqsync (``retain_snapshot=False``, chunks written in place) against raw pyzmq moving the
same bytes, in the same run, in the same worker processes.

- ``raw-pyzmq``: PUB/SUB, the tensors' bytes in ``--chunk-mib`` frames sent zero-copy
  from the learner's tensors; each worker receives them (``copy=False``) and copies them
  into its own tensors, then acks on a PUSH socket. No versions, no checks: the floor.
- ``zmqsync``: ``WeightSender(PubSubHub(tcp), retain_snapshot=False)`` and
  ``WeightReceiver(..., apply_mode="in_place")``.

Repeats alternate A B B A so drift on a shared machine hits both alike. Peak extra
memory is :class:`benchmarks._memory.PeakMemoryMeter`'s (malloc'd bytes and anonymous
RSS over the model itself), per process, over all of a variant's versions.

Run ``python -m benchmarks.huge --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import struct
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
import zmq

from benchmarks._memory import PeakMemoryMeter
from benchmarks._results import machine_info

GIB = 1 << 30
_HEAD = struct.Struct("!QQ")  # version, frame index


def _layout(gib: float, single: bool) -> list[tuple[str, int]]:
    """(name, float16 elements) per tensor."""
    total = int(gib * GIB) // 2
    if single:
        return [("weight", total)]
    n = 16
    return [(f"layer{i}.weight", total // n) for i in range(n)]


def _tensors(layout: list[tuple[str, int]], fill: float | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, numel in layout:
        t = torch.empty(numel, dtype=torch.float16)
        if fill is not None:
            t.fill_(fill)
        out[name] = t
    return out


def _frames(model: dict[str, torch.Tensor], chunk: int) -> list[memoryview]:
    out = []
    for t in model.values():
        data = t.view(torch.uint8).numpy()
        for start in range(0, len(data), chunk):
            out.append(data[start : start + chunk].data)
    return out


def _worker(index: int, args: dict[str, Any], control: Any, results: Any) -> None:
    from zmqsync import WeightReceiver
    from zmqsync.transport.zmq_pubsub import PubSubSpoke

    model = _tensors(_layout(args["gib"], args["single"]), 0.0)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.rcvtimeo = 600_000  # a learner gone for 10 minutes: this worker fails, not hangs
    sub.subscribe(b"")
    sub.connect(args["raw_pub"])
    push = ctx.socket(zmq.PUSH)
    push.connect(args["raw_ack"])
    receiver = WeightReceiver(
        PubSubSpoke(args["zmq"], identity=str(index)),
        model=model,
        strategy="state_dict",
        worker_idx=index,
        apply_mode="in_place",
        timeout=120,
    )
    receiver.connect()
    receiver.start()
    targets = _frames(model, args["chunk"])
    arrays = [np.frombuffer(t, dtype=np.uint8) for t in targets]
    results.put(("ready", index, None))
    while True:
        what = control.get()
        if what == "stop":
            break
        if what == "ping":
            while True:  # until the learner's pings reach us: the subscription is live
                frames = sub.recv_multipart()
                if frames[0] == b"ping":
                    push.send(b"pong")
                    break
            continue
        variant, versions, target, value = what
        with PeakMemoryMeter() as meter:
            if variant == "raw-pyzmq":
                for _ in range(versions):
                    for i, dest in enumerate(arrays):
                        parts = sub.recv_multipart(copy=False)
                        while len(parts) == 1:  # a ping that outlived the handshake
                            parts = sub.recv_multipart(copy=False)
                        head, payload = parts
                        version, frame = _HEAD.unpack(head.bytes)
                        assert frame == i, (frame, i)
                        np.copyto(dest, np.frombuffer(payload.buffer, dtype=np.uint8))
                    push.send(_HEAD.pack(version, index))
            else:
                reached = threading.Event()

                def applied(epoch: int, version: int, t: int = target, r: Any = reached) -> None:
                    if version >= t:
                        r.set()

                receiver.on_applied.append(applied)
                if receiver.version >= target:
                    reached.set()
                if not reached.wait(600):
                    raise TimeoutError(f"worker {index} never reached version {target}")
                receiver.on_applied.clear()
        # Every element of every tensor holds the learner's value now.
        with receiver.lock:
            exact = all(bool((t == value).all()) for t in model.values())
        stats = {k: receiver.stats[k] for k in ("chunks", "broken_streams", "torn")}
        stats["exact"] = exact
        results.put(("memory", index, {"variant": variant, **meter.extra, **stats}))
    receiver.close()
    ctx.destroy(linger=0)


def _raw_send(
    pub: Any, pull: Any, frames: list[memoryview], version: int, procs: list[Any]
) -> None:
    for i, frame in enumerate(frames):
        pub.send_multipart([_HEAD.pack(version, i), frame], copy=False)
    deadline = time.monotonic() + 600
    acks = 0
    while acks < len(procs):
        if pull.poll(1000):
            pull.recv()
            acks += 1
        elif time.monotonic() > deadline or not all(p.is_alive() for p in procs):
            raise TimeoutError("a worker did not ack the raw version")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="model size in GiB (float16)")
    parser.add_argument("--single", action="store_true", help="one tensor of that size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="versions per variant, x2")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--json", default="", help="also write the results here")
    ns = parser.parse_args(argv)

    from zmqsync import WeightSender
    from zmqsync.transport.zmq_pubsub import PubSubHub

    chunk = ns.chunk_mib << 20
    model = _tensors(_layout(ns.gib, ns.single), 1.0)
    nbytes = sum(t.nbytes for t in model.values())
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0  # no limit: raw pyzmq queues every frame (zero-copy, the model's own)
    raw_port = pub.bind_to_random_port("tcp://127.0.0.1")
    pull = ctx.socket(zmq.PULL)
    ack_port = pull.bind_to_random_port("tcp://127.0.0.1")
    hub = PubSubHub("tcp://127.0.0.1:*")
    sender = WeightSender(
        hub,
        model=None,
        strategy="state_dict",
        num_workers=ns.workers,
        timeout=600,
        retain_snapshot=False,
        chunk_bytes=chunk,
    )
    args = {
        "gib": ns.gib,
        "single": ns.single,
        "chunk": chunk,
        "raw_pub": f"tcp://127.0.0.1:{raw_port}",
        "raw_ack": f"tcp://127.0.0.1:{ack_port}",
        "zmq": hub.endpoint,
    }
    spawn = mp.get_context("spawn")
    controls = [spawn.Queue() for _ in range(ns.workers)]
    results = spawn.Queue()
    procs = [
        spawn.Process(target=_worker, args=(i, args, controls[i], results), daemon=True)
        for i in range(ns.workers)
    ]
    times: dict[str, list[float]] = {"raw-pyzmq": [], "zmqsync": []}
    memory: dict[str, dict[str, list[int]]] = {}
    receivers: dict[str, dict[str, int]] = {}
    try:
        for p in procs:
            p.start()
        for _ in procs:
            results.get(timeout=300)
        for c in controls:
            c.put("ping")
        pongs = 0
        while pongs < ns.workers:
            pub.send(b"ping")
            if pull.poll(50):
                pull.recv()
                pongs += 1
        frames = _frames(model, chunk)
        version = 0
        for variant in ["raw-pyzmq", "zmqsync", "zmqsync", "raw-pyzmq"]:
            for c in controls:
                # The learner starts at 1.0 and adds 1 per version, whichever variant.
                c.put(
                    (variant, ns.repeats, sender.version + ns.repeats, 1.0 + version + ns.repeats)
                )
            with PeakMemoryMeter() as meter:
                for _ in range(ns.repeats):
                    version += 1
                    for t in model.values():
                        t.add_(1)
                    start = time.perf_counter()
                    if variant == "raw-pyzmq":
                        _raw_send(pub, pull, frames, version, procs)
                    else:
                        sender.send(model)
                    times[variant].append(time.perf_counter() - start)
            memory.setdefault(f"learner {variant}", {}).setdefault("heap", []).append(
                meter.extra.get("heap", 0)
            )
            memory[f"learner {variant}"].setdefault("rss_anon", []).append(
                meter.extra.get("rss_anon", 0)
            )
            for _ in procs:
                _, _, extra = results.get(timeout=600)
                row = memory.setdefault(f"worker {extra['variant']}", {})
                for key in ("heap", "rss_anon"):
                    row.setdefault(key, []).append(extra.get(key, 0))
                receivers[extra["variant"]] = {
                    k: extra[k] for k in ("chunks", "broken_streams", "torn")
                }
                if not extra["exact"]:
                    raise AssertionError(f"a worker's tensors differ after {extra['variant']}")
        totals = sender.status()["totals"]
        for c in controls:
            c.put("stop")
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        sender.close()
        ctx.destroy(linger=0)
    out: dict[str, Any] = {
        "machine": machine_info(),
        "model_bytes": nbytes,
        "tensors": len(model),
        "workers": ns.workers,
        "chunk_bytes": chunk,
        "seconds": {k: sorted(v) for k, v in times.items()},
        "gb_per_s": {k: nbytes / sorted(v)[len(v) // 2] / 1e9 for k, v in times.items()},
        "peak_extra_mib": {
            k: {m: max(v) / (1 << 20) for m, v in row.items()} for k, row in memory.items()
        },
    }
    out["sender"] = {k: totals[k] for k in ("chunks_sent", "stalls", "repairs_skipped")}
    out["worker_stats"] = receivers
    raw, ours = (sorted(times[k])[len(times[k]) // 2] for k in ("raw-pyzmq", "zmqsync"))
    out["zmqsync_vs_raw_throughput"] = raw / ours
    print(json.dumps(out, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
