"""One cell of the transports benchmark (a size and K workers): every variant opened,
its memory measured over its first sends, then every variant timed taking turns in blocks
(A..Z, Z..A, A..Z, ...), and every worker's copy checked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

from benchmarks._memory import (
    PeakMemoryMeter,
    give_back_freed,
    mem_available_bytes,
    proc_kib_field,
)
from benchmarks._models import SIZES, bump, digest
from benchmarks._results import VariantResult
from benchmarks._transports_spec import BEST_PEER_FROM, MEMCPY, PAIRS, WHERE, ZMQSYNC
from benchmarks._transports_variants import CellEnv, Variant, make_variant

log = logging.getLogger("benchmarks.transports")
#: How much of an error's text a failure keeps.
WHY_CHARS: Final = 300
#: Memory a cell leaves free beyond what its open variants are expected to take
#: (:func:`need_bytes`): the interpreters, libraries and Ray's processes grow too.
RESERVE_BYTES: Final = 3 << 30
#: A cell's rounds of blocks (:func:`blocks`): at most this many...
MAX_ROUNDS: Final = 6
#: ...of at least this many timed sends of each variant.
MIN_BLOCK_SENDS: Final = 2
#: Untimed sends of each variant, after its warm-up, over which its memory is measured.
MEMORY_SENDS: Final = 2


def pss_bytes(pid: int) -> int | None:
    """A process's proportional set size (its private resident memory plus its share of
    what it shares: torch's and zmqsync's shared-memory blocks, Ray's store it maps),
    from ``/proc/PID/smaps_rollup``; None where that cannot be read."""
    return proc_kib_field(f"/proc/{pid}/smaps_rollup", b"Pss:")


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
    #: The variants open together, group by group (one group where all fit in memory).
    groups: list[list[str]] = field(default_factory=list)

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
            "groups": self.groups,
            "variants": {
                name: r.to_json(SIZES[self.size].nbytes, outcome=True)
                for name, r in self.results.items()
            },
        }


def need_bytes(name: str, nbytes: int, workers: int) -> int:
    """What variant ``name`` may hold while it is open in a cell, every process together:
    a model's copy in each of its workers and two more (the learner's blocks, a store's
    objects, a flat buffer); in the shared mode, where every worker maps the learner's
    blocks, three in all."""
    spec = ZMQSYNC.get(name)
    if spec is not None and spec.shares:
        return 3 * nbytes
    return (workers + 2) * nbytes


def plan_groups(names: Sequence[str], needs: Mapping[str, int], budget: int) -> list[list[str]]:
    """``names`` dealt in turn into the fewest groups whose needs each fit ``budget``
    (each group keeps the canonical order, and mixes zmqsync's variants with the peers);
    one name per group where even that does not fit."""
    for count in range(1, len(names) + 1):
        groups = [list(names[i::count]) for i in range(count)]
        if all(sum(needs[n] for n in g) <= budget for g in groups):
            return groups
    return [[n] for n in names]


def _budget() -> int:
    """What a group of variants may take now: the machine's available memory less
    :data:`RESERVE_BYTES` (no limit where it cannot be read)."""
    available = mem_available_bytes()
    return sys.maxsize if available is None else max(0, available - RESERVE_BYTES)


def run_cell(env: CellEnv, variants: Sequence[str], *, repeats: int, warmup: int) -> Cell:
    """Time every variant for the cell and check every worker's copy.

    The variants of a cell are open together and take turns, so that a change in the
    machine's load falls on all of them alike. Where they would not fit in memory together
    (each worker holds a copy of the model per variant: 16 variants of 128 MB to 8
    workers are 16 GB), the cell runs them in groups, one after the other, each group
    closed (and its memory given back) before the next opens: ``Cell.groups`` says which.
    """
    cell = Cell(env.size, env.workers)
    nbytes = SIZES[env.size].nbytes
    needs = {name: need_bytes(name, nbytes, env.workers) for name in variants}
    pending = plan_groups(variants, needs, _budget())
    opened: list[Variant] = []
    step = 0
    while pending:
        group = pending.pop(0)
        budget = _budget()  # what the groups before this one left behind counts too
        if len(group) > 1 and sum(needs[n] for n in group) > budget:
            pending[:0] = plan_groups(group, needs, budget)
            continue
        broke = {WHERE[v.name] for v in opened if v.broke_workers}
        for name in [n for n in group if WHERE[n] in broke]:
            cell.results[name] = VariantResult(
                failure=f"not run: the {WHERE[name]}'s workers hung earlier in this cell"
            )
        group = [n for n in group if WHERE[n] not in broke]
        if group:
            cell.groups.append(group)
            step = _run_group(env, cell, group, opened, repeats=repeats, warmup=warmup, step=step)
    cell.broke = {WHERE[v.name] for v in opened if v.broke_workers}
    return cell


def blocks(repeats: int) -> list[int]:
    """The timed sends of each of a cell's rounds (A..Z, Z..A, A..Z, ...): ``repeats``
    split into blocks of at least MIN_BLOCK_SENDS, at most MAX_ROUNDS of them and at
    least two (where there are two sends).

    Each variant's block starts with untimed warm-up sends, so what the variant before it
    left behind in the worker processes they share falls on those (sends taken in turn
    one by one fall on it every time: with torchrl-mp in the rotation, zmqsync-pipe's
    sends of 2,000 x 4 KB took twice as long, gloo-flat's no longer). Several short
    blocks, not two long ones, so that one slow spell of the machine over one variant's
    block does not decide its median (with two, the same cell read 0.52 and 1.00 in two
    runs of one night).
    """
    rounds = max(min(2, repeats), min(MAX_ROUNDS, repeats // MIN_BLOCK_SENDS))
    return [repeats // rounds + (i < repeats % rounds) for i in range(rounds)]


def _run_group(
    env: CellEnv,
    cell: Cell,
    names: Sequence[str],
    opened: list[Variant],
    *,
    repeats: int,
    warmup: int,
    step: int,
) -> int:
    """Open ``names``, measure each one's memory over its first sends, time them
    (:func:`blocks`), check every worker, close them; the versions' counter after them."""
    mine: list[Variant] = []
    live: list[Variant] = []
    interrupted = False
    try:
        for name in names:
            v = make_variant(name)
            result = cell.results[name] = VariantResult()
            mine.append(v)
            opened.append(v)
            try:
                result.notes = v.open(env)
                live.append(v)
            except Exception as exc:
                result.failure = f"set-up failed: {_why(exc)}"
                log.warning("%s %s K=%d: %s", name, env.size, env.workers, result.failure)
        # Memory: each variant's first sends, untimed. (The first round of blocks, timed
        # under the meter, which samples every millisecond, ran 10-45% slower than the
        # rounds after it for every variant, memcpy's included.)
        for v in live:
            result = cell.results[v.name]
            pss_before = _pss(env, v.name)
            try:
                with PeakMemoryMeter() as meter:
                    for _ in range(warmup + MEMORY_SENDS):
                        _send(env, v, step)
                        step += 1
            except Exception as exc:
                _failed(result, v, env, f"send failed: {_why(exc)}")
                continue
            result.extra_bytes = {**meter.extra, **v.held_bytes()}
            result.retained_bytes = meter.retained
            result.notes["pss"] = {"before": pss_before, "after": _pss(env, v.name)}
        # Time: rounds of blocks, A..Z, Z..A, A..Z, ...
        for round_no, count in enumerate(blocks(repeats)):
            for v in live if round_no % 2 == 0 else live[::-1]:
                result = cell.results[v.name]
                if result.failure:
                    continue
                try:
                    for i in range(warmup + count):
                        elapsed = _send(env, v, step)
                        step += 1
                        if i >= warmup:
                            result.times.append(elapsed)
                except Exception as exc:
                    _failed(result, v, env, f"send failed: {_why(exc)}")
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
                _close_cell(env, mine)
            give_back_freed()
    return step


def _send(env: CellEnv, v: Variant, step: int) -> float:
    """One send of a new version, its duration: the version is made on the thread that
    sends it, untimed, as a training loop makes it (torch's pool there is hot)."""
    return v.send(env.timeout, partial(bump, env.model.state_dict, step))


def _failed(result: VariantResult, v: Variant, env: CellEnv, why: str) -> None:
    result.failure = why
    log.warning("%s %s K=%d: %s", v.name, env.size, env.workers, why)


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
