"""The transports benchmark's output: the README's tables (times; ratios and memory),
a summary line per target, and a progress line per cell.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Final

from benchmarks._models import SIZES
from benchmarks._results import Run, VariantResult, ms, pct
from benchmarks._transports_cell import Cell
from benchmarks._transports_spec import (
    BEST_PEER_FROM,
    BEST_PEER_TARGET,
    MEMCPY,
    MEMCPY_CELL,
    MEMCPY_TARGET,
    PAIRS,
    RATIO_TARGET,
    SMALL_TENSORS,
    SPEEDUP_TARGET,
    ZMQSYNC,
)

#: How much of a failure's reason a table cell shows (the JSON has all of it).
FAILURE_CHARS: Final = 80


def _ms(r: VariantResult) -> str:
    return f"failed: {r.failure[:FAILURE_CHARS]}" if r.failure else ms(r)


def _num(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def _ratio(cell: Cell, zmqsync: str, torchrl: str) -> str:
    x = cell.ratio(zmqsync, torchrl)
    if math.isnan(x):
        return "n/a"
    text = _num(x)
    if x > RATIO_TARGET:
        text = f"**{text}**"
    if cell.size == SMALL_TENSORS:
        met = x <= 1.0 / SPEEDUP_TARGET
        text += f" ({1 / x:.0f}x faster: {'met' if met else 'missed'})" if x < 1 else " (missed)"
    return text


def _best_peer_ratio(cell: Cell, zmqsync: str) -> str:
    x = cell.to_best_peer(zmqsync)
    if math.isnan(x):
        return "n/a"
    return f"**{_num(x)}**" if x <= BEST_PEER_TARGET else _num(x)


def _memcpy_ratio(cell: Cell, zmqsync: str) -> str:
    x = cell.ratio(zmqsync, MEMCPY)
    if math.isnan(x):
        return "n/a"
    if (cell.size, cell.workers) != MEMCPY_CELL:
        return _num(x)
    return f"**{_num(x)}**" if x > MEMCPY_TARGET else _num(x)


def _best_peer(cell: Cell) -> str:
    best = cell.best_peer()
    return "n/a" if best is None else f"{best[0]} {best[1]:.2f}"


_MIB: Final = 1 << 20


def _pss(cell: Cell, variant: str) -> str:
    """``learner / worker`` Pss in MiB after the variant's first sends, untimed (the
    worker: the largest of its K), each with what those sends added to it."""
    r = cell.results[variant]
    pss = r.notes.get("pss")
    if r.failure or pss is None:
        return "n/a"

    def side(before: int | None, after: int | None) -> str:
        if after is None:
            return "?"
        grown = "" if before is None else f" ({(after - before) / _MIB:+.0f})"
        return f"{after / _MIB:.0f}{grown}"

    learner = side(pss["before"]["learner"], pss["after"]["learner"])
    pairs = list(zip(pss["before"]["workers"], pss["after"]["workers"], strict=False))
    if not pairs:
        return f"{learner} / -"
    worst = max(pairs, key=lambda p: -1 if p[1] is None else p[1])
    return f"{learner} / {side(*worst)}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---", "---:", *(["---:"] * (len(header) - 2))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _summary(cells: Sequence[Cell], variants: Sequence[str]) -> list[str]:
    """One line per target: how many of ``cells`` (in table order) meet it."""
    lines = []
    for z, t in PAIRS:
        if z not in variants or t not in variants:
            continue
        measured = [c for c in cells if not math.isnan(c.ratio(z, t))]
        within = sum(c.ratio(z, t) <= RATIO_TARGET for c in measured)
        small = [c for c in measured if c.size == SMALL_TENSORS]
        fast = sum(c.ratio(z, t) <= 1 / SPEEDUP_TARGET for c in small)
        failed = [
            f"{c.size} K={c.workers}" for c in cells if c.results[z].failure or c.results[t].failure
        ]
        line = f"- {z} vs {t}: at or below torchrl in {within}/{len(measured)} cells"
        if small:
            line += f"; {SPEEDUP_TARGET:.0f}x faster for {SMALL_TENSORS} in {fast}/{len(small)}"
        if failed:
            line += f"; failed (either side): {', '.join(failed)}"
        lines.append(line)
    peers = [p for p in BEST_PEER_FROM if p in variants]
    for z in (v for v in variants if v in ZMQSYNC):
        if not peers:
            break
        measured = [c for c in cells if not math.isnan(c.to_best_peer(z))]
        above = [c for c in measured if c.to_best_peer(z) > BEST_PEER_TARGET]
        line = (
            f"- {z} vs best peer: at or below {BEST_PEER_TARGET}x in "
            f"{len(measured) - len(above)}/{len(measured)} cells"
        )
        if above:
            line += "; above in " + ", ".join(
                f"{c.size} K={c.workers} ({_num(c.to_best_peer(z))} of {_best_peer(c)} ms)"
                for c in above
            )
        failed = [f"{c.size} K={c.workers}" for c in cells if c.results[z].failure]
        if failed:
            line += f"; failed: {', '.join(failed)}"
        lines.append(line)
    if MEMCPY in variants:
        size, workers = MEMCPY_CELL
        for c in cells:
            if (c.size, c.workers) != MEMCPY_CELL:
                continue
            for z in (v for v in variants if v in ZMQSYNC):
                x = c.ratio(z, MEMCPY)
                if not math.isnan(x):
                    met = "met" if x <= MEMCPY_TARGET else "missed"
                    lines.append(
                        f"- {z} vs memcpy at {size} K={workers}: {_num(x)}x "
                        f"(target at or below {MEMCPY_TARGET}: {met})"
                    )
    return lines


def markdown(cells: Sequence[Cell], variants: Sequence[str], run: Run) -> str:
    """The README's tables (times; ratios and memory), then a summary and the machine."""
    ordered = sorted(cells, key=lambda c: (list(SIZES).index(c.size), c.workers))
    zmqsync = [v for v in variants if v in ZMQSYNC]
    has_peers = any(p in variants for p in BEST_PEER_FROM)
    pairs = [(z, t) for z, t in PAIRS if z in variants and t in variants]
    times = _table(
        ["size", "K", *(f"{v} ms (median / p90)" for v in variants)],
        [[c.size, str(c.workers), *(_ms(c.results[v]) for v in variants)] for c in ordered],
    )
    header = ["size", "K"]
    if has_peers:
        header += ["best peer (ms)", *(f"{z} / best peer" for z in zmqsync)]
    if MEMCPY in variants:
        header += [f"{z} / {MEMCPY}" for z in zmqsync]
    header += [f"{z} / {t}" for z, t in pairs]
    header.append("extra mem: " + " / ".join(variants))
    rows = []
    for c in ordered:
        row = [c.size, str(c.workers)]
        if has_peers:
            row += [_best_peer(c), *(_best_peer_ratio(c, z) for z in zmqsync)]
        if MEMCPY in variants:
            row += [_memcpy_ratio(c, z) for z in zmqsync]
        row += [_ratio(c, z, t) for z, t in pairs]
        row.append(" / ".join(pct(c.extra_pct(v)) for v in variants))
        rows.append(row)
    memory = _table(
        ["size", "K", *(f"{v} Pss MiB" for v in variants)],
        [[c.size, str(c.workers), *(_pss(c, v) for v in variants)] for c in ordered],
    )
    lines = [
        *times,
        "",
        *_table(header, rows),
        "",
        f"Best peer = the fastest of {', '.join(BEST_PEER_FROM)} in the cell (its median); "
        f"zmqsync / best peer: target at or below {BEST_PEER_TARGET} everywhere "
        "(**bold** = met).",
        f"zmqsync / {MEMCPY}: the physical bound, K serial copies in the learner; target at "
        f"or below {MEMCPY_TARGET} at {MEMCPY_CELL[0]} K={MEMCPY_CELL[1]} (**bold** = above).",
        "zmqsync / torchrl = zmqsync median / torchrl median; **bold** = zmqsync slower than "
        f"torchrl (target: at or below 1 everywhere, and {SPEEDUP_TARGET:.0f}x faster for "
        f"{SMALL_TENSORS}).",
        "Extra mem = peak extra bytes the learner holds from malloc during a variant's first "
        "sends (a warm-up and two, untimed), % of the model, plus the shared-memory blocks "
        "zmqsync-pipe and zmqsync-ray map and the flat buffers ray-store and gloo-flat "
        "allocate once (Ray's object store and torch's shared memory are not malloc'd by the "
        "learner, so they do not show here; memcpy's destinations stand for the workers' "
        "tensors and are not counted).",
        "",
        *memory,
        "",
        "Pss MiB = learner / worker: each process's proportional set size "
        "(/proc/PID/smaps_rollup: private resident memory plus its share of shared memory) "
        "after the variant's first sends (a warm-up and two, untimed), and (in brackets) "
        "what they added; "
        "the worker is the largest of the K. The pool's worker processes hold every pool "
        "variant's tensors of the cell (of its group, below) at once (Ray's actors every Ray "
        "variant's), so compare the growth, and a side's Pss across cells; memcpy has no "
        "workers.",
        "",
        *_groups(ordered),
        *_summary(ordered, variants),
        "",
        *run.footer(sorted({c.size for c in cells}, key=list(SIZES).index)),
    ]
    return "\n".join(lines) + "\n"


def _groups(cells: Sequence[Cell]) -> list[str]:
    """Which cells ran their variants in groups, and the groups."""
    grouped = [c for c in cells if len(c.groups) > 1]
    if not grouped:
        return []
    lines = [
        "Cells timed in groups (their variants would not fit in memory together; each group "
        "open on its own, its variants taking turns, then closed before the next):",
        "",
    ]
    for c in grouped:
        groups = "; then ".join(", ".join(g) for g in c.groups)
        lines.append(f"- {c.size} K={c.workers}: {groups}")
    return [*lines, ""]


def progress(cell: Cell, variants: Sequence[str]) -> None:
    parts = []
    for name in variants:
        r = cell.results[name]
        parts.append(f"{name} {'FAILED' if r.failure else f'{r.median_ms():8.2f} ms'}")
    ratios = [
        f"{z}/{t} {cell.ratio(z, t):.3f}" for z, t in PAIRS if z in variants and t in variants
    ]
    best = cell.best_peer()
    if best is not None:
        ratios.append(f"best peer {best[0]} {best[1]:.2f} ms")
        ratios += [f"{z}/best {cell.to_best_peer(z):.3f}" for z in variants if z in ZMQSYNC]
    print(
        f"{cell.size:>9} K={cell.workers}  " + "  ".join(parts) + "  |  " + "  ".join(ratios),
        file=sys.stderr,
        flush=True,
    )
