"""Memory of K workers on the learner's host: each with its own copy of the weights
(the default) against one read-only copy shared by all (``apply_mode="shared"``).

Each process reports, from ``/proc/self/smaps_rollup``, ``Pss_Anon + Pss_Shmem``: its
private memory plus its share of each shared-memory page it maps with others (summed
over processes: the host's real memory for data; the libraries' file pages, shared by
every Python process, are left out). Each process's figure before it built a model (an
interpreter with torch) is subtracted, so "model copies" is the memory the weights
take, in models. Each worker's ``Rss`` and ``Shared_Clean + Shared_Dirty`` (pages it
maps that others map too, whole, libraries included) are shown besides.

    python -m benchmarks.shared_weights --workers 4 --mb 64 --transport pipe

``--transport ray``: the workers are Ray actors on a local Ray cluster (the learner's
host), synced by ``RayWeightSyncScheme`` with its defaults.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

SPAWN = mp.get_context("spawn")


def _rollup() -> dict[str, int]:
    """This process's smaps_rollup fields, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _model(mb: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    width = 1024
    layers = max(1, mb * 1024 * 1024 // (4 * width * width))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _spoke(transport: str, where: Any, idx: int) -> Any:
    if transport == "pipe":
        from zmqsync.transport.pipe import PipeSpoke

        return PipeSpoke(where)
    from zmqsync.transport.zmq_pubsub import PubSubSpoke

    return PubSubSpoke(where, identity=f"w{idx}")


def _mem(rollup: dict[str, int]) -> int:
    """Data memory: private pages plus this process's share of shared-memory pages (the
    libraries' file pages, shared by every Python process, left out)."""
    return rollup.get("Pss_Anon", 0) + rollup.get("Pss_Shmem", 0)


def _worker(transport: str, where: Any, idx: int, mb: int, mode: str, conn: Any) -> None:
    from zmqsync import WeightReceiver

    base = _rollup()
    model = _model(mb, 100 + idx)
    receiver = WeightReceiver(
        _spoke(transport, where, idx), model=model, worker_idx=idx, apply_mode=mode, timeout=60
    )
    receiver.connect()
    receiver.start()
    conn.send("ready")
    while conn.recv() != "touch":
        pass
    with receiver.lock:
        # Read every weight, as forward passes do: pages never read are not resident.
        touched = sum(float(p.detach().sum()) for p in model.parameters())
    conn.send("touched")
    while conn.recv() != "report":
        pass
    conn.send({"base": base, "now": _rollup(), "stats": dict(receiver.stats), "t": touched})
    conn.recv()
    receiver.close()


def _ray_actor_class() -> Any:
    """The Ray actor that plays a worker (made here: importing this module needs no Ray)."""
    import ray

    from zmqsync import WeightSyncActorMixin

    @ray.remote(num_cpus=0)
    class RayWorker(WeightSyncActorMixin):
        def __init__(self, scheme: Any, idx: int, mb: int, mode: str) -> None:
            self.base = _rollup()
            self.model = _model(mb, 100 + idx)
            self.scheme = scheme
            scheme.init_on_worker("policy", model=self.model, apply_mode=mode)

        def touch(self) -> float:
            with self.scheme.lock:
                return sum(float(p.detach().sum()) for p in self.model.parameters())

        def report(self) -> dict[str, Any]:
            stats = dict(self.scheme.get_receiver().stats)
            return {"base": self.base, "now": _rollup(), "stats": stats}

    return RayWorker


def _run_ray(workers: int, mb: int, mode: str, versions: int) -> tuple[Any, list, list]:
    """The learner and ``workers`` Ray actors; returns (model, send times, reports)."""
    import ray

    from zmqsync import RayWeightSyncScheme

    model = _model(mb, 0)
    scheme = RayWeightSyncScheme(timeout=60)
    actor_class = _ray_actor_class()
    actors = [actor_class.remote(scheme, i, mb, mode) for i in range(workers)]
    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=120)
        scheme.init_on_sender("policy", remote_collectors=actors, source_model=model)
        scheme.connect(timeout=120)
        times = _send_versions(model, scheme.send, versions)
        ray.get([a.touch.remote() for a in actors], timeout=60)  # every actor first
        reports = ray.get([a.report.remote() for a in actors], timeout=60)
    finally:
        scheme.shutdown()
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return model, times, reports


def _send_versions(model: nn.Module, send: Any, versions: int) -> list[float]:
    """Change the model and ``send()`` it ``versions`` times; each send's milliseconds."""
    times = []
    for _ in range(versions):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        t0 = time.perf_counter()
        send()
        times.append((time.perf_counter() - t0) * 1e3)
    time.sleep(0.5)  # releases land
    return times


def run(transport: str, workers: int, mb: int, mode: str, versions: int, tmp: str) -> dict:
    """One fleet: the learner sends ``versions`` versions; returns the memory table row."""
    from zmqsync import WeightSender

    base = _rollup()
    if transport == "ray":
        model, times, reports = _run_ray(workers, mb, mode, versions)
        return _row(transport, mode, model, times, base, reports)
    model = _model(mb, 0)
    if transport == "pipe":
        from zmqsync.transport.pipe import PipeHub

        pairs = [SPAWN.Pipe() for _ in range(workers)]
        hub: Any = PipeHub([p for p, _ in pairs])
        where: list[Any] = [c for _, c in pairs]
    else:
        from zmqsync.transport.zmq_pubsub import PubSubHub

        hub = PubSubHub(f"ipc://{tmp}/shared-bench-{mode}")
        where = [hub.endpoint] * workers
    sender = WeightSender(hub, model=model, num_workers=workers, timeout=60)
    sender.publish()
    conns, procs = [], []
    for i in range(workers):
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=_worker, args=(transport, where[i], i, mb, mode, child))
        proc.start()
        conns.append(parent)
        procs.append(proc)
    for c in conns:
        assert c.poll(120) and c.recv() == "ready"
    times = _send_versions(model, sender.send, versions)
    # Every worker reads its weights before any reports: a shared page's Pss is its size
    # over the processes that have it resident then, so a worker that reported before
    # the others had read theirs counted more than its share.
    for c in conns:
        c.send("touch")
    for c in conns:
        assert c.poll(60) and c.recv() == "touched"
    reports = []
    for c in conns:
        c.send("report")
        assert c.poll(60)
        reports.append(c.recv())
    row = _row(transport, mode, model, times, base, reports, sender.status()["totals"]["stalls"])
    for c in conns:
        c.send("stop")
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    sender.close()
    return row


def _row(
    transport: str,
    mode: str,
    model: nn.Module,
    times: list[float],
    base: dict,
    reports: list,
    stalls: int | None = None,
) -> dict:
    """The table row of one fleet, from the learner's and the workers' rollups, and the
    chunks its sender's window stopped waiting for (None: not known, Ray's scheme)."""
    learner_now = _rollup()
    model_bytes = sum(p.nbytes for p in model.parameters())
    learner = _mem(learner_now) - _mem(base)
    workers_mem = [_mem(r["now"]) - _mem(r["base"]) for r in reports]
    extra = learner + sum(workers_mem)
    row = {
        "transport": transport,
        "mode": mode,
        "K": len(reports),
        "model_MB": model_bytes / 2**20,
        "send_ms_median": statistics.median(times),
        "learner_MB": learner / 2**20,
        "worker_MB": [round(m / 2**20, 1) for m in workers_mem],
        "worker_rss_MB": [round(r["now"]["Rss"] / 2**20) for r in reports],
        "worker_shared_MB": [
            round((r["now"]["Shared_Clean"] + r["now"]["Shared_Dirty"]) / 2**20) for r in reports
        ],
        "total_extra_MB": extra / 2**20,
        "model_copies": extra / model_bytes,
        "mapped": [r["stats"].get("shared_mapped", 0) for r in reports],
        # Chunks the sender's window stopped waiting for (held past its stall limit).
        "stalls": stalls,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--transport", choices=["pipe", "ipc", "ray"], default="pipe")
    parser.add_argument("--tmp", default="/tmp")
    args = parser.parse_args()
    if args.transport == "ray":
        import ray

        # The actors are shipped by value: Ray's workers need not import this module.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    rows = []
    for mode in ("auto", "shared"):
        print(f"running {args.transport} {mode} ...", file=sys.stderr)
        rows.append(run(args.transport, args.workers, args.mb, mode, args.versions, args.tmp))
        print(
            f"  versions mapped per worker: {rows[-1]['mapped']}; "
            f"sender window stalls: {rows[-1]['stalls']}",
            file=sys.stderr,
        )
    print(
        "| transport | mode | K | model MiB | send ms (median) | learner MiB | each worker's "
        "MiB | workers' Rss MiB | workers' shared MiB | total MiB | model copies |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['transport']} | {r['mode']} | {r['K']} | {r['model_MB']:.0f} | "
            f"{r['send_ms_median']:.1f} | {r['learner_MB']:.0f} | {r['worker_MB']} | "
            f"{r['worker_rss_MB']} | {r['worker_shared_MB']} | {r['total_extra_MB']:.0f} | "
            f"{r['model_copies']:.2f} |"
        )


if __name__ == "__main__":
    main()
