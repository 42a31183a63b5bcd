"""What a sender counts of its own sends: the totals, what the latest send sent as
deltas, and each send's latency (a window for percentiles, and a histogram)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from zmqsync.status_types import LatencyHistogram, Totals

__all__ = ["LATENCY_BUCKETS", "LATENCY_WINDOW", "TOTALS", "SendStats"]

#: Latencies kept for the percentiles in status().
LATENCY_WINDOW: Final = 1000
#: Upper bounds (seconds) of the buckets sync latencies are counted in (and one more
#: bucket for the rest).
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: What a sender counts itself (the fleet core counts the rest of status' totals).
TOTALS: Final = (
    "versions_sent",
    "bytes_sent",
    "chunks_sent",
    "stalls",
    "params_moved",
    "repairs_sent",
    "repair_bytes",
    "repairs_skipped",
    "timeouts",
    "deltas_sent",
    "message_errors",
    "status_deferred",
    "status_dropped",
    "lent_go_missed",
)


class SendStats:
    """A sender's own counts and latencies, and the part of its report they make.

    Counted from several threads without a lock, as before: each count is one
    dictionary update (atomic under the GIL), and a report reads them as they are.

    >>> stats = SendStats()
    >>> stats.add("chunks_sent", 3)
    >>> stats.synced(0.004)
    >>> stats.totals["chunks_sent"], stats.latency_counts[2]
    (3, 1)
    """

    def __init__(self) -> None:
        #: Each of :data:`TOTALS`, by name.
        self.totals: dict[str, int] = dict.fromkeys(TOTALS, 0)
        #: What the latest send sent as deltas (status()["delta"]), if it was one.
        self.last_delta: dict[str, Any] | None = None
        #: The latest sends' latencies (for percentiles).
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        #: Every send's latency, counted in LATENCY_BUCKETS (cumulative: Prometheus's
        #: histogram), with their sum.
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more of ``name`` (one of :data:`TOTALS`)."""
        self.totals[name] += n

    def version_sent(
        self,
        version: int,
        nbytes: int,
        targets: int,
        deltas: dict[int, tuple[int, int]] | None,
    ) -> None:
        """A version of ``nbytes`` was sent to ``targets`` workers; ``deltas`` (a sender
        with ``delta``): by base, the workers sent a delta against it and its bytes each.
        Bytes count what each targeted worker is sent (one copy's worth when none is)."""
        patched = sum(n for n, _ in (deltas or {}).values())
        unpatched = max(0, targets - patched)
        totals = self.totals
        totals["versions_sent"] += 1
        totals["bytes_sent"] += sum(n * size for n, size in (deltas or {}).values()) + (
            nbytes * (unpatched if unpatched or patched else 1)
        )
        if deltas is not None:
            totals["deltas_sent"] += 1 if deltas else 0
            self.last_delta = {
                "version": version,
                "bases": [
                    {"base": b, "workers": n, "bytes": size}
                    for b, (n, size) in sorted(deltas.items())
                ],
                "whole_to": unpatched,
            }

    def synced(self, seconds: float) -> None:
        """A send was acked by every worker ``seconds`` after it started."""
        self.latencies.append(seconds)
        self.latency_sum += seconds
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def report(
        self,
        fleet_counters: dict[str, int],
        rejections: Iterable[str],
        transport: dict[str, int],
    ) -> Totals:
        """Status' totals: these counts and latencies, with the fleet core's counters
        and rejection reasons and the transports' counters."""
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        return Totals(
            **self.totals,
            **fleet_counters,
            latency_p50_s=pct(0.5),
            latency_p90_s=pct(0.9),
            latency_p99_s=pct(0.99),
            latency_histogram=LatencyHistogram(
                le=list(LATENCY_BUCKETS),
                counts=list(self.latency_counts),
                sum_s=self.latency_sum,
            ),
            rejections=list(rejections),
            transport=transport,
        )
