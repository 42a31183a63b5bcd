"""Bytes and time per version over tcp: whole, with ``wire_dtype``, and as deltas.

A float32 model to ``--workers`` worker processes over ``tcp://127.0.0.1`` (PUB/SUB),
one sender per variant, the variants taking turns version by version (A B C C B A ...):

- ``float32``: the default, every tensor's own bytes, every tensor changed;
- ``bfloat16``: ``wire_dtype=torch.bfloat16``, each float cast chunk by chunk on the
  learner and back on each worker;
- ``delta5``: ``delta=True``, and each version changes 5% of the model's elements (a
  stretch of one tensor, a different one each version).

Bytes per version are the sender's own counter (``status()["totals"]["bytes_sent"]``
over the versions sent), so they are what went on the wire, per worker. Each worker checks
that it holds exactly what the learner sent (cast back, for bfloat16) after every block.

Run ``python -m benchmarks.wire --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Any, Final

import torch

from benchmarks._models import MIB
from benchmarks._pool import WorkerPool
from benchmarks._results import machine_info, write_json
from benchmarks._turns import PEER_SECONDS, Receivers, check_workers, float_model, take_turns

VARIANTS: Final[dict[str, dict[str, Any]]] = {
    "float32": {"retain_snapshot": False},
    "bfloat16": {"retain_snapshot": False, "wire_dtype": torch.bfloat16},
    "delta5": {"delta": True},
}
#: The share of the model's elements a delta5 version changes.
DELTA_SHARE: Final = 0.05
#: The model: 16 equal weights (and 64 small biases, as a real model has).
WEIGHTS: Final = 16
BIASES: Final = 64
#: How long the workers may take to start and join every learner.
START_SECONDS: Final = 300


def _model(mib: int, value: float) -> dict[str, torch.Tensor]:
    return float_model(mib, value, weights=WEIGHTS, biases=BIASES)


def _worker(index: int, mib: int, endpoints: dict[str, str]) -> Receivers:
    model = functools.partial(_model, mib, 0.0)
    return Receivers(index, endpoints, model, identity="{name}-{index}")


def _line(mib: int, rows: dict[str, dict[str, Any]]) -> str:
    """A size's line: each variant's time and bytes per version, against float32's."""
    base = rows.get("float32")
    line = [f"{mib:5d} MiB"]
    for name, row in rows.items():
        ms, size = row["median_ms"], row["bytes_per_version_per_worker"]
        line.append(f"{name} {ms:8.2f} ms {size / MIB:8.2f} MiB")
        if base is not None and row is not base:
            line[-1] += (
                f" (bytes {size / base['bytes_per_version_per_worker']:.3f}x,"
                f" time {ms / base['median_ms']:.3f}x)"
            )
    return "  |  ".join(line)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wire", description=__doc__)
    parser.add_argument("--mib", default="16,128,512", help="model sizes in MiB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8, help="versions per variant and size")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which, in order")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}

    from zmqsync import WeightSender, checksum
    from zmqsync.transport.zmq_pubsub import PubSubHub

    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
    for mib in [int(x) for x in args.mib.split(",")]:
        learners = {name: _model(mib, 1.0) for name in variants}
        senders = {
            name: WeightSender(
                PubSubHub("tcp://127.0.0.1:*"),
                model=learners[name],
                strategy="state_dict",
                num_workers=args.workers,
                timeout=PEER_SECONDS,
                **options,
            )
            for name, options in variants.items()
        }
        endpoints = {name: s.endpoint for name, s in senders.items()}
        pool = WorkerPool(_worker, [(i, mib, endpoints) for i in range(args.workers)])
        try:
            pool.start(START_SECONDS)
            times: dict[str, list[float]] = {name: [] for name in variants}
            bytes_sent: dict[str, int] = dict.fromkeys(variants, 0)
            value = 1.0
            for rep, name in take_turns(list(variants), args.repeats):
                value += 1.0
                digest = ""
                with torch.no_grad():
                    if name == "delta5":
                        big = learners[name][f"layer{rep % WEIGHTS}.weight"]
                        big[: int(DELTA_SHARE * WEIGHTS * big.numel())].fill_(value)
                        digest = checksum(learners[name])
                    else:
                        for t in learners[name].values():
                            t.fill_(value)  # representable in bfloat16: exact both ways
                before = senders[name].status()["totals"]["bytes_sent"]
                started = time.perf_counter()
                senders[name].send()
                if rep:
                    times[name].append(time.perf_counter() - started)
                    bytes_sent[name] += senders[name].status()["totals"]["bytes_sent"] - before
                check_workers(pool, name, value, digest)
            rows = {
                name: {
                    "mib": mib,
                    "variant": name,
                    "median_ms": 1000 * statistics.median(times[name]),
                    "bytes_per_version_per_worker": bytes_sent[name]
                    / len(times[name])
                    / args.workers,
                }
                for name in variants
            }
            out["rows"].extend(rows.values())
            print(_line(mib, rows), flush=True)
        finally:
            pool.close()
            for s in senders.values():
                s.close()
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
