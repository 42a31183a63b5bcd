"""Prometheus metrics of a sender or a relay, read from its ``report()`` at each scrape.

``serve_metrics(sender_or_relay, port)`` starts an HTTP server whose ``/metrics`` says,
in Prometheus's text format: the version, every worker's version, lag, liveness and
state, the workers behind each relay (from its heartbeats), the bytes, versions and
chunks sent, timeouts and rejections, the sync latency as a histogram, and for a relay
what it forwarded and where it stands upstream. A sharded learner's rank labels every
family with its ``rank``, and says how many ranks' parts a waiting send still lacks.
Nothing is sampled in the background: a scrape reads the status as it is. Needs
``prometheus_client`` (the ``metrics`` extra).

The server serves at most :data:`MAX_CONNECTIONS` connections at once (more are closed
as they arrive), one request each. It closes a connection that sends nothing for
:data:`IDLE_TIMEOUT` seconds, one whose request is not whole :data:`REQUEST_DEADLINE`
seconds after it was accepted (however it trickles), and one whose reply is not taken
within :data:`RESPONSE_DEADLINE` seconds.
"""

from __future__ import annotations

import io
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from zmqsync.closing import ClosesOnExit
from zmqsync.status_types import SenderStatus, UpstreamStatus

__all__ = [
    "IDLE_TIMEOUT",
    "MAX_CONNECTIONS",
    "REQUEST_DEADLINE",
    "RESPONSE_DEADLINE",
    "MetricsServer",
    "StatusCollector",
    "serve_metrics",
]

#: Connections served at once; more are closed as they arrive. Each one holds a thread
#: until it is done: without a bound, 1,000 half-sent requests held 1,000 threads. A
#: Prometheus server scrapes over one connection at a time; a few more leave room for an
#: HA pair and a person with curl.
MAX_CONNECTIONS: Final = 16
#: Seconds a connection may send (or take) nothing before it is closed. A scraper sends
#: its whole request at once; without a timeout a silent client held its thread forever.
IDLE_TIMEOUT: Final = 5.0
#: Seconds from accepting a connection to the end of its request, however the bytes
#: trickle in. A scrape request is a few hundred bytes sent at once; the idle timeout
#: alone restarts at every byte, so clients sending a byte every few seconds held every
#: slot for as long as they liked, and scrapes were refused. As long as the idle
#: timeout: a silent connection is closed when it was before.
REQUEST_DEADLINE: Final = 5.0
#: Seconds from the first byte of a reply to its last, however slowly the client reads:
#: Prometheus gives up on a scrape after 10 s (its default ``scrape_timeout``). The idle
#: timeout bounds each write, not the reply, and does not stop the kernel sending on what
#: it holds: a connection past this deadline is reset instead.
RESPONSE_DEADLINE: Final = 10.0
#: Bytes of a reply handed to the socket at a time, each within :data:`IDLE_TIMEOUT`.
_SEND_CHUNK: Final = 16 * 1024

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
    (
        "lent_go_missed",
        "lent_go_missed",
        "Versions streamed to a worker lending its tensors that did not say go in time.",
    ),
)

#: The transports' own counts (``report().totals.transport``) that say what a fleet on
#: the learner's host costs it and how its workers take versions, as (key, metric name,
#: help, whether a counter); each family is served only where a hub counts it.
_TRANSPORT = (
    (
        "shm_bytes",
        "shm_bytes",
        "Bytes of the hubs' shared-memory blocks that hold pages (versions written there).",
        False,
    ),
    ("device_bytes", "device_bytes", "Bytes of GPU memory the hubs lend to workers.", False),
    (
        "lent_peers",
        "lent_workers",
        "Workers lending their tensors: versions are written straight into them.",
        False,
    ),
    (
        "lent_writes",
        "lent_writes",
        "Versions written into workers' lent tensors, one per worker and version.",
        True,
    ),
    ("lent_refused", "lent_refused", "Lent memory refused: not what it must be.", True),
    (
        "shm_copying",
        "copying_workers",
        "Workers sent each version as a copy (stopped or stuck, they pin shared memory).",
        False,
    ),
    ("shm_pinned", "pinned_blocks", "Shared-memory blocks those workers pin.", False),
    (
        "dropped_sends",
        "dropped_sends",
        "Messages a transport dropped (a peer gone, or its queue full).",
        True,
    ),
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
        totals = status.totals
        keys, ids = _identity(status)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(f"zmqsync_{name}", doc, labels=(*keys, *labels))

        g = gauge("version", "The latest version sent.")
        g.add_metric(ids, status.version)
        yield g
        g = gauge("workers", "Workers known to the sender, by state.", ("state",))
        g.add_metric([*ids, "total"], status.workers_total)
        g.add_metric([*ids, "live"], status.workers_live)
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
                g.add_metric([*ids, str(row.worker)], float(getattr(row, attr)))
            yield g
        g = gauge(
            "below_version",
            "The version each worker behind a relay holds (the relay's heartbeats).",
            ("relay", "worker"),
        )
        for row in rows:
            for worker, held in (row.below or {}).items():
                g.add_metric([*ids, str(row.worker), worker], held)
        yield g
        for attr, name, doc in _COUNTERS:
            c = CounterMetricFamily(f"zmqsync_{name}", doc, labels=keys)
            c.add_metric(ids, getattr(totals, attr))
            yield c
        for key, name, doc, counter in _TRANSPORT:
            if key in totals.transport:
                family = CounterMetricFamily if counter else GaugeMetricFamily
                m = family(f"zmqsync_{name}", doc, labels=keys)
                m.add_metric(ids, totals.transport[key])
                yield m
        hist = totals.latency_histogram
        if hist is not None:
            cumulative, buckets = 0, []
            for le, count in zip([*hist.le, float("inf")], hist.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
            h = HistogramMetricFamily(
                "zmqsync_sync_latency_seconds",
                "From the start of send() to the last ack.",
                labels=keys,
            )
            h.add_metric(ids, buckets, hist.sum_s)
            yield h
        yield from _rank_families(status, gauge, ids)
        relay = status.relay
        if relay is not None:
            for attr in ("versions_forwarded", "chunks_forwarded", "aborted", "refetches"):
                c = CounterMetricFamily(
                    f"zmqsync_relay_{attr}",
                    f"A relay's {attr.replace('_', ' ')}.",
                    labels=keys,
                )
                c.add_metric(ids, getattr(relay, attr))
                yield c
            upstream = status.upstream or UpstreamStatus()
            g = gauge("relay_upstream_version", "The version a relay holds of its upstream's.")
            g.add_metric(ids, upstream.version)
            yield g
            g = gauge("relay_ack_owed", "1 while a relay waits for its workers to ack upstream.")
            g.add_metric(ids, float(upstream.ack_owed))
            yield g


def _identity(status: SenderStatus) -> tuple[tuple[str, ...], list[str]]:
    """The labels every family carries, and their values: the model, and a sharded
    learner's rank (its ranks' metrics are told apart, and summed over, by it)."""
    if status.rank is None:
        return ("model_id",), [status.model_id]
    return ("model_id", "rank"), [status.model_id, str(status.rank)]


def _rank_families(
    status: SenderStatus, gauge: Callable[..., Any], ids: list[str]
) -> Iterator[Any]:
    """A sharded learner's rank: how many ranks there are, and while a send waits, how
    many ranks' parts the workers still lack and how many workers wait for each."""
    if status.rank is None:
        return
    waiting = status.waiting_ranks or {}
    g = gauge("ranks", "Ranks of the sharded learner this sender is a rank of.")
    g.add_metric(ids, len(status.ranks or ()))
    yield g
    g = gauge("missing_ranks", "Ranks whose parts the workers still wait for (a send under way).")
    g.add_metric(ids, len(waiting))
    yield g
    g = gauge(
        "rank_waited_by",
        "Workers that still wait for each missing rank's part (a send under way).",
        ("missing_rank",),
    )
    for rank, workers in sorted(waiting.items(), key=lambda item: int(item[0])):
        g.add_metric([*ids, rank], len(workers))
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
    :attr:`MetricsServer.port`). At most :data:`MAX_CONNECTIONS` connections are served
    at once, one request each; each is closed after :data:`IDLE_TIMEOUT` seconds without
    a byte, if its request is not whole within :data:`REQUEST_DEADLINE` seconds, or if
    its reply is not taken within :data:`RESPONSE_DEADLINE` seconds."""
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImportError("metrics need prometheus_client: pip install 'zmqsync[metrics]'") from exc
    registry = CollectorRegistry()
    registry.register(StatusCollector(getattr(source, "report", None) or source.status))
    family, _, _, _, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(_BoundedServer):
        address_family = family  # an IPv6 address needs an IPv6 socket

    server = Server((str(sockaddr[0]), port), _QuietHandler)
    server.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="zmqsync-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


class _Overdue(ConnectionAbortedError):
    """A connection that missed its deadline, abandoned by the server.

    A :class:`ConnectionAbortedError`: wsgiref drops the connection quietly, as it does
    one its client aborted, instead of printing a traceback for each slow client."""


def _abandon(sock: socket.socket, what: str) -> _Overdue:
    """The error to raise for ``sock``, which missed its deadline, once it is set to be
    reset when closed: the kernel drops what it still holds of the reply instead of
    sending it on to a client too slow to take it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return _Overdue(f"the metrics {what} missed its deadline")


def _left(sock: socket.socket, deadline: float, what: str) -> float:
    """The timeout for ``sock``'s next call: what is left before ``deadline``, at most
    :data:`IDLE_TIMEOUT`; raise :class:`_Overdue` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _abandon(sock, what)
    return min(IDLE_TIMEOUT, left)


class _DeadlineReader(io.RawIOBase):
    """A connection's socket, read until a deadline: each read waits at most what is
    left of it (and at most :data:`IDLE_TIMEOUT`), so however the bytes trickle in, no
    read ends after the deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        """Read what has come (at least a byte; none at the end of the stream)."""
        self._sock.settimeout(_left(self._sock, self._deadline, "request"))
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError as exc:
            raise _abandon(self._sock, "request") from exc


class _DeadlineWriter(io.BufferedIOBase):
    """A connection's socket, written in chunks that each must be taken within
    :data:`IDLE_TIMEOUT`, all of them within ``budget`` seconds of the first write."""

    def __init__(self, sock: socket.socket, budget: float) -> None:
        super().__init__()
        self._sock = sock
        self._budget = budget
        self._deadline: float | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        """Send all of ``data`` or raise :class:`_Overdue`."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self._budget
        view = memoryview(data).cast("B")
        try:
            for start in range(0, len(view), _SEND_CHUNK):
                self._sock.settimeout(_left(self._sock, self._deadline, "reply"))
                self._sock.sendall(view[start : start + _SEND_CHUNK])
        except TimeoutError as exc:
            raise _abandon(self._sock, "reply") from exc
        return len(view)


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, none logged; every read and write has a deadline."""

    def setup(self) -> None:
        """Wrap the socket in files whose reads end by :data:`REQUEST_DEADLINE` after the
        connection was accepted, and whose writes end by :data:`RESPONSE_DEADLINE` after
        the reply began (replaces socketserver's, which only set :data:`IDLE_TIMEOUT`)."""
        self.connection = self.request
        reader = _DeadlineReader(self.connection, time.monotonic() + REQUEST_DEADLINE)
        self.rfile = io.BufferedReader(reader)
        self.wfile = _DeadlineWriter(self.connection, RESPONSE_DEADLINE)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: a scrape every few seconds would fill the learner's output."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them."""

    daemon_threads = True  # a stuck connection never holds the process at exit
    # socketserver's 5 fills at once under a burst of connections, and each connection
    # past it (a scrape too) waits a second for its SYN to be sent again; extra
    # connections are closed as fast as they are accepted, so a longer queue drains.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` on a thread of its own if a slot is free, else close it."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it will never give the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection, then free its slot."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or went away is no error of ours; print others."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)
