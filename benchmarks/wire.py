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
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks._results import machine_info

MIB = 1 << 20
VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"retain_snapshot": False},
    "bfloat16": {"retain_snapshot": False, "wire_dtype": torch.bfloat16},
    "delta5": {"delta": True},
}
#: The share of the model's elements a delta5 version changes.
DELTA_SHARE = 0.05


def _model(mib: int, value: float) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in 16 tensors (and 64 small ones, as a real model has)."""
    n = mib * MIB // 4 // 16
    out = {f"layer{i}.weight": torch.full((n,), value) for i in range(16)}
    out.update({f"layer{i}.bias": torch.full((256,), value) for i in range(64)})
    return out


def _worker(index: int, mib: int, endpoints: dict[str, str], control: Any, results: Any) -> None:
    from zmqsync import WeightReceiver, checksum
    from zmqsync.transport.zmq_pubsub import PubSubSpoke

    models = {name: _model(mib, 0.0) for name in endpoints}
    receivers = {
        name: WeightReceiver(
            PubSubSpoke(endpoint, identity=f"{name}-{index}"),
            model=models[name],
            strategy="state_dict",
            worker_idx=index,
            timeout=120,
        )
        for name, endpoint in endpoints.items()
    }
    for r in receivers.values():
        r.connect(timeout=120)
        r.start()
    results.put(("ready", index, None))
    while True:
        what = control.get(timeout=900)
        if what == "stop":
            break
        name, value, digest = what
        with receivers[name].lock:
            if digest:
                exact = checksum(models[name]) == digest
            else:
                exact = all(bool((t == value).all()) for t in models[name].values())
        results.put(("checked", index, exact))
    for r in receivers.values():
        r.close()


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

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
    for mib in [int(x) for x in args.mib.split(",")]:
        learners = {name: _model(mib, 1.0) for name in variants}
        senders = {
            name: WeightSender(
                PubSubHub("tcp://127.0.0.1:*"),
                model=learners[name],
                strategy="state_dict",
                num_workers=args.workers,
                timeout=120,
                **options,
            )
            for name, options in variants.items()
        }
        endpoints = {name: s.endpoint for name, s in senders.items()}
        controls = [ctx.Queue() for _ in range(args.workers)]
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(i, mib, endpoints, controls[i], results))
            for i in range(args.workers)
        ]
        for p in procs:
            p.start()
        try:
            for _ in procs:
                results.get(timeout=300)
            times: dict[str, list[float]] = {name: [] for name in variants}
            bytes_sent: dict[str, int] = dict.fromkeys(variants, 0)
            order = list(variants)
            value = 1.0
            for rep in range(args.repeats + 1):  # the first round warms up
                for name in order if rep % 2 == 0 else order[::-1]:
                    value += 1.0
                    digest = ""
                    with torch.no_grad():
                        if name == "delta5":
                            big = learners[name][f"layer{rep % 16}.weight"]
                            big[: int(DELTA_SHARE * 16 * big.numel())].fill_(value)
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
                    for c in controls:
                        c.put((name, value, digest))
                    checked = [results.get(timeout=120) for _ in procs]
                    if not all(ok for _, _, ok in checked):
                        raise RuntimeError(f"{name}: a worker does not hold version {value}")
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
            print("  |  ".join(line), flush=True)
        finally:
            for c in controls:
                c.put("stop")
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
            for s in senders.values():
                s.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
