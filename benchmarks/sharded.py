"""A sharded learner against gather-then-send, for M = 1, 2, 4 learner ranks, in one run.

Every rank of an FSDP2 learner (gloo, CPU) runs on a network namespace host of its own
whose link is shaped with tbf, both ways, to the same rate: a rank's link is its NIC.
The workers share one host with an unshaped link, so that their ingress is never what
limits a version. Two variants take turns version by version (A B B A ...), each checked
exactly on every worker after every version:

- ``sharded``: every rank sends its own part (``init_on_sender`` of the DTensor model);
- ``gather``: what users do today: the full state dict gathered on rank 0
  (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, over the same
  shaped links) and sent from rank 0 by a plain sender.

The time per version is the slowest rank's (a send is a collective call); each rank's
egress is what left its link (``ip -s link``: tx bytes, gloo's gather included); each
rank's memory is the most its heap rose for the variant (its sender's set-up plus one
version's peak). ``--relays R`` puts the workers behind R relays on shaped hosts of
their own. Needs root (``ip netns``) and ``tc``. Run ``python -m benchmarks.sharded
--help`` from the repository root; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any, Final

from benchmarks._models import MIB
from benchmarks._pool import WorkerError, WorkerPool
from benchmarks._results import machine_info, write_json
from benchmarks._sharded_hosts import (
    COUNTED,
    GROUP_SECONDS,
    IN_FEATURES,
    OUT_FEATURES,
    PEER_SECONDS,
    RELAY_PORTS,
    VARIANTS,
    RankHost,
    RelayHost,
    WorkerHost,
    layers_for,
)
from benchmarks._turns import take_turns
from benchmarks.tree import _tx_bytes
from tests.netns import Topology
from zmqsync.chunking.layout import DEFAULT_CHUNK_BYTES

#: How long the ranks, relays and workers may take to start (spawn, import torch, build
#: and shard the model, join the group) on a loaded 2-core machine.
START_SECONDS: Final = 600
#: How long one version, and then its check on every worker, may take.
SEND_SECONDS: Final = PEER_SECONDS + 60
CHECK_SECONDS: Final = 300
#: The target: at M > 1 the sharded send takes at most 1/(TARGET * M) of gather-then-send.
TARGET: Final = 0.8
#: What a failed relay run says while relays cannot front a sharded learner.
RELAY_HINT: Final = (
    "--relays: the relays could not front the sharded learner; a relay in this tree may "
    "not front a sharded learner yet (run without --relays for the flat rows)"
)


def _hosts(ranks: int, relays: int) -> list[str]:
    return [*[f"rank{r}" for r in range(ranks)], *[f"relay{i}" for i in range(relays)], "work"]


def _start(
    topo: Topology,
    ranks: int,
    relays: int,
    workers: int,
    sizes: tuple[int, int],
    pools: list[WorkerPool],
) -> list[dict[str, float]]:
    """The ranks, relays and workers, started and met (their pools appended to
    ``pools``, ranks first, workers last); each rank's set-up memory per variant.
    ``sizes``: the model's layers, and the chunk size in bytes."""
    layers, chunk_bytes = sizes
    rank_pool = WorkerPool(
        RankHost,
        [
            (
                topo.namespace(f"rank{r}"),
                r,
                ranks,
                topo.address("rank0"),
                layers,
                relays or workers,
                chunk_bytes,
            )
            for r in range(ranks)
        ],
        torch_threads=1,
        name="bench-rank",
    )
    pools.append(rank_pool)
    rank_pool.start(START_SECONDS)
    upstream = {v: rank_pool.call([0], "endpoint", (v,), 30)[0] for v in VARIANTS}
    connecting = rank_pool.post(range(ranks), "connect", (GROUP_SECONDS,))
    if relays:
        relay_pool = WorkerPool(
            RelayHost,
            [(topo.namespace(f"relay{i}"), i, upstream, chunk_bytes) for i in range(relays)],
            torch_threads=1,
            name="bench-relay",
        )
        pools.append(relay_pool)
        try:
            relay_pool.start(START_SECONDS)
        except WorkerError as exc:
            last = str(exc).strip().splitlines()[-1]
            raise RuntimeError(f"{RELAY_HINT} (a relay said: {last})") from exc
        ends = [
            {v: f"tcp://{topo.address(f'relay{i % relays}')}:{RELAY_PORTS[v]}" for v in VARIANTS}
            for i in range(workers)
        ]
    else:
        ends = [dict(upstream) for _ in range(workers)]
    worker_pool = WorkerPool(
        WorkerHost,
        [(topo.namespace("work"), i, layers, ends[i]) for i in range(workers)],
        torch_threads=1,
    )
    pools.append(worker_pool)
    worker_pool.start(START_SECONDS)
    setup = rank_pool.collect(connecting, "connect", GROUP_SECONDS + 60)
    print("set-up memory per rank (MiB):", setup, flush=True)
    return setup


def _version(
    topo: Topology, ranks: WorkerPool, workers: WorkerPool, variant: str, value: float
) -> dict[str, Any]:
    """One version sent the ``variant`` way and checked on every worker."""
    names = [topo.namespace(f"rank{r}") for r in range(ranks.size)]
    before = [_tx_bytes(ns) for ns in names]
    replies = ranks.call(range(ranks.size), "send", (variant,), SEND_SECONDS)
    egress = [_tx_bytes(ns) - b for ns, b in zip(names, before, strict=True)]
    held = workers.call(range(workers.size), "check", (variant, value), CHECK_SECONDS)
    if not all(held):
        raise RuntimeError(f"{variant}: a worker does not hold version {value}")
    return {
        "seconds": max(r["seconds"] for r in replies),
        "egress": egress,
        "extra_mib": [r["extra_mib"] for r in replies],
        "rss_peak_mib": [r["rss_peak_mib"] for r in replies],
        **{name: [r[name] for r in replies] for name in COUNTED},
    }


def run(
    ranks: int, relays: int, workers: int, mib: int, repeats: int, rate: str, chunk_bytes: int
) -> dict[str, Any]:
    """Both variants with ``ranks`` learner ranks: their medians and per-rank figures."""
    layers = layers_for(mib)
    with Topology(_hosts(ranks, relays)) as topo:
        for host in _hosts(ranks, relays)[:-1]:  # every host but the workers'
            topo.shape(host, rate=rate, burst="256kb", latency="200ms")
        pools: list[WorkerPool] = []
        try:
            setup = _start(topo, ranks, relays, workers, (layers, chunk_bytes), pools)
            versions: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            value = 0.0
            for rep, variant in take_turns(list(VARIANTS), repeats):
                value += 1.0
                try:
                    got = _version(topo, pools[0], pools[-1], variant, value)
                except Exception as exc:
                    if relays and variant == "sharded":
                        raise RuntimeError(RELAY_HINT) from exc
                    raise
                print(f"M={ranks} {variant:8s} round {rep}: {got}", flush=True)
                got["round"] = rep
                versions[variant].append(got)
            return _summary(versions, setup, ranks, layers)
        finally:
            for pool in reversed(pools):
                pool.close()


def _summary(
    versions: dict[str, list[dict[str, Any]]],
    setup: list[dict[str, float]],
    ranks: int,
    layers: int,
) -> dict[str, Any]:
    """Each variant's median time and per-rank medians over the counted rounds (round 0
    warms up); memory: the set-up plus the most any version took."""
    out: dict[str, Any] = {
        "ranks": ranks,
        "model_bytes": layers * (IN_FEATURES + 1) * OUT_FEATURES * 4,
    }
    for variant, rows in versions.items():
        counted = [r for r in rows if r["round"] > 0]
        out[variant] = {
            "median_s": statistics.median(r["seconds"] for r in counted),
            "times_s": [r["seconds"] for r in counted],
            "egress_per_rank": [
                statistics.median(r["egress"][k] for r in counted) for k in range(ranks)
            ],
            **{
                f"{name}_per_rank": [
                    statistics.median(r[name][k] for r in counted) for k in range(ranks)
                ]
                for name in COUNTED
            },
            "rss_peak_mib_per_rank": [
                max(r["rss_peak_mib"][k] for r in rows) for k in range(ranks)
            ],
            "memory_mib_per_rank": [
                setup[k][variant] + max(r["extra_mib"][k] for r in rows) for k in range(ranks)
            ],
        }
    out["ratio"] = out["sharded"]["median_s"] / out["gather"]["median_s"]
    return out


def _line(row: dict[str, Any], workers: int, relays: int) -> str:
    size = row["model_bytes"]
    parts = [f"M={row['ranks']} N={workers} R={relays}"]
    for variant in VARIANTS:
        v = row[variant]
        egress = "/".join(f"{e / size:.2f}" for e in v["egress_per_rank"])
        memory = "/".join(f"{m:.0f}" for m in v["memory_mib_per_rank"])
        parts.append(
            f"{variant} {v['median_s']:7.2f} s, egress {egress} models, memory {memory} MiB"
        )
    m = row["ranks"]
    target = "" if m == 1 else f" (target <= {1 / (TARGET * m):.3f})"
    parts.append(f"sharded/gather {row['ratio']:.3f}{target}")
    return "  |  ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__)
    parser.add_argument("--ranks", default="1,2,4", help="learner sizes M")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--relays", type=int, default=0, help="workers behind R relays")
    parser.add_argument("--mib", type=int, default=256, help="model size in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="counted versions per variant")
    parser.add_argument("--rate", default="500mbit", help="every rank's link rate (tbf)")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=DEFAULT_CHUNK_BYTES // 1024,
        help="chunk size (default: the senders' own)",
    )
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
    started = time.monotonic()
    for m in [int(x) for x in args.ranks.split(",")]:
        row = run(
            m, args.relays, args.workers, args.mib, args.repeats, args.rate, args.chunk_kib * 1024
        )
        row.update(workers=args.workers, relays=args.relays, rate=args.rate)
        out["rows"].append(row)
        print(_line(row, args.workers, args.relays), flush=True)
    out["wall_s"] = time.monotonic() - started
    with contextlib.suppress(OSError), open("/proc/loadavg") as f:
        out["loadavg_end"] = f.read().split()[:3]
    write_json(args.json, out)
    print(f"model {out['rows'][0]['model_bytes'] / MIB:.0f} MiB, wall {out['wall_s']:.0f} s")
    return out


if __name__ == "__main__":
    main()
