"""Lent tensors whose write takes longer than the workers' ``chunk_timeout``.

A worker that lent its tensors holds its lock from its go until the learner says the
version is in, or until ``chunk_timeout`` passes with no word from it: then it takes its
tensors back (the learner may have gone quiet mid-write). A large model written into
several workers at once can take longer than that while the learner is alive and busy;
the learner asks the workers again as it writes so that they hold on.

This runs the real scheme the way a user does: ``MultiProcessWeightSyncScheme`` given
the learner's state_dict, K spawned workers with ``init_on_worker(...,
chunk_timeout=...)``, a receiver thread each, and ``send()`` timed after an in-place
change of one tensor. It prints the median and p90 send, and what the workers counted:
versions written into their lent tensors, taken back mid-write, torn, and the learner's
asks while it wrote. Every worker's tensors are compared with the learner's at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any, Final

import torch

from benchmarks._models import Layout, digest, make_state_dict

PROG: Final = "python -m benchmarks.lent_long_writes"
#: Seconds any one step (a worker's start, connect, a reply) may take.
_WAIT_S: Final = 120.0
_COUNTS: Final = ("lent_applied", "lent_taken_back", "torn", "lent_still_writing")


def _worker(scheme: Any, pipe: Any, control: Connection, layout: Layout, gap: float) -> None:
    state_dict = make_state_dict(layout, fill="zeros")
    scheme.init_on_worker("policy", pipe=pipe, model=state_dict, chunk_timeout=gap)
    scheme.connect(timeout=_WAIT_S)
    scheme.start_receiver_thread()
    try:
        if control.poll(_WAIT_S * 10):
            control.recv()
        with scheme.lock:
            stats = scheme.get_receiver().stats
            control.send(({k: stats.get(k, 0) for k in _COUNTS}, digest(state_dict)))
        if control.poll(_WAIT_S):
            control.recv()
    finally:
        scheme.shutdown()


def measure(layout: Layout, workers: int, gap: float, sends: int, timeout: float) -> dict[str, Any]:
    """Median and p90 send (ms), the workers' counts (summed), and whether each worker's
    tensors are the learner's at the end."""
    from zmqsync import MultiProcessWeightSyncScheme

    ctx = mp.get_context("spawn")
    model = make_state_dict(layout, fill="random")
    pipes = [ctx.Pipe(duplex=True) for _ in range(workers)]
    controls = [ctx.Pipe() for _ in range(workers)]
    scheme = MultiProcessWeightSyncScheme("state_dict", timeout=timeout)
    scheme.init_on_sender("policy", pipes=[a for a, _ in pipes], model=model)
    procs = [
        ctx.Process(
            target=_worker, args=(scheme, pipes[i][1], controls[i][1], layout, gap), daemon=True
        )
        for i in range(workers)
    ]
    times: list[float] = []
    try:
        for p in procs:
            p.start()
        scheme.connect(timeout=_WAIT_S)
        tensors = list(model.values())
        for i in range(sends + 2):  # two untimed: the first versions stream, then lending
            with torch.no_grad():
                tensors[i % len(tensors)].add_(1)
            start = time.perf_counter()
            scheme.send()
            if i >= 2:
                times.append(time.perf_counter() - start)
        want = digest(model)
        counts = dict.fromkeys(_COUNTS, 0)
        exact = 0
        for control, _ in controls:
            control.send("report")
            if not control.poll(_WAIT_S):
                raise TimeoutError("a worker did not report")
            got, held = control.recv()
            for k in _COUNTS:
                counts[k] += got[k]
            exact += held == want
        for control, _ in controls:
            control.send("stop")
    finally:
        for p in procs:
            p.join(_WAIT_S / 4)
            if p.is_alive():
                p.kill()
        scheme.shutdown()
    ordered = sorted(times)
    return {
        "median": statistics.median(times) * 1e3,
        "p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "exact": exact,
        **counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb-per-tensor", type=int, default=128)
    parser.add_argument("--tensors", type=int, default=8, help="of --mb-per-tensor each")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--chunk-timeout", type=float, default=0.25, help="the workers'")
    parser.add_argument("--sends", type=int, default=20)
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="the scheme's, for each send (seconds)"
    )
    args = parser.parse_args()
    rows = args.mb_per_tensor * 256  # float32 rows of 1024
    layout = Layout(f"{args.tensors}x{args.mb_per_tensor}MB", args.tensors, (rows, 1024))
    got = measure(layout, args.workers, args.chunk_timeout, args.sends, args.timeout)
    print(
        "| model | K | chunk_timeout s | send ms (median / p90) | workers exact "
        "| lent_applied | lent_taken_back | torn | lent_still_writing |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {layout.nbytes / 2**30:.2f} GiB | {args.workers} | {args.chunk_timeout:g} "
        f"| {got['median']:.1f} / {got['p90']:.1f} | {got['exact']}/{args.workers} "
        f"| {got['lent_applied']} | {got['lent_taken_back']} | {got['torn']} "
        f"| {got['lent_still_writing']} |"
    )


if __name__ == "__main__":
    main()
