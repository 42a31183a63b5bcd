"""What a benchmark run records and writes: each variant's figures in a cell, the machine
they were measured on, and the run's JSON and markdown.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from benchmarks._models import SIZES

#: How long each git command that names the commit measured may take.
GIT_SECONDS: Final = 5


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    return "unknown"


def _git(repo: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", repo, *args],
        capture_output=True,
        text=True,
        timeout=GIT_SECONDS,
        check=True,
    ).stdout.strip()


def _git_commit(repo: str) -> str:
    """The commit measured, with "+dirty" when zmqsync/ has uncommitted changes."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = _git(repo, "rev-parse", "--short", "HEAD")
        dirty = _git(repo, "status", "--porcelain", "--", "zmqsync")
        return head + ("+dirty" if dirty else "")
    return "unknown"


def _loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import zmq

    import zmqsync

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "zmqsync": zmqsync.__version__,
        "commit": _git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "loadavg_start": _loadavg(),
    }


def write_json(path: str | None, data: Any, *, indent: int = 2) -> None:
    """Write ``data`` to ``path`` as JSON; nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent)


@dataclass
class VariantResult:
    """One variant's figures in one cell."""

    times: list[float] = field(default_factory=list)
    #: Peak extra memory in the learner over the variant's measured sends, by measure
    #: (see :class:`benchmarks._memory.PeakMemoryMeter`), plus what it holds that the
    #: meter misses ("shm", "buffers"); and what that block left allocated.
    extra_bytes: dict[str, int] = field(default_factory=dict)
    retained_bytes: dict[str, int] = field(default_factory=dict)
    #: Why the variant has no figures in this cell (it failed), if it has none.
    failure: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def median_ms(self) -> float:
        return float(np.median(self.times)) * 1e3 if self.times and not self.failure else math.nan

    def p90_ms(self) -> float:
        if not self.times or self.failure:
            return math.nan
        return float(np.percentile(self.times, 90)) * 1e3

    def extra_pct(self, model_bytes: int) -> float | None:
        """Peak extra memory (malloc'd, else anonymous RSS) and the memory held, % of the
        model; None where this platform measures neither."""
        measured = self.extra_bytes
        extra = measured.get("heap", measured.get("rss_anon"))
        if extra is None:
            return None
        held = measured.get("shm", 0) + measured.get("buffers", 0)
        return 100.0 * (extra + held) / model_bytes

    def to_json(self, model_bytes: int, *, outcome: bool = False) -> dict[str, Any]:
        """The figures; with ``outcome``, also why the variant failed (if it did) and its
        notes (for a benchmark whose variants may fail)."""
        out: dict[str, Any] = {
            "median_ms": self.median_ms(),
            "p90_ms": self.p90_ms(),
            "times_ms": [t * 1e3 for t in self.times],
        }
        if outcome:
            out["failure"] = self.failure
        out.update(
            extra_bytes=self.extra_bytes,
            extra_pct=self.extra_pct(model_bytes),
            retained_bytes=self.retained_bytes,
        )
        if outcome:
            out["notes"] = self.notes
        return out


def ms(r: VariantResult) -> str:
    """A table's "median / p90" cell."""
    return f"{r.median_ms():.2f} / {r.p90_ms():.2f}"


def pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.0f}%"


class Run:
    """One run of a table benchmark: its command line, the machine, the clock, and where
    its table and figures go (the table to stdout, progress to stderr)."""

    def __init__(self, prog: str, argv: Sequence[str] | None) -> None:
        given = list(argv) if argv is not None else sys.argv[1:]
        self.command = " ".join([prog, shlex.join(given)]).strip()
        self.machine = machine_info()
        self.seconds = 0.0
        self._started = time.monotonic()

    def announce(self, *packages: str) -> None:
        """The run's first lines on stderr: the command, the machine, these packages'
        versions (keys of :attr:`machine`)."""
        versions = ", ".join(f"{name} {self.machine[name]}" for name in packages)
        print(
            f"# {self.command}\n# {self.machine['cpu']}, {self.machine['cpus_usable']} cpus, "
            f"{versions}",
            file=sys.stderr,
        )

    def finish(self) -> None:
        """The run is measured: take its duration and the machine's load now."""
        self.seconds = time.monotonic() - self._started
        self.machine["loadavg_end"] = _loadavg()

    def footer(self, sizes: Iterable[str]) -> list[str]:
        """A table's last lines: the command, the machine, the models of ``sizes``."""
        return [
            f"Command: `{self.command}` ({self.seconds / 60:.1f} min)",
            "",
            "Machine: "
            + ", ".join(
                f"{k} {v if not isinstance(v, tuple | list) else ' '.join(f'{x:.2f}' for x in v)}"
                for k, v in self.machine.items()
            ),
            "",
            "Models: " + "; ".join(f"{name} = {SIZES[name].describe()}" for name in sizes),
        ]

    def publish(
        self, table: str, markdown: str | None, json_path: str | None, figures: dict[str, Any]
    ) -> None:
        """Print the table, and write it and the figures where the options say."""
        print(table)
        if markdown:
            with open(markdown, "w") as f:
                f.write(table)
        write_json(
            json_path,
            {"command": self.command, "machine": self.machine, "seconds": self.seconds, **figures},
            indent=1,
        )
