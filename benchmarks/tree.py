"""A learner, R relays and N workers against the flat star, on shaped links, in one run.

Every host is a network namespace on one switch (veth pairs and a bridge), each link
shaped to the same rate with tbf in both directions, so that a host's link is its NIC.
Each worker process holds two receivers: one of the star (the learner's own worker) and
one of the tree (a worker of relay ``i % R``). The two learners take turns version by
version (A B B A ...), each checked on every worker after every version.

The learner's egress per version is what left its link (``ip -s link``: tx bytes), not a
counter of zmqsync's; the time per version is ``send()``'s, which returns once every
worker holds the version.

Needs root (``ip netns``) and ``tc``; the hosts are the multi-host tests' own
(:mod:`tests.netns`). Run ``python -m benchmarks.tree --help`` from the repository root;
see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from benchmarks._models import MIB
from benchmarks._pool import WorkerPool
from benchmarks._results import machine_info, write_json
from benchmarks._turns import PEER_SECONDS, Receivers, check_workers, float_model, take_turns
from tests.netns import Topology, enter_netns

#: The model: 4 equal weights.
WEIGHTS: Final = 4
#: Where each relay listens for its workers, on its own host.
RELAY_PORT: Final = 7000
#: Where the star's and the tree's learners listen, on the learner's host.
STAR_PORT: Final = 6000
TREE_PORT: Final = 6100
#: The learners' ``timeout=``: a version crosses shaped links, and a relay.
SENDER_SECONDS: Final = 300
#: How long the relays, then the workers, may take to start and join.
RELAY_START_SECONDS: Final = 180
WORKER_START_SECONDS: Final = 300
#: How long a relay may take to report its status at the end.
STATUS_SECONDS: Final = 10
#: How long reading one host's link counters may take.
IP_SECONDS: Final = 20


def _model(mib: int, value: float) -> dict[str, torch.Tensor]:
    return float_model(mib, value, weights=WEIGHTS)


class _RelayHost:
    """A relay process on its own host: forwards the tree's learner to its workers;
    answers ``("status", ())`` with its relay and upstream status."""

    def __init__(self, namespace: str, upstream: str, index: int, snapshot: bool) -> None:
        enter_netns(namespace)
        from zmqsync import Relay

        self.rss_before = _memory_kib("VmRSS")
        self.relay = Relay.over_zmq(
            upstream,
            f"tcp://0.0.0.0:{RELAY_PORT}",
            insecure=True,
            strategy="state_dict",
            worker_idx=index,
            timeout=PEER_SECONDS,
            retain_snapshot=snapshot,
        )
        try:
            self.relay.connect(timeout=PEER_SECONDS)
            self.relay.start()
        except BaseException:
            self.relay.close()
            raise

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {"status": self.status}

    def status(self) -> dict[str, Any]:
        status = self.relay.status()
        grown = (_memory_kib("VmHWM") - self.rss_before) / 1024
        return {"relay": status["relay"], "upstream": status["upstream"], "peak_growth_mib": grown}

    def close(self) -> None:
        self.relay.close()


def _memory_kib(field: str) -> int:
    """This process's ``field`` of /proc/self/status (VmRSS, VmHWM), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _worker(namespace: str, index: int, mib: int, endpoints: dict[str, str]) -> Receivers:
    enter_netns(namespace)
    model = functools.partial(_model, mib, 0.0)
    return Receivers(index, endpoints, model, identity="{name}{index}")


def _tx_bytes(namespace: str) -> int:
    out = subprocess.run(
        ["ip", "-n", namespace, "-s", "link", "show", "eth0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=IP_SECONDS,
    ).stdout
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("TX:"))
    return int(re.split(r"\s+", lines[at + 1].strip())[0])


def run(
    workers: int,
    relays: int,
    mib: int,
    repeats: int,
    rate: str,
    chunk_bytes: int,
    snapshot: bool = True,
) -> dict[str, Any]:
    from zmqsync import WeightSender
    from zmqsync.transport.zmq_pubsub import PubSubHub

    hosts = ["learner", *[f"r{i}" for i in range(relays)], *[f"w{i}" for i in range(workers)]]
    with Topology(hosts) as topo:
        for host in hosts:
            topo.shape(host, rate=rate, burst="256kb", latency="200ms")
        enter_netns(topo.namespace("learner"))  # this process is the learners' host
        address = topo.address("learner")
        learners = {name: _model(mib, 1.0) for name in ("star", "tree")}
        fleets = {"star": workers, "tree": relays}  # who each learner sends to
        ports = {"star": STAR_PORT, "tree": TREE_PORT}
        senders = {
            name: WeightSender(
                PubSubHub(f"tcp://{address}:{ports[name]}", insecure=True),
                model=learners[name],
                strategy="state_dict",
                num_workers=fleets[name],
                chunk_bytes=chunk_bytes,
                timeout=SENDER_SECONDS,
            )
            for name in ("star", "tree")
        }
        relay_pool = WorkerPool(
            _RelayHost,
            [
                (topo.namespace(f"r{i}"), senders["tree"].endpoint, i, snapshot)
                for i in range(relays)
            ],
            name="bench-relay",
        )
        endpoints = [
            {
                "star": senders["star"].endpoint,
                "tree": f"tcp://{topo.address(f'r{i % relays}')}:{RELAY_PORT}",
            }
            for i in range(workers)
        ]
        worker_pool = WorkerPool(
            _worker, [(topo.namespace(f"w{i}"), i, mib, endpoints[i]) for i in range(workers)]
        )
        try:
            relay_pool.start(RELAY_START_SECONDS)
            worker_pool.start(WORKER_START_SECONDS)
            times: dict[str, list[float]] = {"star": [], "tree": []}
            egress: dict[str, list[int]] = {"star": [], "tree": []}
            value = 1.0
            for rep, name in take_turns(["star", "tree"], repeats):
                value += 1.0
                for t in learners[name].values():
                    t.fill_(value)
                before = _tx_bytes(topo.namespace("learner"))
                started = time.perf_counter()
                senders[name].send()
                elapsed = time.perf_counter() - started
                sent = _tx_bytes(topo.namespace("learner")) - before
                check_workers(worker_pool, name, value)
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
            with contextlib.suppress(Exception):
                for status in relay_pool.call(range(relays), "status", (), STATUS_SECONDS):
                    print("relay:", status, flush=True)
            worker_pool.close()
            relay_pool.close()
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
    parser.add_argument(
        "--no-snapshot",
        action="store_true",
        help="relays keep no copy of the latest version (Relay(retain_snapshot=False))",
    )
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
    for n in [int(x) for x in args.workers.split(",")]:
        result = run(
            n,
            args.relays,
            args.mib,
            args.repeats,
            args.rate,
            args.chunk_kib * 1024,
            snapshot=not args.no_snapshot,
        )
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
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
