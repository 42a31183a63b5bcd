"""One cell of the transports benchmark (a size and K workers): every variant opened,
timed taking turns (A..Z, then Z..A), and every worker's copy checked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

from benchmarks._memory import PeakMemoryMeter
from benchmarks._models import SIZES, bump, digest
from benchmarks._results import VariantResult
from benchmarks._transports_spec import BEST_PEER_FROM, MEMCPY, PAIRS, WHERE, ZMQSYNC
from benchmarks._transports_variants import CellEnv, Variant, make_variant

log = logging.getLogger("benchmarks.transports")
#: How much of an error's text a failure keeps.
WHY_CHARS: Final = 300


def pss_bytes(pid: int) -> int | None:
    """A process's proportional set size (its private resident memory plus its share of
    what it shares: torch's and zmqsync's shared-memory blocks, Ray's store it maps),
    from ``/proc/PID/smaps_rollup``; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _side_pids(env: CellEnv, name: str) -> list[int]:
    """The processes of the cell's workers that ``name`` sends to (none for memcpy)."""
    where = WHERE[name]
    if where == "pool" and env.pool is not None:
        return env.pool.pids[: env.workers]
    if where == "ray" and env.fleet is not None:
        return env.fleet.pids[: env.workers]  # a dead actor's reads None: never a call
    return []


def _pss(env: CellEnv, name: str) -> dict[str, Any]:
    """Pss now of the learner and of each of ``name``'s workers, bytes (None: unread)."""
    return {
        "learner": pss_bytes(os.getpid()),
        "workers": [pss_bytes(pid) for pid in _side_pids(env, name)],
    }


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:WHY_CHARS]


@dataclass
class Cell:
    """One row of the table: a size and K workers."""

    size: str
    workers: int
    results: dict[str, VariantResult] = field(default_factory=dict)
    #: Where workers hung in this cell ("pool", "ray"): the pool or actors are replaced.
    broke: set[str] = field(default_factory=set)

    def median(self, variant: str) -> float:
        r = self.results.get(variant)
        return math.nan if r is None else r.median_ms()

    def ratio(self, numerator: str, denominator: str) -> float:
        return self.median(numerator) / self.median(denominator)

    def best_peer(self) -> tuple[str, float] | None:
        """The fastest of :data:`BEST_PEER_FROM` that ran here without failing."""
        times = [(self.median(v), v) for v in BEST_PEER_FROM if not math.isnan(self.median(v))]
        if not times:
            return None
        ms, name = min(times)
        return name, ms

    def to_best_peer(self, variant: str) -> float:
        best = self.best_peer()
        return math.nan if best is None else self.median(variant) / best[1]

    def extra_pct(self, variant: str) -> float | None:
        return self.results[variant].extra_pct(SIZES[self.size].nbytes)

    def ratios(self) -> dict[str, float]:
        """Every ratio the table shows, by column name."""
        out = {f"{z}/{t}": self.ratio(z, t) for z, t in PAIRS if z in self.results}
        for z in ZMQSYNC:
            if z in self.results:
                out[f"{z}/best peer"] = self.to_best_peer(z)
                out[f"{z}/{MEMCPY}"] = self.ratio(z, MEMCPY)
        return out

    def to_json(self) -> dict[str, Any]:
        best = self.best_peer()
        return {
            "size": self.size,
            "model_bytes": SIZES[self.size].nbytes,
            "workers": self.workers,
            "best_peer": None if best is None else {"name": best[0], "median_ms": best[1]},
            "ratios": self.ratios(),
            "variants": {
                name: r.to_json(SIZES[self.size].nbytes, outcome=True)
                for name, r in self.results.items()
            },
        }


def run_cell(env: CellEnv, variants: Sequence[str], *, repeats: int, warmup: int) -> Cell:
    """Open every variant for the cell, time them (A..Z, Z..A), check every worker."""
    cell = Cell(env.size, env.workers)
    opened: list[Variant] = []
    live: list[Variant] = []
    step = 0
    interrupted = False
    try:
        for name in variants:
            v = make_variant(name)
            result = cell.results[name] = VariantResult()
            opened.append(v)
            try:
                result.notes = v.open(env)
                live.append(v)
            except Exception as exc:
                result.failure = f"set-up failed: {_why(exc)}"
                log.warning("%s %s K=%d: %s", name, env.size, env.workers, result.failure)
        halves = (math.ceil(repeats / 2), repeats // 2)
        for round_no, order in enumerate((live, live[::-1])):
            for v in order:
                result = cell.results[v.name]
                if halves[round_no] == 0 or result.failure:
                    continue
                meter = PeakMemoryMeter() if round_no == 0 else None
                pss_before = _pss(env, v.name) if round_no == 0 else None
                try:
                    with meter if meter is not None else contextlib.nullcontext():
                        for i in range(warmup + halves[round_no]):
                            # The version is made on the thread that sends it, as a
                            # training loop makes it: torch's pool there is hot.
                            elapsed = v.send(env.timeout, partial(bump, env.model.state_dict, step))
                            step += 1
                            if i >= warmup:
                                result.times.append(elapsed)
                except Exception as exc:
                    result.failure = f"send failed: {_why(exc)}"
                    log.warning("%s %s K=%d: %s", v.name, env.size, env.workers, result.failure)
                    continue
                if meter is not None:
                    result.extra_bytes, result.retained_bytes = meter.extra, meter.retained
                    result.extra_bytes = {**result.extra_bytes, **v.held_bytes()}
                if pss_before is not None:
                    result.notes["pss"] = {"before": pss_before, "after": _pss(env, v.name)}
        # Every variant sends the model as it is now; every worker's copy must match it
        # and be its own memory (nothing shared with, or aliased to, the learner's).
        survivors = [v for v in live if not cell.results[v.name].failure]
        for v in survivors:
            try:
                v.send(env.timeout)
            except Exception as exc:
                cell.results[v.name].failure = f"final send failed: {_why(exc)}"
        expected = digest(env.model.state_dict)
        for v in survivors:
            result = cell.results[v.name]
            if result.failure:
                continue
            try:
                replies = v.digests(env)
            except Exception as exc:
                result.failure = f"reading the workers failed: {_why(exc)}"
                continue
            wrong = [i for i, r in enumerate(replies) if r["digest"] != expected]
            shares = v.name in ZMQSYNC and ZMQSYNC[v.name].shares
            not_own = [
                i
                for i, r in enumerate(replies)
                if not shares
                and (r["ownership"]["shared"] or not r["ownership"]["distinct_storages"])
            ]
            result.notes["ownership"] = [r["ownership"] for r in replies]
            if wrong:
                result.failure = f"workers {wrong} do not hold the learner's weights"
            elif not_own:
                result.failure = f"workers {not_own} do not hold the weights in memory of their own"
    except (KeyboardInterrupt, SystemExit):
        interrupted = True  # no polite teardown: main() kills the workers and actors
        raise
    finally:
        if not interrupted:
            with _quiet("zmqsync.transport.pipe"):  # a pipe's far end closing is expected
                _close_cell(env, opened)
    cell.broke = {WHERE[v.name] for v in opened if v.broke_workers}
    return cell


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(logging.ERROR)
    try:
        yield
    finally:
        target.setLevel(level)


def _close_cell(env: CellEnv, opened: Sequence[Variant]) -> None:
    """Close the cell's sessions in the workers, then the learner's schemes."""
    # Workers first, as a collector's would stop before the learner.
    if env.pool is not None:
        with contextlib.suppress(Exception):
            env.pool.call(range(env.workers), "close", (), env.timeout)
    if env.fleet is not None:
        with contextlib.suppress(Exception):
            env.fleet.get([a.close.remote() for a in env.fleet.actors[: env.workers]], "close")
    for v in opened:
        v.close()
