"""Prometheus metrics of a sender or a relay, read from its ``report()`` at each scrape.

``serve_metrics(sender_or_relay, port)`` starts an HTTP server whose ``/metrics`` says,
in Prometheus's text format: the version, every worker's version, lag, liveness and
state, the workers behind each relay (from its heartbeats), the bytes, versions and
chunks sent, timeouts and rejections, the sync latency as a histogram, and for a relay
what it forwarded and where it stands upstream. Nothing is sampled in the background: a
scrape reads the status as it is. Needs ``prometheus_client`` (the ``metrics`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from zmqsync.closing import ClosesOnExit
from zmqsync.status_types import SenderStatus, UpstreamStatus

__all__ = ["MetricsServer", "StatusCollector", "serve_metrics"]

#: Counters of ``report().totals``, as (field, metric name, help).
_COUNTERS = (
    ("versions_sent", "versions_sent", "Versions sent (or forwarded, for a relay)."),
    ("bytes_sent", "bytes_sent", "Bytes of weights sent, counted once per targeted worker."),
    ("chunks_sent", "chunks_sent", "Chunk messages sent."),
    ("timeouts", "timeouts", "Sends that raised a timeout."),
    ("rejected_frames", "rejected_frames", "Malformed or unauthenticated messages rejected."),
    ("forged", "forged", "Acks and requests without their worker's session."),
    ("repair_bytes", "repair_bytes_sent", "Bytes of latest versions sent to one worker each."),
    ("deltas_sent", "deltas_sent", "Versions sent as deltas to some worker."),
    ("stalls", "stalls", "Chunks a stopped worker held past the stall limit."),
    ("expired", "sessions_expired", "Worker sessions dropped for silence."),
)


class StatusCollector:
    """A Prometheus collector over a status function: ``sender.report``, or one that
    returns the dict of ``status()``."""

    def __init__(self, status: Callable[[], SenderStatus | Mapping[str, Any]]) -> None:
        self._status = status

    def describe(self) -> list[Any]:
        return []  # the families depend on the status: collected at each scrape only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        status = self._status()
        if not isinstance(status, SenderStatus):
            status = SenderStatus.from_dict(status)
        model = status.model_id
        totals = status.totals

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(f"zmqsync_{name}", doc, labels=("model_id", *labels))

        g = gauge("version", "The latest version sent.")
        g.add_metric([model], status.version)
        yield g
        g = gauge("workers", "Workers known to the sender, by state.", ("state",))
        g.add_metric([model, "total"], status.workers_total)
        g.add_metric([model, "live"], status.workers_live)
        yield g
        rows = status.workers
        per_worker = (
            ("worker_version", "version", "The version each worker holds."),
            ("worker_lag", "lag", "Versions each worker is behind."),
            ("worker_live", "live", "1 if the worker was heard from lately."),
            ("worker_torn", "torn", "1 if the worker's model is torn."),
            ("worker_received_bytes", "received_bytes", "Bytes each worker received."),
        )
        for name, attr, doc in per_worker:
            g = gauge(name, doc, ("worker",))
            for row in rows:
                g.add_metric([model, str(row.worker)], float(getattr(row, attr)))
            yield g
        g = gauge(
            "below_version",
            "The version each worker behind a relay holds (the relay's heartbeats).",
            ("relay", "worker"),
        )
        for row in rows:
            for worker, held in (row.below or {}).items():
                g.add_metric([model, str(row.worker), worker], held)
        yield g
        for attr, name, doc in _COUNTERS:
            c = CounterMetricFamily(f"zmqsync_{name}", doc, labels=("model_id",))
            c.add_metric([model], getattr(totals, attr))
            yield c
        hist = totals.latency_histogram
        if hist is not None:
            cumulative, buckets = 0, []
            for le, count in zip([*hist.le, float("inf")], hist.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
            h = HistogramMetricFamily(
                "zmqsync_sync_latency_seconds",
                "From the start of send() to the last ack.",
                labels=("model_id",),
            )
            h.add_metric([model], buckets, hist.sum_s)
            yield h
        relay = status.relay
        if relay is not None:
            for attr in ("versions_forwarded", "chunks_forwarded", "aborted", "refetches"):
                c = CounterMetricFamily(
                    f"zmqsync_relay_{attr}",
                    f"A relay's {attr.replace('_', ' ')}.",
                    labels=("model_id",),
                )
                c.add_metric([model], getattr(relay, attr))
                yield c
            upstream = status.upstream or UpstreamStatus()
            g = gauge("relay_upstream_version", "The version a relay holds of its upstream's.")
            g.add_metric([model], upstream.version)
            yield g
            g = gauge("relay_ack_owed", "1 while a relay waits for its workers to ack upstream.")
            g.add_metric([model], float(upstream.ack_owed))
            yield g


class MetricsServer(ClosesOnExit):
    """The HTTP server :func:`serve_metrics` started; :meth:`close` stops it."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(source: Any, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``source``'s status (a :class:`~zmqsync.WeightSender`, a
    :class:`~zmqsync.Relay`, or anything with ``report()`` or ``status()``) as Prometheus
    metrics on ``http://addr:port/metrics`` (port 0: a free one, see
    :attr:`MetricsServer.port`)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImportError("metrics need prometheus_client: pip install 'zmqsync[metrics]'") from exc
    registry = CollectorRegistry()
    registry.register(StatusCollector(getattr(source, "report", None) or source.status))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread)
