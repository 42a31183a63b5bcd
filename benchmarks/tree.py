"""A learner, R relays and N workers against the flat star, on shaped links, in one run.

Every host is a network namespace on one switch (veth pairs and a bridge), each link
shaped to the same rate with tbf in both directions, so that a host's link is its NIC.
Each worker process holds two receivers: one of the star (the learner's own worker) and
one of the tree (a worker of relay ``i % R``). The two learners take turns version by
version (A B B A ...), each checked on every worker after every version.

The learner's egress per version is what left its link (``ip -s link``: tx bytes), not a
counter of zmqsync's; the time per version is ``send()``'s, which returns once every
worker holds the version.

Needs root (``ip netns``) and ``tc``. Run ``python -m benchmarks.tree --help``; see
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import machine_info

MIB = 1 << 20
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import Topology, enter_netns  # noqa: E402


def _model(mib: int, value: float) -> dict[str, torch.Tensor]:
    n = mib * MIB // 4 // 4
    return {f"layer{i}.weight": torch.full((n,), value) for i in range(4)}


def _relay(namespace: str, upstream: str, index: int, conn: Any) -> None:
    enter_netns(namespace)
    from zmqsync import Relay

    relay = Relay.over_zmq(
        upstream,
        "tcp://0.0.0.0:7000",
        insecure=True,
        strategy="state_dict",
        worker_idx=index,
        timeout=120,
    )
    try:
        relay.connect(timeout=120)
        relay.start()
        conn.send("ready")
        conn.recv()  # "stop"
        status = relay.status()
        conn.send({"relay": status["relay"], "upstream": status["upstream"]})
    finally:
        relay.close()


def _worker(namespace: str, index: int, mib: int, endpoints: dict[str, str], conn: Any) -> None:
    enter_netns(namespace)
    from zmqsync import WeightReceiver
    from zmqsync.transport.zmq_pubsub import PubSubSpoke

    models = {name: _model(mib, 0.0) for name in endpoints}
    receivers = {
        name: WeightReceiver(
            PubSubSpoke(endpoint, identity=f"{name}{index}"),
            model=models[name],
            strategy="state_dict",
            worker_idx=index,
            timeout=120,
        )
        for name, endpoint in endpoints.items()
    }
    try:
        for r in receivers.values():
            r.connect(timeout=120)
            r.start()
        conn.send("ready")
        while True:
            what = conn.recv()
            if what == "stop":
                break
            name, value = what
            with receivers[name].lock:
                conn.send(all(bool((t == value).all()) for t in models[name].values()))
    finally:
        for r in receivers.values():
            r.close()


def _tx_bytes(namespace: str) -> int:
    out = subprocess.run(
        ["ip", "-n", namespace, "-s", "link", "show", "eth0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("TX:"))
    return int(re.split(r"\s+", lines[at + 1].strip())[0])


def run(
    workers: int, relays: int, mib: int, repeats: int, rate: str, chunk_bytes: int
) -> dict[str, Any]:
    from zmqsync import WeightSender
    from zmqsync.transport.zmq_pubsub import PubSubHub

    hosts = ["learner", *[f"r{i}" for i in range(relays)], *[f"w{i}" for i in range(workers)]]
    ctx = mp.get_context("spawn")
    with Topology(hosts) as topo:
        for host in hosts:
            topo.shape(host, rate=rate, burst="256kb", latency="200ms")
        enter_netns(topo.namespace("learner"))  # this process is the learners' host
        address = topo.address("learner")
        learners = {name: _model(mib, 1.0) for name in ("star", "tree")}
        senders = {
            "star": WeightSender(
                PubSubHub(f"tcp://{address}:6000", insecure=True),
                model=learners["star"],
                strategy="state_dict",
                num_workers=workers,
                chunk_bytes=chunk_bytes,
                timeout=300,
            ),
            "tree": WeightSender(
                PubSubHub(f"tcp://{address}:6100", insecure=True),
                model=learners["tree"],
                strategy="state_dict",
                num_workers=relays,
                chunk_bytes=chunk_bytes,
                timeout=300,
            ),
        }
        procs: list[Any] = []
        conns: list[Any] = []
        workers_conns: list[Any] = []
        try:
            for i in range(relays):
                parent, child = ctx.Pipe()
                args = (topo.namespace(f"r{i}"), senders["tree"].endpoint, i, child)
                procs.append(ctx.Process(target=_relay, args=args, daemon=True))
                procs[-1].start()
                assert parent.poll(180) and parent.recv() == "ready"
                conns.append(parent)
            for i in range(workers):
                parent, child = ctx.Pipe()
                endpoints = {
                    "star": senders["star"].endpoint,
                    "tree": f"tcp://{topo.address(f'r{i % relays}')}:7000",
                }
                procs.append(
                    ctx.Process(
                        target=_worker,
                        args=(topo.namespace(f"w{i}"), i, mib, endpoints, child),
                        daemon=True,
                    )
                )
                procs[-1].start()
                workers_conns.append(parent)
                conns.append(parent)
            for conn in workers_conns:
                assert conn.poll(300) and conn.recv() == "ready"
            times: dict[str, list[float]] = {"star": [], "tree": []}
            egress: dict[str, list[int]] = {"star": [], "tree": []}
            value = 1.0
            for rep in range(repeats + 1):  # the first round warms up
                for name in ("star", "tree") if rep % 2 == 0 else ("tree", "star"):
                    value += 1.0
                    for t in learners[name].values():
                        t.fill_(value)
                    before = _tx_bytes(topo.namespace("learner"))
                    started = time.perf_counter()
                    senders[name].send()
                    elapsed = time.perf_counter() - started
                    sent = _tx_bytes(topo.namespace("learner")) - before
                    for conn in workers_conns:
                        conn.send((name, value))
                    if not all(conn.recv() for conn in workers_conns):
                        raise RuntimeError(f"{name}: a worker does not hold version {value}")
                    if rep:
                        times[name].append(elapsed)
                        egress[name].append(sent)
            return {
                name: {
                    "median_s": statistics.median(times[name]),
                    "egress_per_version": statistics.median(egress[name]),
                    "model_bytes": mib * MIB,
                }
                for name in times
            }
        finally:
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.send("stop")
            for conn in conns[:relays]:
                with contextlib.suppress(OSError, EOFError):
                    if conn.poll(10):
                        print("relay:", conn.recv(), flush=True)
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.kill()
            for s in senders.values():
                s.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tree", description=__doc__)
    parser.add_argument("--workers", default="4,8", help="fleet sizes N")
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--mib", type=int, default=4, help="model size in MiB")
    parser.add_argument("--repeats", type=int, default=4, help="versions per variant")
    parser.add_argument("--rate", default="200mbit", help="every link's rate (tbf)")
    parser.add_argument(
        "--chunk-kib", type=int, default=256, help="chunk size: what a relay forwards at once"
    )
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
    for n in [int(x) for x in args.workers.split(",")]:
        result = run(n, args.relays, args.mib, args.repeats, args.rate, args.chunk_kib * 1024)
        star, tree = result["star"], result["tree"]
        out["rows"].append({"workers": n, "relays": args.relays, **result})
        print(
            f"N={n:3d} R={args.relays}  star {star['median_s'] * 1000:8.1f} ms, learner egress "
            f"{star['egress_per_version'] / star['model_bytes']:5.2f} copies  |  tree "
            f"{tree['median_s'] * 1000:8.1f} ms, learner egress "
            f"{tree['egress_per_version'] / tree['model_bytes']:5.2f} copies  |  tree/star time "
            f"{tree['median_s'] / star['median_s']:.2f}x",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
