"""A sender's status: its fleet's rows, its counters and its sync latencies."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Final

from zmqsync.sender.pump import sum_counters
from zmqsync.sender.state import SenderState
from zmqsync.status_types import LatencyHistogram, SenderStatus, Totals
from zmqsync.tensors.views import dtype_name
from zmqsync.transport.base import (
    counters,
    lost_peers,
)

__all__ = ["LATENCY_BUCKETS", "LATENCY_WINDOW", "Reporting"]

log = logging.getLogger("zmqsync.sender")

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


class Reporting(SenderState):
    """What a sender says of itself and its workers (a part of WeightSender)."""

    def status(self) -> dict[str, Any]:
        """The sync state as a JSON-ready dict (what ``zmqsync status`` shows): the
        fields of :meth:`report`, as ``report().as_dict()``."""
        return self.report().as_dict()

    def report(self) -> SenderStatus:
        """The sync state as a :class:`~zmqsync.SenderStatus`: version, uptime,
        per-worker state, totals.

        At most :data:`~zmqsync.fleet.STATUS_ROWS` worker rows (the furthest behind
        first); ``workers_total`` counts them all.
        """
        now = time.monotonic()
        lat = sorted(self._latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        with self._cond:
            workers, counts = self.fleet.status_rows(now)
            fleet_counters = dict(self.fleet.counters)
            reasons = list(self.fleet.reasons)
        totals = Totals(
            **self._totals,
            **fleet_counters,
            latency_p50_s=pct(0.5),
            latency_p90_s=pct(0.9),
            latency_p99_s=pct(0.99),
            latency_histogram=LatencyHistogram(
                le=list(LATENCY_BUCKETS),
                counts=list(self._latency_counts),
                sum_s=self._latency_sum,
            ),
            rejections=reasons,
            transport=sum_counters(counters(r.hub) for r in self._runners),
        )
        return SenderStatus(
            model_id=self.model_id,
            version=self.version,
            epoch=self.epoch,
            mode=self.mode,
            endpoint=self.endpoint,
            strategy=self.strategy,
            num_workers=self.num_workers,
            metadata=self._metadata,
            wire_dtype=None if self.wire_dtype is None else dtype_name(self.wire_dtype),
            delta=self._last_delta if self.delta else None,
            share_params=(
                None
                if not self.share_params
                else "unavailable: " + self._share_problem
                if self._share_problem
                else "on"
            ),
            uptime_s=now - self._started,
            host=socket.gethostname(),
            pid=os.getpid(),
            workers_total=counts["workers_total"],
            workers_live=counts["workers_live"],
            workers_shown=counts["workers_shown"],
            workers=workers,
            totals=totals,
        )

    def connected_workers(self) -> frozenset[int]:
        """Ids of the workers that said hello and have not left (never cut short, unlike
        :meth:`status`'s rows)."""
        with self._cond:
            return frozenset(w for w, s in self.fleet.workers.items() if s.left is None)

    def worker_versions(self) -> dict[int, int]:
        """The newest version each worker acked in this sender's epoch, by worker id
        (0: none yet): every connected worker that has not left, and every expected
        worker ``0..num_workers-1`` (0 if it never connected or left).

        A worker whose transport knows it is gone (a broken pipe, a dead Ray actor)
        counts as left. Unlike :meth:`status`, never cut short: one entry per worker.
        """
        lost = {r.index: lost_peers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.acked_versions(lost)

    def current_workers(self) -> frozenset[int]:
        """Ids of the workers known to hold the latest version (what ``connect()`` and
        every later send gave them); before anything is published, every connected one."""
        lost = {r.index: lost_peers(r.hub) for r in self._runners}
        with self._cond:
            return self.fleet.current(lost)
