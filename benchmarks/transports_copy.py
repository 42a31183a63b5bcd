"""The learner's chunk copies, by numpy or by torch's thread pool, right after a torch op.

The question of issue 35: the learner's last torch op (an optimizer step) leaves torch's
OpenMP threads spinning on the cores for a while; zmqsync's copy of each chunk into its
own memory (``StreamLayout.write``: numpy, one thread) then competes with them, where a
copy by torch (``Tensor.copy_``) would run on those very threads. This measures, in one
process and taking turns, a model's stream copied chunk by chunk into a ring of chunk
buffers right after an in-place ``add_`` on the model (as each version of the peers
benchmark is made), three ways: numpy (what zmqsync does), torch's ``copy_`` per chunk
(on the calling thread's intra-op pool), and one numpy copy of the whole model (memcpy,
the bound). Median ms per stream, and each way's ratio to memcpy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import torch

PROG: Final = "python -m benchmarks.transports_copy"
MIB: Final = 1 << 20


def _ways(model: torch.Tensor, chunk: int, ring_slots: int) -> dict[str, Callable[[], None]]:
    """The copies compared, each a whole stream of ``model``'s bytes."""
    source = model.view(torch.uint8)
    src = source.numpy()
    n = src.nbytes
    ring = [torch.empty(chunk, dtype=torch.uint8) for _ in range(ring_slots)]
    ring_np = [r.numpy() for r in ring]
    whole = np.empty(n, dtype=np.uint8)
    spans = [(i, min(chunk, n - i)) for i in range(0, n, chunk)]

    def by_numpy() -> None:
        for k, (at, length) in enumerate(spans):
            np.copyto(ring_np[k % ring_slots][:length], src[at : at + length])

    def by_torch() -> None:
        with torch.no_grad():
            for k, (at, length) in enumerate(spans):
                ring[k % ring_slots][:length].copy_(source[at : at + length])

    def memcpy() -> None:
        np.copyto(whole, src)

    return {"numpy chunks": by_numpy, "torch chunks": by_torch, "memcpy": memcpy}


def measure(mib: int, chunk_mib: int, repeats: int) -> dict[str, float]:
    """Median seconds per stream of each way, taking turns after an ``add_`` each."""
    model = torch.zeros(mib * MIB // 4)
    ways = _ways(model, chunk_mib * MIB, ring_slots=4)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, copy in ways.items():
            model.add_(1.0)  # torch's pool is hot now, as after an optimizer step
            start = time.perf_counter()
            copy()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=128, help="model size in MiB (default 128)")
    p.add_argument("--chunk-mib", type=int, default=8, help="chunk size in MiB (default 8)")
    p.add_argument("--repeats", type=int, default=10, help="streams per way (default 10)")
    args = p.parse_args(argv)
    if min(args.mib, args.chunk_mib, args.repeats) < 1:
        p.error("--mib, --chunk-mib and --repeats must be positive")
    medians = measure(args.mib, args.chunk_mib, args.repeats)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{args.mib} MiB in {args.chunk_mib} MiB chunks, torch threads "
        f"{torch.get_num_threads()}, load average {load}"
    )
    for name, seconds in medians.items():
        print(f"  {name:13} {seconds * 1e3:8.2f} ms  {seconds / medians['memcpy']:5.2f}x memcpy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
