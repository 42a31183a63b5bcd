"""Sync latency: zmqsync's ``send()`` against a hand-written pyzmq baseline (issue 2).

Measures, for each cell (model size x K workers x transport x mode), the wall time from
the start of ``send`` to the last worker's ack, every worker's tensors updated in place,
for three variants run side by side, each with K worker processes of its own (sharing a
process, they would share its malloc state, and one's frees would decide the other's
page faults):

- ``baseline``: hand-written pyzmq, zero-copy (see :mod:`benchmarks._baseline`);
- ``zmqsync``: ``ZMQWeightSyncScheme("state_dict", mode=...)`` with its defaults
  (``retain_snapshot=True``: keeps a copy of the latest version for late joiners);
- ``zmqsync-noretain``: the same with ``retain_snapshot=False``.

Within a cell the variants take turns send by send, A B C A B C ... for half the
repeats, then C B A ..., so a slow spell of a shared machine hits them alike (blocks of
sends per variant let one such spell decide a cell's ratio). The learner's extra memory
is measured apart, over a few sends of each variant on its own, from just before its
first send (bytes held from malloc, and anonymous RSS: see
:class:`benchmarks._memory.PeakMemoryMeter`); its sampling thread never runs while
sends are timed.

Run ``python -m benchmarks.sync_latency --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from benchmarks._command import (
    DEFAULT_TIMEOUT,
    FEWEST_REPEATS,
    add_outputs,
    csv_list,
    grid_parser,
    raise_exit,
    repeats_for,
    scratch_dir,
    settle_grid,
)
from benchmarks._latency_variants import BaselineVariant, StateDict, Variant, ZmqsyncVariant
from benchmarks._latency_worker import Sessions
from benchmarks._memory import PeakMemoryMeter
from benchmarks._models import (
    DEVICE_ENV,
    SIZES,
    Layout,
    bump,
    describe_models,
    digest,
    make_state_dict,
)
from benchmarks._pool import WorkerPool
from benchmarks._results import Run, VariantResult, ms, pct

PROG: Final = "python -m benchmarks.sync_latency"
#: The target the issue sets: zmqsync within this factor of the baseline...
RATIO_TARGET: Final = 1.2
#: ...and the learner's peak extra memory under this share of the model.
MEMORY_TARGET: Final = 0.10
#: Timed sends per variant and cell, by size (``--repeats`` scales them all).
DEFAULT_REPEATS: Final[dict[str, int]] = {"1MB": 30, "16MB": 16, "128MB": 6, "2000x4KB": 30}
#: The sizes that get a fifth of ``--repeats``.
SLOW_SIZES: Final = ("128MB",)
#: Untimed sends at the start of each block (sockets, caches, lazily built schemas).
DEFAULT_WARMUP: Final = 1
#: Sends per variant (after warmup) while its memory is measured, apart from the timing.
MEMORY_SENDS: Final = 3
#: Variants per cell (baseline, zmqsync, zmqsync without the snapshot), each with K
#: worker processes of its own.
VARIANTS: Final = 3


class WrongWeights(RuntimeError):
    """A worker does not hold the learner's weights after a send that it acked."""


# --- one cell ---------------------------------------------------------------------------


@dataclass
class Cell:
    """One row of the table: a size, K workers, a transport and a mode."""

    size: str
    workers: int
    transport: str
    mode: str
    results: dict[str, VariantResult] = field(default_factory=dict)

    def ratio(self, variant: str) -> float:
        return self.results[variant].median_ms() / self.results["baseline"].median_ms()

    def extra_pct(self, variant: str) -> float | None:
        return self.results[variant].extra_pct(SIZES[self.size].nbytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "model_bytes": SIZES[self.size].nbytes,
            "workers": self.workers,
            "transport": self.transport,
            "mode": self.mode,
            "ratio": self.ratio("zmqsync"),
            "ratio_noretain": self.ratio("zmqsync-noretain"),
            "variants": {
                name: r.to_json(SIZES[self.size].nbytes) for name, r in self.results.items()
            },
        }


def run_cell(
    pool: WorkerPool,
    model: StateDict,
    cell: Cell,
    *,
    repeats: int,
    warmup: int,
    timeout: float,
    workdir: str,
    tag: str,
    options: Mapping[str, Any] | None = None,
) -> Cell:
    """Open the three variants for ``cell``, measure each one's memory alone, time them
    taking turns send by send (A B C ..., C B A ...), check the workers."""
    variants: list[Variant] = [
        BaselineVariant(cell.mode, cell.transport, workdir, tag, timeout),
        *(
            ZmqsyncVariant(
                cell.mode,
                cell.transport,
                workdir,
                tag,
                timeout,
                retain_snapshot=retain,
                options=options,
            )
            for retain in (True, False)
        ),
    ]
    assert len(variants) == VARIANTS
    # Each variant's workers are processes of their own: variants sharing a process
    # share its malloc state (glibc's mmap and trim thresholds are process-wide), and
    # one variant's frees then decide whether the other's next receive faults its
    # pages in (see benchmarks/README.md).
    stride = pool.size // len(variants)
    procs = {v.name: range(j * stride, j * stride + cell.workers) for j, v in enumerate(variants)}
    opened: list[Variant] = []
    step = 0
    try:
        for v in variants:
            v.open(pool, procs[v.name], cell.size, model)
            opened.append(v)
            cell.results[v.name] = VariantResult()
        # Memory: each variant alone, from just before its first send.
        for v in variants:
            result = cell.results[v.name]
            with PeakMemoryMeter() as meter:
                for _ in range(warmup + MEMORY_SENDS):
                    bump(model, step)
                    step += 1
                    v.send()
            result.extra_bytes, result.retained_bytes = meter.extra, meter.retained
            if shm := v.shared_bytes():
                result.extra_bytes = {**result.extra_bytes, "shm": shm}
        # Time: the variants take turns send by send (A B C A B C ..., then C B A ...), so
        # a slow spell of this shared machine hits them alike instead of one block.
        halves = (math.ceil(repeats / 2), repeats // 2)
        for round_no, order in enumerate((variants, variants[::-1])):
            for i in range(warmup + halves[round_no]):
                for v in order:
                    bump(model, step)
                    step += 1
                    start = time.perf_counter()
                    v.send()
                    elapsed = time.perf_counter() - start
                    if i >= warmup:
                        cell.results[v.name].times.append(elapsed)
        # Every variant sends the model as it is now, then every worker's copy must match.
        for v in variants:
            v.send()
        expected = digest(model)
        for v in variants:
            replies = pool.call(procs[v.name], "digest", (v.name,), timeout)
            wrong = [i for i, r in enumerate(replies) if r["digest"] != expected]
            if wrong:
                raise WrongWeights(
                    f"{v.name}: workers {wrong} do not hold the learner's weights after the "
                    f"final send ({cell.size}, K={cell.workers}, {cell.transport}, {cell.mode})"
                )
    finally:
        try:
            pool.call([p for v in variants for p in procs[v.name]], "close", (), timeout)
        except Exception as exc:  # the cell's own error, if any, is the one to raise
            print(f"warning: closing the workers' sessions failed: {exc}", file=sys.stderr)
        for v in opened:
            v.close()
    return cell


# --- output -------------------------------------------------------------------------------


def _ratio(x: float) -> str:
    text = f"{x:.2f}"
    return f"**{text}**" if x > RATIO_TARGET else text


def markdown(cells: Sequence[Cell], run: Run) -> str:
    """The README's table: one row per cell, then a summary and the machine."""
    lines = [
        "| size | K | transport | mode | baseline ms (median / p90) | zmqsync ms (median / p90)"
        " | ratio | zmqsync no-retain ms (median / p90) | ratio no-retain"
        " | extra mem: zmqsync / no-retain / baseline |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        r = c.results
        lines.append(
            f"| {c.size} | {c.workers} | {c.transport} | {c.mode} | {ms(r['baseline'])} "
            f"| {ms(r['zmqsync'])} | {_ratio(c.ratio('zmqsync'))} "
            f"| {ms(r['zmqsync-noretain'])} | {_ratio(c.ratio('zmqsync-noretain'))} "
            f"| {pct(c.extra_pct('zmqsync'))} / {pct(c.extra_pct('zmqsync-noretain'))}"
            f" / {pct(c.extra_pct('baseline'))} |"
        )
    n = len(cells)

    def within(variant: str) -> int:
        return sum(c.ratio(variant) <= RATIO_TARGET for c in cells)

    def lean(variant: str) -> int:
        return sum((c.extra_pct(variant) or 0.0) < 100 * MEMORY_TARGET for c in cells)

    worst = max(cells, key=lambda c: c.ratio("zmqsync-noretain"), default=None)
    lines += [
        "",
        f"Ratio = zmqsync median / baseline median; **bold** = above the {RATIO_TARGET}x target.",
        "Extra mem = peak extra bytes the learner holds from malloc over a few sends of the "
        "variant on its own (from just before its first send), plus the shared-memory blocks "
        "it maps, % of the model; anonymous RSS is in the JSON.",
        "",
        f"- within {RATIO_TARGET}x of the baseline: zmqsync {within('zmqsync')}/{n} cells, "
        f"retain_snapshot=False {within('zmqsync-noretain')}/{n} cells",
        f"- extra memory under {MEMORY_TARGET:.0%} of the model: zmqsync {lean('zmqsync')}/{n}, "
        f"retain_snapshot=False {lean('zmqsync-noretain')}/{n}, baseline {lean('baseline')}/{n}",
    ]
    if worst is not None:
        lines.append(
            f"- worst ratio (retain_snapshot=False): {worst.ratio('zmqsync-noretain'):.2f} at "
            f"{worst.size}, K={worst.workers}, {worst.transport}, {worst.mode}"
        )
    lines += ["", *run.footer(dict.fromkeys(c.size for c in cells))]
    return "\n".join(lines) + "\n"


# --- the command --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = grid_parser(
        PROG,
        "Sync latency of zmqsync against a hand-written pyzmq zero-copy baseline.",
        quick_time="< 1 min",
    )
    p.add_argument("--transports", type=csv_list(str, ["ipc", "tcp"]), default=["ipc", "tcp"])
    p.add_argument(
        "--modes", type=csv_list(str, ["pubsub", "router"]), default=["pubsub", "router"]
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="timed sends per variant and cell (default by size: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + f"); {','.join(SLOW_SIZES)} gets a fifth of it, at least {FEWEST_REPEATS}",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help="untimed sends at the start of each block",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds any one send, setup or worker reply may take",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads in the learner and every worker (default: torch's own, "
        "what users get; 1 shows what oversubscribed parallel copies cost)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the learner's and the workers' tensors live (cuda: the baseline "
        "copies them to the host with .cpu() each send and back with copy_)",
    )
    p.add_argument(
        "--pack-threshold",
        type=int,
        metavar="BYTES",
        help="zmqsync packs tensors under this size into one buffer per dtype (default "
        "64 KiB); 0 sends every tensor from its own memory (no copy, more frames)",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        metavar="BYTES",
        help="the chunks zmqsync streams a version in (default 8 MiB)",
    )
    add_outputs(p, tables="table")
    args = p.parse_args(argv)
    settle_grid(p, args)
    if args.pack_threshold is not None and args.pack_threshold < 0:
        p.error("--pack-threshold must be 0 or more bytes")
    if args.chunk_bytes is not None and args.chunk_bytes <= 0:
        p.error("--chunk-bytes must be more than 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_exit)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    os.environ[DEVICE_ENV] = args.device  # the workers, spawned below, read it too
    run = Run(PROG, argv)
    run.machine["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    cells: list[Cell] = []
    run.announce("torch", "pyzmq")
    processes = [()] * (VARIANTS * max(args.workers))
    with (
        scratch_dir() as scratch,
        WorkerPool(Sessions, processes, torch_threads=args.torch_threads) as pool,
    ):
        pool.start()
        for size in args.sizes:
            layout: Layout = SIZES[size]
            model = make_state_dict(layout, fill="random")
            measure = functools.partial(
                run_cell,
                pool,
                model,
                timeout=args.timeout,
                workdir=scratch,
                options={
                    k: v
                    for k, v in (
                        ("pack_threshold", args.pack_threshold),
                        ("chunk_bytes", args.chunk_bytes),
                    )
                    if v is not None
                },
            )
            # A throwaway cell first: one-time costs in the learner (pyzmq's zero-copy
            # collector thread, lazily loaded code, Python's heap growing to hold a
            # layout's objects) are not charged to the first cell of each size.
            first = Cell(size, 1, args.transports[0], args.modes[0])
            measure(first, repeats=1, warmup=1, tag=f"w{len(cells)}")
            for workers in args.workers:
                for transport in args.transports:
                    for mode in args.modes:
                        cell = measure(
                            Cell(size, workers, transport, mode),
                            repeats=repeats_for(size, args.repeats, DEFAULT_REPEATS, SLOW_SIZES),
                            warmup=args.warmup,
                            tag=f"c{len(cells)}",
                        )
                        cells.append(cell)
                        _progress(cell)
            del model, measure
    run.finish()
    figures = {
        "ratio_target": RATIO_TARGET,
        "memory_target": MEMORY_TARGET,
        "models": describe_models(args.sizes),
        "cells": [c.to_json() for c in cells],
    }
    run.publish(markdown(cells, run), args.markdown, args.json, figures)
    return 0


def _progress(cell: Cell) -> None:
    r = cell.results
    print(
        f"{cell.size:>9} K={cell.workers} {cell.transport} {cell.mode:<6} baseline "
        f"{r['baseline'].median_ms():8.2f} ms  zmqsync "
        f"{r['zmqsync'].median_ms():8.2f} ms ({cell.ratio('zmqsync'):.2f}x)  "
        f"no-retain {r['zmqsync-noretain'].median_ms():8.2f} ms "
        f"({cell.ratio('zmqsync-noretain'):.2f}x)  extra mem "
        f"{pct(cell.extra_pct('zmqsync'))}/{pct(cell.extra_pct('zmqsync-noretain'))}/"
        f"{pct(cell.extra_pct('baseline'))}",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
