"""What the commands of the grid benchmarks (sync_latency, transports) share: the options
of their grid of sizes x worker counts, SIGTERM, and a scratch directory.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from benchmarks._models import SIZES

#: ``--quick``'s grid: the smallest model, the model of many small tensors, few workers.
QUICK_SIZES: Final = ("1MB", "2000x4KB")
QUICK_WORKERS: Final = (1, 2)
QUICK_REPEATS: Final = 2
DEFAULT_WORKERS: Final = (1, 2, 4)
#: With ``--repeats``, the slow sizes get this share of it (a fifth), at least this many.
SLOW_SHARE: Final = 5
FEWEST_REPEATS: Final = 2
#: ``--timeout``'s default: seconds any one send, set-up or worker reply may take.
DEFAULT_TIMEOUT: Final = 60.0


def csv_list(kind: type, allowed: Sequence[Any] | None = None) -> Callable[[str], list[Any]]:
    """An argparse type: comma-separated values of ``kind``, each among ``allowed``."""

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


def grid_parser(
    prog: str,
    description: str,
    *,
    quick_time: str,
    workers: Sequence[int] = DEFAULT_WORKERS,
) -> argparse.ArgumentParser:
    """A parser with the grid's options first: ``--quick``, ``--sizes``, ``--workers``
    (``workers``: the worker counts of the full grid)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.set_defaults(full_workers=list(workers))
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: sizes {','.join(QUICK_SIZES)}, workers "
        f"{','.join(map(str, QUICK_WORKERS))}, {QUICK_REPEATS} repeats ({quick_time})",
    )
    p.add_argument(
        "--sizes",
        type=csv_list(str, list(SIZES)),
        help=f"comma-separated, from {','.join(SIZES)} (default: all)",
    )
    p.add_argument(
        "--workers",
        type=csv_list(int),
        help=f"worker counts K (default: {','.join(map(str, workers))})",
    )
    return p


def add_outputs(p: argparse.ArgumentParser, *, tables: str) -> None:
    """The options that say where the figures and the ``tables`` go."""
    p.add_argument("--json", metavar="PATH", help="write every figure (and raw times) here")
    p.add_argument("--markdown", metavar="PATH", help=f"write the {tables} here")


def settle_grid(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the grid's defaults (``--quick``'s, or the full grid) and check the
    options every grid benchmark has."""
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES) if args.quick else list(SIZES)
    if args.workers is None:
        args.workers = list(QUICK_WORKERS) if args.quick else list(args.full_workers)
    if any(k < 1 for k in args.workers):
        p.error("--workers must be positive")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.torch_threads is not None and args.torch_threads < 1:
        p.error("--torch-threads must be at least 1")
    if args.quick and args.repeats is None:
        args.repeats = QUICK_REPEATS


def repeats_for(
    size: str, repeats: int | None, defaults: dict[str, int], slow: Sequence[str]
) -> int:
    """Timed sends per variant for ``size``: its default, or ``--repeats`` (a fifth of it
    for the ``slow`` sizes)."""
    if repeats is None:
        return defaults[size]
    return max(FEWEST_REPEATS, repeats // SLOW_SHARE) if size in slow else repeats


def raise_exit(signum: int, frame: Any) -> None:
    """A SIGTERM handler: the same cleanup as Ctrl-C (every worker process is ended)."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def scratch_dir() -> Iterator[str]:
    """A scratch directory for ipc endpoints, removed afterwards."""
    # Short path: ipc endpoints are unix socket paths (at most ~100 bytes).
    path = tempfile.mkdtemp(prefix="zsb-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
