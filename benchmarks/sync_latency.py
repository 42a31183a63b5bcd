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
:class:`benchmarks._harness.PeakMemoryMeter`); its sampling thread never runs while
sends are timed.

Run ``python -m benchmarks.sync_latency --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from benchmarks._baseline import BaselineLearner
from benchmarks._harness import (
    DEVICE_ENV,
    SIZES,
    Layout,
    PeakMemoryMeter,
    WorkerPool,
    digest,
    machine_info,
    make_state_dict,
)
from zmqsync import ZMQWeightSyncScheme

#: The target the issue sets: zmqsync within this factor of the baseline...
RATIO_TARGET: Final = 1.2
#: ...and the learner's peak extra memory under this share of the model.
MEMORY_TARGET: Final = 0.10
#: Timed sends per variant and cell, by size (``--repeats`` scales them all).
DEFAULT_REPEATS: Final[dict[str, int]] = {"1MB": 30, "16MB": 16, "128MB": 6, "2000x4KB": 30}
#: Untimed sends at the start of each block (sockets, caches, lazily built schemas).
DEFAULT_WARMUP: Final = 1
#: Sends per variant (after warmup) while its memory is measured, apart from the timing.
MEMORY_SENDS: Final = 3
#: Variants per cell (baseline, zmqsync, zmqsync without the snapshot), each with K
#: worker processes of its own.
VARIANTS: Final = 3
QUICK_SIZES: Final = ("1MB", "2000x4KB")
QUICK_WORKERS: Final = (1, 2)
QUICK_REPEATS: Final = 2


# --- variants ---------------------------------------------------------------------------


@dataclass
class VariantResult:
    """One variant's figures in one cell."""

    times: list[float] = field(default_factory=list)
    #: Peak extra memory in the learner over the variant's memory sends, by measure
    #: (see :class:`PeakMemoryMeter`), and what that block left allocated.
    extra_bytes: dict[str, int] = field(default_factory=dict)
    retained_bytes: dict[str, int] = field(default_factory=dict)

    def median_ms(self) -> float:
        return float(np.median(self.times)) * 1e3 if self.times else math.nan

    def p90_ms(self) -> float:
        return float(np.percentile(self.times, 90)) * 1e3 if self.times else math.nan


class Variant:
    """One way of syncing (baseline or zmqsync) set up for one cell."""

    name: str

    def open(
        self,
        pool: WorkerPool,
        procs: Sequence[int],
        size: str,
        model: dict[str, torch.Tensor],
        timeout: float,
    ) -> None:
        """Set up the learner's end and one worker session in each of the pool's
        processes ``procs`` (worker ids 0..K-1, in that order)."""
        raise NotImplementedError

    def send(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def shared_bytes(self) -> int:
        """Shared memory the learner maps for its sends (not malloc'd, so the meter
        misses it; charged to the variant's extra memory)."""
        return 0


class WrongWeights(RuntimeError):
    """A worker does not hold the learner's weights after a send that it acked."""


class BaselineVariant(Variant):
    """The hand-written pyzmq baseline (:mod:`benchmarks._baseline`)."""

    def __init__(self, mode: str, transport: str, workdir: str, tag: str, timeout: float) -> None:
        self.name = "baseline"
        self.mode, self.transport, self.workdir, self.tag = mode, transport, workdir, tag
        self.timeout = timeout
        self.learner: BaselineLearner | None = None

    def open(
        self,
        pool: WorkerPool,
        procs: Sequence[int],
        size: str,
        model: dict[str, torch.Tensor],
        timeout: float,
    ) -> None:
        self.model, self.workers = model, len(procs)
        self.learner = BaselineLearner(self.mode, self.transport, self.workdir, self.tag)
        ep = (self.learner.data_endpoint, self.learner.ack_endpoint)
        pool.call(
            procs,
            "open_baseline",
            {p: (self.name, self.mode, *ep, size, i) for i, p in enumerate(procs)},
            timeout,
        )
        self.learner.handshake(self.workers, timeout)

    def send(self) -> None:
        assert self.learner is not None
        self.learner.send(self.model, self.workers, self.timeout)

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
            self.learner = None


class ZmqsyncVariant(Variant):
    """``ZMQWeightSyncScheme("state_dict", ...)``, with or without the retained snapshot."""

    def __init__(
        self,
        mode: str,
        transport: str,
        workdir: str,
        tag: str,
        timeout: float,
        *,
        retain_snapshot: bool,
        pack_threshold: int | None = None,
    ) -> None:
        self.name = "zmqsync" if retain_snapshot else "zmqsync-noretain"
        self.mode = mode
        self.endpoint = (
            "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{workdir}/{tag}-{self.name}"
        )
        self.timeout = timeout
        self.retain_snapshot = retain_snapshot
        self.options: dict[str, Any] = (
            {} if pack_threshold is None else {"pack_threshold": pack_threshold}
        )
        self.scheme: ZMQWeightSyncScheme | None = None

    def open(
        self,
        pool: WorkerPool,
        procs: Sequence[int],
        size: str,
        model: dict[str, torch.Tensor],
        timeout: float,
    ) -> None:
        self.scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode=self.mode,  # type: ignore[arg-type]
            endpoint=self.endpoint,
            timeout=self.timeout,
            retain_snapshot=self.retain_snapshot,
            **self.options,
        )
        self.scheme.init_on_sender("policy", model=model, num_workers=len(procs))
        # The scheme pickles into the workers with its bound endpoint (not its sockets).
        pool.call(
            procs,
            "open_zmqsync",
            {p: (self.name, self.scheme, size, i, timeout) for i, p in enumerate(procs)},
            timeout + 10,
        )

    def send(self) -> None:
        assert self.scheme is not None
        self.scheme.send()

    def shared_bytes(self) -> int:
        assert self.scheme is not None
        return int(self.scheme.get_sender().transport.counters().get("shm_bytes", 0))

    def close(self) -> None:
        if self.scheme is not None:
            self.scheme.shutdown()
            self.scheme = None


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
        measured = self.results[variant].extra_bytes
        extra = measured.get("heap", measured.get("rss_anon"))
        if extra is None:
            return None
        return 100.0 * (extra + measured.get("shm", 0)) / SIZES[self.size].nbytes

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
                name: {
                    "median_ms": r.median_ms(),
                    "p90_ms": r.p90_ms(),
                    "times_ms": [t * 1e3 for t in r.times],
                    "extra_bytes": r.extra_bytes,
                    "extra_pct": self.extra_pct(name),
                    "retained_bytes": r.retained_bytes,
                }
                for name, r in self.results.items()
            },
        }


def _mutate(model: dict[str, torch.Tensor], step: int) -> None:
    """Make the next send a new version: in place, one tensor, no allocation."""
    tensors = list(model.values())
    tensors[step % len(tensors)].add_(1)


def run_cell(
    pool: WorkerPool,
    model: dict[str, torch.Tensor],
    cell: Cell,
    *,
    repeats: int,
    warmup: int,
    timeout: float,
    workdir: str,
    tag: str,
    pack_threshold: int | None = None,
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
                pack_threshold=pack_threshold,
            )
            for retain in (True, False)
        ),
    ]
    assert len(variants) == VARIANTS
    # Each variant's workers are processes of their own: variants sharing a process
    # share its malloc state (glibc's mmap and trim thresholds are process-wide), and
    # one variant's frees then decide whether the other's next receive faults its
    # pages in (measured: 1,600 faults, +2.5 ms per 16 MB version, for either side).
    stride = pool.size // len(variants)
    procs = {v.name: range(j * stride, j * stride + cell.workers) for j, v in enumerate(variants)}
    opened: list[Variant] = []
    step = 0
    try:
        for v in variants:
            v.open(pool, procs[v.name], cell.size, model, timeout)
            opened.append(v)
            cell.results[v.name] = VariantResult()
        # Memory: each variant alone, from just before its first send.
        for v in variants:
            result = cell.results[v.name]
            with PeakMemoryMeter() as meter:
                for _ in range(warmup + MEMORY_SENDS):
                    _mutate(model, step)
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
                    _mutate(model, step)
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


def _ms(r: VariantResult) -> str:
    return f"{r.median_ms():.2f} / {r.p90_ms():.2f}"


def _ratio(x: float) -> str:
    text = f"{x:.2f}"
    return f"**{text}**" if x > RATIO_TARGET else text


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


def markdown(
    cells: Sequence[Cell],
    machine: dict[str, Any],
    command: str,
    seconds: float,
) -> str:
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
            f"| {c.size} | {c.workers} | {c.transport} | {c.mode} | {_ms(r['baseline'])} "
            f"| {_ms(r['zmqsync'])} | {_ratio(c.ratio('zmqsync'))} "
            f"| {_ms(r['zmqsync-noretain'])} | {_ratio(c.ratio('zmqsync-noretain'))} "
            f"| {_pct(c.extra_pct('zmqsync'))} / {_pct(c.extra_pct('zmqsync-noretain'))}"
            f" / {_pct(c.extra_pct('baseline'))} |"
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
    lines += [
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min)",
        "",
        "Machine: "
        + ", ".join(
            f"{k} {v if not isinstance(v, tuple | list) else ' '.join(f'{x:.2f}' for x in v)}"
            for k, v in machine.items()
        ),
        "",
        "Models: "
        + "; ".join(
            f"{name} = {SIZES[name].describe()}" for name in dict.fromkeys(c.size for c in cells)
        ),
    ]
    return "\n".join(lines) + "\n"


# --- the command --------------------------------------------------------------------------


def _csv(kind: type, allowed: Sequence[Any] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        if allowed is not None:
            bad = [v for v in values if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"{', '.join(map(str, bad))} not among {', '.join(map(str, allowed))}"
                )
        return values

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sync_latency",
        description="Sync latency of zmqsync against a hand-written pyzmq zero-copy baseline.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: sizes {','.join(QUICK_SIZES)}, workers "
        f"{','.join(map(str, QUICK_WORKERS))}, {QUICK_REPEATS} repeats (< 1 min)",
    )
    p.add_argument(
        "--sizes",
        type=_csv(str, list(SIZES)),
        help=f"comma-separated, from {','.join(SIZES)} (default: all)",
    )
    p.add_argument("--workers", type=_csv(int), help="worker counts K (default: 1,2,4)")
    p.add_argument("--transports", type=_csv(str, ["ipc", "tcp"]), default=["ipc", "tcp"])
    p.add_argument("--modes", type=_csv(str, ["pubsub", "router"]), default=["pubsub", "router"])
    p.add_argument(
        "--repeats",
        type=int,
        help="timed sends per variant and cell (default by size: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + "); 128MB gets a fifth of it, at least 2",
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
        default=60.0,
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
    p.add_argument("--json", metavar="PATH", help="write every figure (and raw times) here")
    p.add_argument("--markdown", metavar="PATH", help="write the table here")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES) if args.quick else list(SIZES)
    if args.workers is None:
        args.workers = list(QUICK_WORKERS) if args.quick else [1, 2, 4]
    if any(k < 1 for k in args.workers):
        p.error("--workers must be positive")
    if args.torch_threads is not None and args.torch_threads < 1:
        p.error("--torch-threads must be at least 1")
    if args.pack_threshold is not None and args.pack_threshold < 0:
        p.error("--pack-threshold must be 0 or more bytes")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.quick and args.repeats is None:
        args.repeats = QUICK_REPEATS
    return args


def repeats_for(size: str, repeats: int | None) -> int:
    if repeats is None:
        return DEFAULT_REPEATS[size]
    return max(2, repeats // 5) if size == "128MB" else repeats


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    # Short path: ipc endpoints are unix socket paths (at most ~100 bytes).
    path = tempfile.mkdtemp(prefix="zsb-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    given = list(argv) if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.sync_latency", shlex.join(given)]).strip()
    # SIGTERM runs the same cleanup as Ctrl-C: every worker process is ended.
    signal.signal(signal.SIGTERM, _raise_exit)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    os.environ[DEVICE_ENV] = args.device  # the workers, spawned below, read it too
    machine = machine_info()
    machine["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    started = time.monotonic()
    cells: list[Cell] = []
    print(
        f"# {command}\n# {machine['cpu']}, {machine['cpus_usable']} cpus, torch "
        f"{machine['torch']}, pyzmq {machine['pyzmq']}",
        file=sys.stderr,
    )
    with (
        _workdir() as workdir,
        WorkerPool(VARIANTS * max(args.workers), args.torch_threads) as pool,
    ):
        pool.start()
        for size in args.sizes:
            layout: Layout = SIZES[size]
            model = make_state_dict(layout, fill="random")
            # A throwaway cell first: one-time costs in the learner (pyzmq's zero-copy
            # collector thread, lazily loaded code, Python's heap growing to hold a
            # layout's objects) are not charged to the first cell of each size.
            run_cell(
                pool,
                model,
                Cell(size, 1, args.transports[0], args.modes[0]),
                repeats=1,
                warmup=1,
                timeout=args.timeout,
                workdir=workdir,
                tag=f"w{len(cells)}",
                pack_threshold=args.pack_threshold,
            )
            for workers in args.workers:
                for transport in args.transports:
                    for mode in args.modes:
                        cell = run_cell(
                            pool,
                            model,
                            Cell(size, workers, transport, mode),
                            repeats=repeats_for(size, args.repeats),
                            warmup=args.warmup,
                            timeout=args.timeout,
                            workdir=workdir,
                            tag=f"c{len(cells)}",
                            pack_threshold=args.pack_threshold,
                        )
                        cells.append(cell)
                        r = cell.results
                        print(
                            f"{size:>9} K={workers} {transport} {mode:<6} baseline "
                            f"{r['baseline'].median_ms():8.2f} ms  zmqsync "
                            f"{r['zmqsync'].median_ms():8.2f} ms ({cell.ratio('zmqsync'):.2f}x)  "
                            f"no-retain {r['zmqsync-noretain'].median_ms():8.2f} ms "
                            f"({cell.ratio('zmqsync-noretain'):.2f}x)  extra mem "
                            f"{_pct(cell.extra_pct('zmqsync'))}/"
                            f"{_pct(cell.extra_pct('zmqsync-noretain'))}/"
                            f"{_pct(cell.extra_pct('baseline'))}",
                            file=sys.stderr,
                            flush=True,
                        )
            del model
    seconds = time.monotonic() - started
    machine["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    table = markdown(cells, machine, command, seconds)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command,
                    "machine": machine,
                    "seconds": seconds,
                    "ratio_target": RATIO_TARGET,
                    "memory_target": MEMORY_TARGET,
                    "models": {
                        s: {"bytes": SIZES[s].nbytes, "layout": SIZES[s].describe()}
                        for s in args.sizes
                    },
                    "cells": [c.to_json() for c in cells],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
