"""Prometheus metrics of a learner and a relay, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from _faults import until
from _prom import one, scrape

from zmqsync import Relay, WeightReceiver, WeightSender
from zmqsync.metrics import IDLE_TIMEOUT, MAX_CONNECTIONS, serve_metrics
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
