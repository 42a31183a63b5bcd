"""Bytes and time per version over tcp, with and without ``wire_dtype``, in one run.

A float32 model to ``--workers`` worker processes over ``tcp://127.0.0.1`` (PUB/SUB),
one sender per variant, the variants taking turns version by version (A B B A ...):

- ``float32``: the default, every tensor's own bytes;
- ``bfloat16``: ``wire_dtype=torch.bfloat16``, each float cast chunk by chunk on the
  learner and back on each worker.

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

from benchmarks._harness import machine_info

MIB = 1 << 20
VARIANTS = {"float32": None, "bfloat16": torch.bfloat16}


def _model(mib: int, value: float) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in 16 tensors (and 64 small ones, as a real model has)."""
    n = mib * MIB // 4 // 16
    out = {f"layer{i}.weight": torch.full((n,), value) for i in range(16)}
    out.update({f"layer{i}.bias": torch.full((256,), value) for i in range(64)})
    return out


def _worker(index: int, mib: int, endpoints: dict[str, str], control: Any, results: Any) -> None:
    from zmqsync import WeightReceiver
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
        name, value = what
        with receivers[name].lock:
            exact = all(bool((t == value).all()) for t in models[name].values())
        results.put(("checked", index, exact))
    for r in receivers.values():
        r.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wire", description=__doc__)
    parser.add_argument("--mib", default="16,128,512", help="model sizes in MiB")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8, help="versions per variant and size")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)

    from zmqsync import WeightSender
    from zmqsync.transport.zmq_pubsub import PubSubHub

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
    for mib in [int(x) for x in args.mib.split(",")]:
        learners = {name: _model(mib, 1.0) for name in VARIANTS}
        senders = {
            name: WeightSender(
                PubSubHub("tcp://127.0.0.1:*"),
                model=learners[name],
                strategy="state_dict",
                num_workers=args.workers,
                timeout=120,
                retain_snapshot=False,
                wire_dtype=wire,
            )
            for name, wire in VARIANTS.items()
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
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            order = list(VARIANTS)
            value = 1.0
            for rep in range(args.repeats + 1):  # the first round warms up
                for name in order if rep % 2 == 0 else order[::-1]:
                    value += 1.0
                    with torch.no_grad():
                        for t in learners[name].values():
                            t.fill_(value)  # representable in bfloat16: exact both ways
                    started = time.perf_counter()
                    senders[name].send()
                    if rep:
                        times[name].append(time.perf_counter() - started)
                    for c in controls:
                        c.put((name, value))
                    checked = [results.get(timeout=120) for _ in procs]
                    if not all(ok for _, _, ok in checked):
                        raise RuntimeError(f"{name}: a worker does not hold version {value}")
            for name in VARIANTS:
                totals = senders[name].status()["totals"]
                row = {
                    "mib": mib,
                    "variant": name,
                    "median_ms": 1000 * statistics.median(times[name]),
                    "bytes_per_version_per_worker": totals["bytes_sent"]
                    / totals["versions_sent"]
                    / args.workers,
                }
                out["rows"].append(row)
            f32, bf16 = out["rows"][-2:]
            a, b = f32["bytes_per_version_per_worker"], bf16["bytes_per_version_per_worker"]
            print(
                f"{mib:5d} MiB  float32 {f32['median_ms']:8.2f} ms {a / MIB:8.1f} MiB  |  "
                f"bfloat16 {bf16['median_ms']:8.2f} ms {b / MIB:8.1f} MiB  |  bytes {b / a:.3f}x"
                f"  speed-up {f32['median_ms'] / bf16['median_ms']:.2f}x",
                flush=True,
            )
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
