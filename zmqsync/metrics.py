"""Prometheus metrics of a sender or a relay, read from its ``status()`` at each scrape.

``serve_metrics(sender_or_relay, port)`` starts an HTTP server whose ``/metrics`` says,
in Prometheus's text format: the version, every worker's version, lag, liveness and
state, the workers behind each relay (from its heartbeats), the bytes, versions and
chunks sent, timeouts and rejections, the sync latency as a histogram, and for a relay
what it forwarded and where it stands upstream. Nothing is sampled in the background: a
scrape reads the status as it is. Needs ``prometheus_client`` (the ``metrics`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MetricsServer", "StatusCollector", "serve_metrics"]

#: Counters in ``status()["totals"]``, as (key, metric name, help).
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
    """A Prometheus collector over a status function (``sender.status``)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
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
        model = str(status.get("model_id", ""))
        totals = status.get("totals", {})
        version = int(status.get("version", 0))

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(f"zmqsync_{name}", doc, labels=("model_id", *labels))

        g = gauge("version", "The latest version sent.")
        g.add_metric([model], version)
        yield g
        g = gauge("workers", "Workers known to the sender, by state.", ("state",))
        g.add_metric([model, "total"], status.get("workers_total", 0))
        g.add_metric([model, "live"], status.get("workers_live", 0))
        yield g
        rows = status.get("workers", [])
        per_worker = (
            ("worker_version", "version", "The version each worker holds."),
            ("worker_lag", "lag", "Versions each worker is behind."),
            ("worker_live", "live", "1 if the worker was heard from lately."),
            ("worker_torn", "torn", "1 if the worker's model is torn."),
            ("worker_received_bytes", "received_bytes", "Bytes each worker received."),
        )
        for name, key, doc in per_worker:
            g = gauge(name, doc, ("worker",))
            for row in rows:
                g.add_metric([model, str(row["worker"])], float(row.get(key) or 0))
            yield g
        g = gauge(
            "below_version",
            "The version each worker behind a relay holds (the relay's heartbeats).",
            ("relay", "worker"),
        )
        for row in rows:
            for worker, held in (row.get("below") or {}).items():
                g.add_metric([model, str(row["worker"]), str(worker)], held)
        yield g
        for key, name, doc in _COUNTERS:
            c = CounterMetricFamily(f"zmqsync_{name}", doc, labels=("model_id",))
            c.add_metric([model], totals.get(key, 0))
            yield c
        hist = totals.get("latency_histogram")
        if hist:
            cumulative, buckets = 0, []
            for le, count in zip([*hist["le"], float("inf")], hist["counts"], strict=True):
                cumulative += count
                buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
            h = HistogramMetricFamily(
                "zmqsync_sync_latency_seconds",
                "From the start of send() to the last ack.",
                labels=("model_id",),
            )
            h.add_metric([model], buckets, hist["sum_s"])
            yield h
        relay = status.get("relay")
        if relay is not None:
            for key in ("versions_forwarded", "chunks_forwarded", "aborted", "refetches"):
                c = CounterMetricFamily(
                    f"zmqsync_relay_{key}",
                    f"A relay's {key.replace('_', ' ')}.",
                    labels=("model_id",),
                )
                c.add_metric([model], relay.get(key, 0))
                yield c
            upstream = status.get("upstream", {})
            g = gauge("relay_upstream_version", "The version a relay holds of its upstream's.")
            g.add_metric([model], upstream.get("version", 0))
            yield g
            g = gauge("relay_ack_owed", "1 while a relay waits for its workers to ack upstream.")
            g.add_metric([model], float(bool(upstream.get("ack_owed"))))
            yield g


class MetricsServer:
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

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(source: Any, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``source``'s status (a :class:`~zmqsync.WeightSender`, a
    :class:`~zmqsync.Relay`, or anything with ``status()``) as Prometheus metrics on
    ``http://addr:port/metrics`` (port 0: a free one, see :attr:`MetricsServer.port`)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImportError("metrics need prometheus_client: pip install 'zmqsync[metrics]'") from exc
    registry = CollectorRegistry()
    registry.register(StatusCollector(source.status))
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread)
