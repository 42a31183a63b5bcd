"""zmqsync's transports against torchrl's schemes and other peers (issue 3).

For each cell (model size x K workers), the wall time of ``send()``, from its start to
its return, when every targeted worker has copied the new version into tensors of its
own, for these variants run side by side:

- zmqsync's, one per entry of :data:`ZMQSYNC` (name -> transport and scheme options):
  ``zmqsync-pipe``: ``zmqsync.MultiProcessWeightSyncScheme("state_dict")``, one
  ``multiprocessing.Pipe()`` per worker process; ``zmqsync-ray``:
  ``zmqsync.RayWeightSyncScheme("state_dict")`` with Ray actors; ``zmqsync-zmq``:
  ``zmqsync.ZMQWeightSyncScheme("state_dict")``, PUB/SUB over ipc, in the worker
  processes (zmqsync's ZeroMQ transport, for reference); ``zmqsync-pipe-shared``:
  ``zmqsync-pipe`` whose workers take ``apply_mode="shared"`` (their weights are
  read-only views of one copy of each version in shared memory: not tensors of their
  own, so the check that they are is skipped for it); ``zmqsync-pipe-lent``,
  ``zmqsync-zmq-lent`` and ``zmqsync-ray-lent``: ``lend_tensors=True`` on both sides
  (workers lend their tensors whatever the version's size; by default, since
  2026-12-05, they lend them from 4 MiB up, and the learner writes each version
  straight into them); ``zmqsync-pipe-stream``, ``zmqsync-zmq-stream`` and
  ``zmqsync-ray-stream``: ``lend_tensors=False`` (every version streamed through
  shared memory, the default before);
- ``torchrl-mp``: ``torchrl.weight_update.MultiProcessWeightSyncScheme``, driven as its
  collectors drive it, in the same worker processes (``mp.Queue``s; torch moves the
  learner's tensors to shared memory; each worker copies them into its own tensors);
- ``torchrl-shm``: ``torchrl.weight_update.SharedMemWeightSyncScheme`` (the default of
  torchrl's multiprocess collectors), the same way: the learner updates the shared
  buffers, each worker's torchrl thread copies them into its own tensors and acks;
- ``torchrl-ray``: ``torchrl.weight_update.RayWeightSyncScheme`` (Ray calls to signal,
  torch.distributed gloo for the tensors), in the same actors;
- ``ray-store``: one ``ray.put`` of a flat buffer per version, one call per actor with
  its ObjectRef; each actor copies the zero-copy view into its own tensors;
- ``gloo-flat``: a ``torch.distributed`` gloo broadcast of one flat buffer to the worker
  processes, each copying it into its own tensors and telling the learner
  (:mod:`._peers`);
- ``memcpy``: the physical bound, K serial copies of the model in the learner.

A cell measures each variant's memory over its first sends (untimed), then runs the
variants in blocks of a few sends, A B C ..., then ... C B A, then A B C ... again (up
to six rounds, each block starting with an untimed warm-up send), so drift on a shared
machine hits them alike and one slow spell does not decide a median. Every send,
torchrl's included, runs on a helper thread with a deadline (torchrl's own waits have
none), so a scheme that hangs is recorded as a failure and the run goes on.

The variants are named in :mod:`._transports_spec`, opened in :mod:`._transports_variants`
(on the workers of :mod:`._transports_fleet`), run cell by cell in
:mod:`._transports_cell` and tabled in :mod:`._transports_table`.

Run ``python -m benchmarks.transports --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Final

import torch

from benchmarks import _command as command
from benchmarks._models import describe_models
from benchmarks._results import Run
from benchmarks._transports_cell import Cell, run_cell
from benchmarks._transports_fleet import LearnerModel, RayFleet, TransportPool
from benchmarks._transports_spec import (
    BEST_PEER_FROM,
    BEST_PEER_TARGET,
    DEFAULT_REPEATS,
    DEFAULT_VARIANTS,
    MEMCPY_CELL,
    MEMCPY_TARGET,
    MOVES_TENSORS,
    PEERS,
    RATIO_TARGET,
    SLOW_SIZES,
    SPEEDUP_TARGET,
    VARIANTS,
    WHERE,
    ZMQSYNC,
)
from benchmarks._transports_table import markdown, progress
from benchmarks._transports_variants import CellEnv

PROG: Final = "python -m benchmarks.transports"
DEFAULT_WARMUP: Final = 1
#: The full grid's worker counts: up to 8, more workers than cores on a small machine.
PEERS_WORKERS: Final = (1, 2, 4, 8)
#: Logical CPUs Ray is told about (the machine has 2 cores; actors ask for none).
RAY_CPUS: Final = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = command.grid_parser(
        PROG,
        "zmqsync's transports against torchrl's weight-sync schemes, Ray's object store, "
        "a gloo broadcast, and memcpy.",
        quick_time="~2 min",
        workers=PEERS_WORKERS,
    )
    p.add_argument(
        "--variants",
        type=command.csv_list(str, list(VARIANTS)),
        default=list(DEFAULT_VARIANTS),
        help=f"from {','.join(VARIANTS)} (default: all but {','.join(sorted(MOVES_TENSORS))}, "
        "which runs only without the peers)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="timed sends per variant and cell (default by size: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + f"); {' and '.join(SLOW_SIZES)} get a fifth of it, at least {command.FEWEST_REPEATS}",
    )
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed sends per block")
    p.add_argument(
        "--timeout",
        type=float,
        default=command.DEFAULT_TIMEOUT,
        help="seconds any one send, set-up or worker reply may take",
    )
    p.add_argument(
        "--no-retain",
        action="store_true",
        help="zmqsync schemes with retain_snapshot=False (default: the schemes' defaults)",
    )
    p.add_argument(
        "--torch-threads", type=int, help="torch intra-op threads everywhere (default: torch's)"
    )
    command.add_outputs(p, tables="tables")
    args = p.parse_args(argv)
    command.settle_grid(p, args)
    args.variants = [v for v in VARIANTS if v in args.variants]  # the canonical order
    if MOVES_TENSORS & set(args.variants) and set(PEERS[:-1]) & set(args.variants):
        p.error(
            f"{', '.join(sorted(MOVES_TENSORS & set(args.variants)))} moves the learner's "
            "tensors, which the peers alias: run it without them (memcpy may stay)"
        )
    return args


def _start_ray(torch_threads: int | None) -> None:
    import ray

    # Ray's workers import the benchmark's modules: from the repository root.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=RAY_CPUS,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


def run_worker_count(
    workers: int,
    plan: Sequence[tuple[str, str]],
    *,
    args: argparse.Namespace,
    models: dict[str, LearnerModel],
    fleet: RayFleet | None,
    workdir: str,
    zmqsync_options: dict[str, Any],
) -> Iterator[Cell]:
    """Run ``plan``'s cells (``(slot, size)``; a slot ending in ``-warm`` is thrown
    away) with K = ``workers``; yield each measured cell.

    One pool of worker processes serves them all, unless torchrl hangs in one: its
    workers are then stuck, and a new pool serves the cells left.
    """
    needs_pool = any(WHERE[v] == "pool" for v in args.variants)
    left = list(plan)
    while left:
        pool = (
            TransportPool(workers, args.torch_threads, models, left, args.variants)
            if needs_pool
            else None
        )
        try:
            if pool is not None:
                pool.start()
            while left:
                slot_name, size = left.pop(0)
                warm = slot_name.endswith("-warm")
                repeats = command.repeats_for(size, args.repeats, DEFAULT_REPEATS, SLOW_SIZES)
                env = CellEnv(
                    size=size,
                    workers=workers,
                    model=models[size],
                    pool=pool,
                    slot=pool.slots[slot_name] if pool is not None else None,
                    fleet=fleet,
                    timeout=args.timeout,
                    workdir=workdir,
                    tag=f"k{workers}-{slot_name}",
                    zmqsync_options=zmqsync_options,
                )
                cell = run_cell(
                    env,
                    args.variants,
                    repeats=1 if warm else repeats,
                    warmup=1 if warm else args.warmup,
                )
                if "ray" in cell.broke and fleet is not None:
                    fleet.restart()
                if not warm:
                    yield cell
                if "pool" in cell.broke:
                    break
        finally:
            if pool is not None:
                pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, command.raise_exit)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # torchrl warns on its own imports and on every scheme; none of it is news here.
    warnings.filterwarnings("ignore", module=r"torchrl\..*")
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    run = Run(PROG, argv)
    import torchrl

    run.machine["torchrl"] = torchrl.__version__
    needs_ray = any(WHERE[v] == "ray" for v in args.variants)
    if needs_ray:  # a machine without Ray (the optional extra) runs the other variants
        import ray

        run.machine["ray"] = ray.__version__
    run.announce("torch", "torchrl", *(("ray",) if needs_ray else ()))
    zmqsync_options = {"retain_snapshot": False} if args.no_retain else {}
    models = {size: LearnerModel.make(size) for size in args.sizes}
    cells: list[Cell] = []
    failed_zmqsync = False
    fleet: RayFleet | None = None
    with command.scratch_dir() as workdir:
        try:
            if needs_ray:
                _start_ray(args.torch_threads)
                # Ray's core worker installs a SIGTERM handler that ends the process at
                # once; ours runs the cleanup below instead.
                signal.signal(signal.SIGTERM, command.raise_exit)
                fleet = RayFleet(max(args.workers), args.torch_threads, args.timeout)
                fleet.start()
            for k_no, workers in enumerate(args.workers):
                # The first K also runs a throwaway cell per size: one-time costs in the
                # learner (lazily loaded code, pyzmq's and Ray's threads, torch moving
                # the weights to shared memory) are not charged to a measured cell.
                plan = [
                    *((f"{s}-warm", s) for s in args.sizes if k_no == 0),
                    *((s, s) for s in args.sizes),
                ]
                plan.sort(key=lambda item: args.sizes.index(item[1]))
                for cell in run_worker_count(
                    workers,
                    plan,
                    args=args,
                    models=models,
                    fleet=fleet,
                    workdir=workdir,
                    zmqsync_options=zmqsync_options,
                ):
                    cells.append(cell)
                    progress(cell, args.variants)
                    failed_zmqsync |= any(
                        cell.results[v].failure for v in args.variants if v in ZMQSYNC
                    )
        finally:
            if fleet is not None:
                fleet.kill()
            if needs_ray:
                ray.shutdown()
    run.finish()
    figures = {
        "ratio_target": RATIO_TARGET,
        "best_peer_target": BEST_PEER_TARGET,
        "best_peer_from": list(BEST_PEER_FROM),
        "memcpy_target": {
            "ratio": MEMCPY_TARGET,
            "size": MEMCPY_CELL[0],
            "workers": MEMCPY_CELL[1],
        },
        "zmqsync_variants": {
            name: {
                "transport": spec.transport,
                "replaces": spec.replaces,
                "scheme": dict(spec.scheme),
                "sender": dict(spec.sender),
                "receiver": dict(spec.receiver),
            }
            for name, spec in ZMQSYNC.items()
            if name in args.variants
        },
        "speedup_target": SPEEDUP_TARGET,
        "zmqsync_options": zmqsync_options,
        "models": describe_models(args.sizes),
        "cells": [c.to_json() for c in cells],
    }
    run.publish(markdown(cells, args.variants, run), args.markdown, args.json, figures)
    if failed_zmqsync:
        print("error: a zmqsync variant failed (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
