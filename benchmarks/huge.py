"""A model of several GiB to workers over tcp: time, throughput and peak extra memory of
zmqsync (``retain_snapshot=False``, chunks written in place) against raw pyzmq moving the
same bytes, in the same run, in the same worker processes.

- ``raw-pyzmq``: PUB/SUB, the tensors' bytes in ``--chunk-mib`` frames sent zero-copy
  from the learner's tensors; each worker receives them (``copy=False``) and copies them
  into its own tensors, then acks on a PUSH socket. No versions, no checks: the floor.
- ``zmqsync``: ``WeightSender(PubSubHub(tcp), retain_snapshot=False)`` and
  ``WeightReceiver(..., apply_mode="in_place")``.

With ``--with-model``, the learner's model is given to the scheme instead
(``ZMQWeightSyncScheme(retain_snapshot=False).init_on_sender(model=...)``): it is
published as version 0 at init, the workers' ``connect()`` returns holding it, and the
learner's ``connect()`` waits for them; the peak extra memory of that rendez-vous (from
``init_on_sender`` to the end of ``connect()`` on the learner, each worker's
``connect()``) is reported as ``rendez-vous`` rows, beside the sends'.

Repeats alternate A B B A so drift on a shared machine hits both alike. Peak extra
memory is :class:`benchmarks._memory.PeakMemoryMeter`'s (malloc'd bytes and anonymous
RSS over the model itself), per process, over all of a variant's versions.

Run ``python -m benchmarks.huge --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np
import torch
import zmq

from benchmarks._memory import PeakMemoryMeter
from benchmarks._models import MIB
from benchmarks._pool import WorkerPool
from benchmarks._results import machine_info, write_json

GIB: Final = 1 << 30
_HEAD: Final = struct.Struct("!QQ")  # version, frame index
#: Tensors of the model, unless ``--single``.
TENSORS: Final = 16
#: How long anything may wait on the other side: a worker on the learner's frames, the
#: learner on the workers' acks or their reports (a model of several GiB is slow to move).
WAIT_SECONDS: Final = 600
#: How long the workers may take to start and join.
START_SECONDS: Final = 300
#: The zmqsync learner's and receivers' ``timeout=``.
ZMQSYNC_SECONDS: Final = 120
#: How often the learner looks for a pong, or an ack, between its pings or checks.
PING_MS: Final = 50
ACK_POLL_MS: Final = 1000


def _layout(gib: float, single: bool) -> list[tuple[str, int]]:
    """(name, float16 elements) per tensor."""
    total = int(gib * GIB) // 2
    if single:
        return [("weight", total)]
    return [(f"layer{i}.weight", total // TENSORS) for i in range(TENSORS)]


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


class _Worker:
    """A worker process: a raw SUB socket and a zmqsync receiver into the same tensors.

    Answers ``("ping", ())`` once the learner's pings reach its SUB socket (its
    subscription is live), and ``("receive", (variant, versions, target, value))`` once it
    has received ``versions`` versions by ``variant``, with its peak extra memory over
    them, its receiver's counters, and whether every element holds ``value``.
    """

    def __init__(self, index: int, args: dict[str, Any]) -> None:
        from zmqsync import WeightReceiver
        from zmqsync.transport.zmq_pubsub import PubSubSpoke

        self.index = index
        self.model = _tensors(_layout(args["gib"], args["single"]), 0.0)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.rcvhwm = 0
        # A learner gone this long: this worker fails, not hangs.
        self.sub.rcvtimeo = WAIT_SECONDS * 1000
        self.sub.subscribe(b"")
        self.sub.connect(args["raw_pub"])
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(args["raw_ack"])
        self.receiver = WeightReceiver(
            PubSubSpoke(args["zmq"], identity=str(index)),
            model=self.model,
            strategy="state_dict",
            worker_idx=index,
            apply_mode="in_place",
            timeout=ZMQSYNC_SECONDS,
        )
        with PeakMemoryMeter() as meter:  # the learner's model, if given: version 0
            self.receiver.connect(WAIT_SECONDS)
        with self.receiver.lock:
            exact = all(bool((t == args["initial"]).all()) for t in self.model.values())
        self.rendezvous = {**meter.extra, "version": self.receiver.version, "exact": exact}
        self.receiver.start()
        targets = _frames(self.model, args["chunk"])
        self.arrays = [np.frombuffer(t, dtype=np.uint8) for t in targets]

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {"ping": self.ping, "receive": self.receive, "rendezvous": self.report}

    def report(self) -> dict[str, Any]:
        """What its connect() cost, and whether it then held the learner's weights."""
        return self.rendezvous

    def ping(self) -> None:
        while True:  # until the learner's pings reach us: the subscription is live
            frames = self.sub.recv_multipart()
            if frames[0] == b"ping":
                self.push.send(b"pong")
                return

    def _receive_raw(self, versions: int) -> None:
        for _ in range(versions):
            for i, dest in enumerate(self.arrays):
                parts = self.sub.recv_multipart(copy=False)
                while len(parts) == 1:  # a ping that outlived the handshake
                    parts = self.sub.recv_multipart(copy=False)
                head, payload = parts
                version, frame = _HEAD.unpack(head.bytes)
                assert frame == i, (frame, i)
                np.copyto(dest, np.frombuffer(payload.buffer, dtype=np.uint8))
            self.push.send(_HEAD.pack(version, self.index))

    def _await_version(self, target: int) -> None:
        reached = threading.Event()

        def applied(epoch: int, version: int) -> None:
            if version >= target:
                reached.set()

        self.receiver.on_applied.append(applied)
        if self.receiver.version >= target:
            reached.set()
        if not reached.wait(WAIT_SECONDS):
            raise TimeoutError(f"worker {self.index} never reached version {target}")
        self.receiver.on_applied.clear()

    def receive(self, variant: str, versions: int, target: int, value: float) -> dict[str, Any]:
        with PeakMemoryMeter() as meter:
            if variant == "raw-pyzmq":
                self._receive_raw(versions)
            else:
                self._await_version(target)
        # Every element of every tensor holds the learner's value now.
        with self.receiver.lock:
            exact = all(bool((t == value).all()) for t in self.model.values())
        stats = {k: self.receiver.stats[k] for k in ("chunks", "broken_streams", "torn")}
        stats["exact"] = exact
        return {"variant": variant, **meter.extra, **stats}

    def close(self) -> None:
        self.receiver.close()
        self.ctx.destroy(linger=0)


def _raw_send(
    pub: Any, pull: Any, frames: list[memoryview], version: int, pool: WorkerPool
) -> None:
    for i, frame in enumerate(frames):
        pub.send_multipart([_HEAD.pack(version, i), frame], copy=False)
    deadline = time.monotonic() + WAIT_SECONDS
    acks = 0
    while acks < pool.size:
        if pull.poll(ACK_POLL_MS):
            pull.recv()
            acks += 1
        elif time.monotonic() > deadline or not pool.alive():
            raise TimeoutError("a worker did not ack the raw version")


def _handshake(pub: Any, pull: Any, pool: WorkerPool) -> None:
    """Publish pings until every worker's SUB socket has seen one (no sleeps)."""
    ids = pool.post(range(pool.size), "ping", ())
    pongs = 0
    while pongs < pool.size:
        pub.send(b"ping")
        if pull.poll(PING_MS):
            pull.recv()
            pongs += 1
    pool.collect(ids, "ping", WAIT_SECONDS)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="model size in GiB (float16)")
    parser.add_argument("--single", action="store_true", help="one tensor of that size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="versions per variant, x2")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument(
        "--with-model",
        action="store_true",
        help="give the scheme the model at init (published as version 0 to connecting workers)",
    )
    parser.add_argument(
        "--share-params",
        action="store_true",
        help="zmqsync's sender is given the model with share_params=True: its tensors move "
        "into one buffer and chunks go from it without a copy",
    )
    ns = parser.parse_args(argv)
    if ns.share_params and ns.with_model:
        parser.error("--share-params and --with-model measure different things: pick one")

    from zmqsync import WeightSender, ZMQWeightSyncScheme
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
    scheme: Any = None
    rendezvous = PeakMemoryMeter()
    if ns.with_model:
        scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode="pubsub",
            endpoint="tcp://127.0.0.1:*",
            timeout=WAIT_SECONDS,
            retain_snapshot=False,
            chunk_bytes=chunk,
        )
        rendezvous.__enter__()  # left once the learner's connect() returns
        scheme.init_on_sender("policy", model=model, num_workers=ns.workers)
        sender = scheme.get_sender()
        hub = sender.transport
    else:
        hub = PubSubHub("tcp://127.0.0.1:*")
        sender = WeightSender(
            hub,
            model=model if ns.share_params else None,
            strategy="state_dict",
            num_workers=ns.workers,
            timeout=WAIT_SECONDS,
            retain_snapshot=False,
            chunk_bytes=chunk,
            share_params=ns.share_params,
        )
    args = {
        # What a worker holds once connected (version 0, if the sender has the model).
        "initial": 1.0 if ns.with_model or ns.share_params else 0.0,
        "gib": ns.gib,
        "single": ns.single,
        "chunk": chunk,
        "raw_pub": f"tcp://127.0.0.1:{raw_port}",
        "raw_ack": f"tcp://127.0.0.1:{ack_port}",
        "zmq": hub.endpoint,
    }
    pool = WorkerPool(_Worker, [(i, args) for i in range(ns.workers)])
    times: dict[str, list[float]] = {"raw-pyzmq": [], "zmqsync": []}
    memory: dict[str, dict[str, list[int]]] = {}
    receivers: dict[str, dict[str, int]] = {}
    try:
        pool.start(START_SECONDS)
        if scheme is not None:
            scheme.connect(timeout=WAIT_SECONDS)
            rendezvous.__exit__(None, None, None)
            for key in ("heap", "rss_anon"):
                memory.setdefault("learner rendez-vous", {})[key] = [rendezvous.extra.get(key, 0)]
            ids = pool.post(range(pool.size), "rendezvous", ())
            for extra in pool.collect(ids, "rendezvous", WAIT_SECONDS):
                if not extra["exact"] or extra["version"] != 0:
                    raise AssertionError(f"a worker did not connect holding version 0: {extra}")
                row = memory.setdefault("worker rendez-vous", {})
                for key in ("heap", "rss_anon"):
                    row.setdefault(key, []).append(extra.get(key, 0))
        _handshake(pub, pull, pool)
        version = 0
        first_send = None
        if ns.share_params:
            # The first send moves the model's tensors into the sender's buffer (one
            # copy, once): timed apart from the versions after it.
            version += 1
            for t in model.values():
                t.add_(1)
            start = time.perf_counter()
            sender.send(model)
            first_send = time.perf_counter() - start
        for variant in ["raw-pyzmq", "zmqsync", "zmqsync", "raw-pyzmq"]:
            # The tensors' memory now (share_params moves it), and none kept after.
            frames = _frames(model, chunk) if variant == "raw-pyzmq" else []
            # The learner starts at 1.0 and adds 1 per version, whichever variant.
            target = (variant, ns.repeats, sender.version + ns.repeats, 1.0 + version + ns.repeats)
            ids = pool.post(range(pool.size), "receive", target)
            with PeakMemoryMeter() as meter:
                for _ in range(ns.repeats):
                    version += 1
                    for t in model.values():
                        t.add_(1)
                    start = time.perf_counter()
                    if variant == "raw-pyzmq":
                        _raw_send(pub, pull, frames, version, pool)
                    else:
                        sender.send(model)
                    times[variant].append(time.perf_counter() - start)
            for key in ("heap", "rss_anon"):
                row = memory.setdefault(f"learner {variant}", {})
                row.setdefault(key, []).append(meter.extra.get(key, 0))
            for extra in pool.collect(ids, "receive", WAIT_SECONDS):
                row = memory.setdefault(f"worker {extra['variant']}", {})
                for key in ("heap", "rss_anon"):
                    row.setdefault(key, []).append(extra.get(key, 0))
                receivers[extra["variant"]] = {
                    k: extra[k] for k in ("chunks", "broken_streams", "torn")
                }
                if not extra["exact"]:
                    raise AssertionError(f"a worker's tensors differ after {extra['variant']}")
        status = sender.status()
        totals = status["totals"]
    finally:
        if ns.with_model:  # its sampling thread, if an error came first (never entered else)
            rendezvous.__exit__(None, None, None)
        pool.close()
        sender.close()
        ctx.destroy(linger=0)
    out: dict[str, Any] = {
        "machine": machine_info(),
        "model_bytes": nbytes,
        "tensors": len(model),
        "workers": ns.workers,
        "chunk_bytes": chunk,
        "with_model": ns.with_model,
        "share_params": status["share_params"],
        "share_first_send_s": first_send,
        "seconds": {k: sorted(v) for k, v in times.items()},
        "gb_per_s": {k: nbytes / sorted(v)[len(v) // 2] / 1e9 for k, v in times.items()},
        "peak_extra_mib": {
            k: {m: max(v) / MIB for m, v in row.items()} for k, row in memory.items()
        },
    }
    out["sender"] = {
        k: totals[k] for k in ("chunks_sent", "stalls", "repairs_skipped", "params_moved")
    }
    out["worker_stats"] = receivers
    raw, ours = (sorted(times[k])[len(times[k]) // 2] for k in ("raw-pyzmq", "zmqsync"))
    out["zmqsync_vs_raw_throughput"] = raw / ours
    print(json.dumps(out, indent=2))
    write_json(ns.json, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
