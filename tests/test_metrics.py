"""Prometheus metrics of a learner and a relay, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import threading
import time

import pytest
import torch
from _faults import until
from _prom import one, scrape

from zmqsync import Relay, WeightReceiver, WeightSender
from zmqsync.status_types import STATUS_BELOW, STATUS_ROWS, SenderStatus, WorkerStatus
from zmqsync.tools.metrics import (
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    REQUEST_DEADLINE,
    RESPONSE_DEADLINE,
    serve_metrics,
)
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke


@pytest.mark.timeout(120)
def test_a_learner_and_a_relay_expose_their_fleet() -> None:
    model = {"w": torch.zeros(100_000), "b": torch.zeros(10)}
    learner = WeightSender(
        PubSubHub("tcp://127.0.0.1:*", insecure=True),
        model=model,
        strategy="state_dict",
        num_workers=1,
        timeout=30,
    )
    relay = Relay(
        PubSubSpoke(learner.endpoint, identity="relay"),
        PubSubHub("tcp://127.0.0.1:*", insecure=True),
        strategy="state_dict",
        worker_idx=0,
        heartbeat=0.2,
    )
    targets = [{k: torch.ones_like(v) for k, v in model.items()} for _ in range(2)]
    receivers = []
    servers = []
    try:
        relay.connect(timeout=30)
        relay.start()
        for i in range(2):
            r = WeightReceiver(
                PubSubSpoke(relay.endpoint, identity=f"w{i}"),
                model=targets[i],
                strategy="state_dict",
                worker_idx=i + 5,
            )
            r.connect(timeout=30)
            r.start()
            receivers.append(r)
        for _ in range(3):
            model["w"].add_(1)
            learner.send()
        servers = [serve_metrics(learner, 0), serve_metrics(relay, 0)]
        top, mid = (scrape(s.port) for s in servers)

        assert one(top, "zmqsync_version", model_id="policy") == 3
        assert one(top, "zmqsync_worker_version", worker="0") == 3
        assert one(top, "zmqsync_worker_lag", worker="0") == 0
        assert one(top, "zmqsync_worker_live", worker="0") == 1
        totals = learner.status()["totals"]
        assert one(top, "zmqsync_bytes_sent_total") == totals["bytes_sent"]
        assert one(top, "zmqsync_versions_sent_total") == 3
        # Every send's latency, in a histogram whose count is the number of sends.
        assert one(top, "zmqsync_sync_latency_seconds_count") == 3
        assert one(top, "zmqsync_sync_latency_seconds_bucket", le="+Inf") == 3
        assert 0 < one(top, "zmqsync_sync_latency_seconds_sum") < 30

        # The relay's own fleet, and what it forwarded.
        assert {ls["worker"]: v for ls, v in mid["zmqsync_worker_version"]} == {"5": 3, "6": 3}
        assert one(mid, "zmqsync_relay_versions_forwarded_total") >= 3
        assert one(mid, "zmqsync_relay_chunks_forwarded_total") >= 3
        assert one(mid, "zmqsync_relay_upstream_version") == 3

        # The learner sees the workers behind the relay once a heartbeat said so.
        def below() -> dict[str, float]:
            top = scrape(servers[0].port)
            rows = top.get("zmqsync_below_version", [])
            return {ls["worker"]: v for ls, v in rows if ls["relay"] == "0"}

        # A heartbeat of the relay's says so within a heartbeat (one second).
        until(lambda: below() == {"5": 3, "6": 3}, 10, "a heartbeat naming both at 3")
        assert below() == {"5": 3, "6": 3}
    finally:
        for s in servers:
            s.close()
        for r in receivers:
            r.close()
        relay.close()
        learner.close()


#: Half-sent requests the test opens: many times MAX_CONNECTIONS, few enough for any host.
HALF_SENT = 200


def _still_open(sockets: list[socket.socket]) -> list[socket.socket]:
    """The sockets the server has not closed (reading them would block)."""
    left = []
    for s in sockets:
        try:
            if s.recv(1, socket.MSG_PEEK):
                left.append(s)  # it answered something: not closed yet
        except BlockingIOError:
            left.append(s)
        except OSError:
            pass  # reset: closed with our request unread
    return left


@pytest.mark.timeout(120)
def test_idle_connections_hold_a_bounded_number_of_threads_and_time_out() -> None:
    """200 requests that never finish, over real sockets to loopback: at most
    MAX_CONNECTIONS are served (threads) and the rest closed at once; those are closed
    after IDLE_TIMEOUT of silence, and a scrape then answers."""
    learner = WeightSender(
        PubSubHub("tcp://127.0.0.1:*", insecure=True),
        model={"w": torch.zeros(10)},
        strategy="state_dict",
        timeout=10,
    )
    server = serve_metrics(learner, 0)
    clients: list[socket.socket] = []
    try:
        baseline = threading.active_count()
        started = time.monotonic()
        for _ in range(HALF_SENT):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            clients.append(client)
            # No blank line after the headers: the request never ends.
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            client.setblocking(False)  # polled from now on: a read never waits
        peak = threading.active_count()

        def served() -> bool:
            nonlocal peak
            peak = max(peak, threading.active_count())
            return len(_still_open(clients)) <= MAX_CONNECTIONS

        until(served, 30, f"at most {MAX_CONNECTIONS} of {HALF_SENT} connections are open")
        assert peak - baseline <= MAX_CONNECTIONS, f"{peak - baseline} threads for connections"

        def all_closed() -> bool:
            return not _still_open(clients) and threading.active_count() <= baseline

        until(all_closed, IDLE_TIMEOUT + 30, "every silent connection is closed")
        # Held until their timeout, not closed with the rest.
        assert time.monotonic() - started >= IDLE_TIMEOUT
        assert one(scrape(server.port), "zmqsync_version", model_id="policy") == 0
    finally:
        for client in clients:
            client.close()
        server.close()
        learner.close()


#: Clients trickling a request: more than MAX_CONNECTIONS, so that they hold every slot.
TRICKLERS = MAX_CONNECTIONS + 4
#: Seconds between two bytes of a trickled request: well within IDLE_TIMEOUT.
TRICKLE_PACE = 1.0
#: Seconds a connection may outlive its deadline before a test fails (a loaded host).
MARGIN = 5.0


def _learner() -> WeightSender:
    return WeightSender(
        PubSubHub("tcp://127.0.0.1:*", insecure=True),
        model={"w": torch.zeros(10)},
        strategy="state_dict",
        timeout=10,
    )


@pytest.mark.timeout(120)
def test_trickled_requests_are_closed_at_their_deadline() -> None:
    """A slowloris over real sockets to loopback: TRICKLERS clients each send a byte of
    an endless header every TRICKLE_PACE seconds, so the idle timeout never fires. The
    MAX_CONNECTIONS that are served are held until REQUEST_DEADLINE and closed by it
    (plus a margin), whatever they still trickle; a scrape then answers."""
    learner = _learner()
    server = serve_metrics(learner, 0)
    clients: list[socket.socket] = []
    pace = threading.Event()  # never set: its waits pace the trickle and the polling
    try:
        baseline = threading.active_count()
        started = time.monotonic()
        for _ in range(TRICKLERS):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            clients.append(client)
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            client.setblocking(False)  # polled from now on: neither reads nor sends wait
        closed_at: dict[socket.socket, float] = {}
        trickled = 0  # bytes sent to connections still open
        next_byte = started + TRICKLE_PACE
        give_up = started + REQUEST_DEADLINE + MARGIN
        while len(closed_at) < TRICKLERS and time.monotonic() < give_up:
            now = time.monotonic()
            open_ = _still_open([c for c in clients if c not in closed_at])
            closed_at.update((c, now) for c in clients if c not in closed_at and c not in open_)
            if now >= next_byte:
                next_byte += TRICKLE_PACE
                for client in open_:
                    with contextlib.suppress(OSError):  # reset: seen at the next poll
                        trickled += client.send(b"x")
            pace.wait(0.02)
        after = {round(t - started, 1) for t in closed_at.values()}
        assert len(closed_at) == TRICKLERS, (
            f"{TRICKLERS - len(closed_at)} trickling connections still open "
            f"{REQUEST_DEADLINE + MARGIN} s after they began (closed after {sorted(after)} s)"
        )
        # The served ones were held until their deadline, trickling all along; the rest
        # were closed as they came.
        held = [t - started for t in closed_at.values() if t - started >= REQUEST_DEADLINE]
        assert len(held) >= MAX_CONNECTIONS, sorted(after)
        assert trickled >= 2 * MAX_CONNECTIONS  # each served one, twice at least
        until(lambda: threading.active_count() <= baseline, 10, "every slot is free")
        assert one(scrape(server.port), "zmqsync_version", model_id="policy") == 0
    finally:
        for client in clients:
            client.close()
        server.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_keep_alive_client_scrapes_once_per_connection() -> None:
    """A client asking for keep-alive (as Prometheus's does) gets a whole HTTP/1.0 reply
    and the connection closed after it: one request per connection, so the request's
    deadline is the connection's. Its next scrape opens a new connection, and answers."""
    learner = _learner()
    server = serve_metrics(learner, 0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for _ in range(2):
            conn.request("GET", "/metrics", headers={"Connection": "keep-alive"})
            reply = conn.getresponse()
            body = reply.read()
            assert reply.status == 200
            assert b"zmqsync_version" in body
            assert reply.version == 10 and reply.will_close  # HTTP/1.0, no keep-alive
    finally:
        conn.close()
        server.close()
        learner.close()


#: A model id near the wire's limit (MAX_MODEL_ID_BYTES): it labels every sample.
BIG_MODEL_ID = "policy-" + "x" * 200


class _BigFleet:
    """A status source (what ``serve_metrics`` reads: ``status()``) for a relay fleet of
    STATUS_ROWS relays, each naming STATUS_BELOW workers behind it: a reply of several
    megabytes, more than the kernel buffers for a client that reads slowly."""

    def __init__(self) -> None:
        below = {str(w): 1 for w in range(STATUS_BELOW)}
        rows = [WorkerStatus(worker=r, connected=True, below=below) for r in range(STATUS_ROWS)]
        self._status = SenderStatus(model_id=BIG_MODEL_ID, workers=rows)

    def status(self) -> SenderStatus:
        return self._status


#: Bytes a slow reader takes each READ_PACE seconds: each chunk of a reply is taken well
#: within IDLE_TIMEOUT, the whole reply not within RESPONSE_DEADLINE.
READ_BYTES = 4096
READ_PACE = 0.25


@pytest.mark.timeout(120)
def test_a_slow_reader_is_cut_off_at_the_reply_deadline() -> None:
    """A client over a real socket to loopback that asks for a reply of megabytes and
    takes READ_BYTES of it every READ_PACE seconds: the server gives its slot back and
    resets the connection within RESPONSE_DEADLINE (plus a margin), the reply cut short,
    and a scrape then answers."""
    server = serve_metrics(_BigFleet(), 0)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    pace = threading.Event()  # never set: its waits pace the reads
    try:
        baseline = threading.active_count()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READ_BYTES)  # a small window
        client.settimeout(10)
        client.connect(("127.0.0.1", server.port))
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        started = time.monotonic()
        got = b""
        freed = ended = None
        give_up = started + RESPONSE_DEADLINE + MARGIN
        while ended is None and time.monotonic() < give_up:
            pace.wait(READ_PACE)
            try:
                data = client.recv(READ_BYTES)
            except OSError:  # reset by the server
                data = b""
            if not data:
                ended = time.monotonic() - started
            got += data
            if freed is None and threading.active_count() <= baseline:
                freed = time.monotonic() - started
        assert freed is not None, f"the slot is held {RESPONSE_DEADLINE + MARGIN} s on"
        assert ended is not None, f"the reply goes on {RESPONSE_DEADLINE + MARGIN} s on"
        head, _, body = got.partition(b"\r\n\r\n")
        length = re.search(rb"Content-Length: (\d+)", head)
        assert length is not None, head
        assert len(body) < int(length[1]), "the whole reply was taken: the test read too fast"
        assert one(scrape(server.port), "zmqsync_version", model_id=BIG_MODEL_ID) == 0
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(120)
def test_each_ranks_metrics_carry_its_rank_and_the_ranks_a_send_waits_for() -> None:
    """Three in-process ranks over tcp, each serving its metrics: every family is
    labelled with the rank; while ranks 0 and 1 wait for rank 2's part, rank 0 counts
    one missing rank and both workers waiting for it; rank 2's late send ends that."""
    from _ranks import ShardedFleet

    fleet = ShardedFleet(timeout=30.0)
    servers = []
    try:
        servers = [serve_metrics(s, 0) for s in fleet.senders]
        assert fleet.send() == []
        for r, server in enumerate(servers):
            samples = scrape(server.port)
            assert one(samples, "zmqsync_version", model_id="policy", rank=str(r)) == 1
            assert one(samples, "zmqsync_ranks", rank=str(r)) == 3
            assert one(samples, "zmqsync_missing_ranks", rank=str(r)) == 0
            assert "zmqsync_rank_waited_by" not in samples
            sent = fleet.senders[r].status()["totals"]["bytes_sent"]
            assert one(samples, "zmqsync_bytes_sent_total", rank=str(r)) == sent > 0
            assert one(samples, "zmqsync_worker_version", rank=str(r), worker="1") == 1
        with torch.no_grad():
            fleet.model["w"].add_(1.0)
        threads, errors = fleet.start_send([0, 1])

        def waits_for_rank_2() -> bool:
            samples = scrape(servers[0].port)
            return one(samples, "zmqsync_missing_ranks", rank="0") == 1 and (
                one(samples, "zmqsync_rank_waited_by", rank="0", missing_rank="2") == 2
            )

        until(waits_for_rank_2, 25, "rank 0's metrics to name rank 2 as missing")
        late, late_errors = fleet.start_send([2])
        for t in threads + late:
            t.join(60)
        assert errors == [] and late_errors == []
        samples = scrape(servers[0].port)
        assert one(samples, "zmqsync_missing_ranks", rank="0") == 0
        assert one(samples, "zmqsync_version", rank="0") == 2
    finally:
        for server in servers:
            server.close()
        fleet.close()
