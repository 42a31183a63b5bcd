"""The promises in the README's guarantees table, end to end: real worker processes, real
ZeroMQ sockets."""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq
from _workers import bump, make_model

import zmqsync
from zmqsync import SyncTimeout, ZMQWeightSyncScheme
from zmqsync.protocol import Goodbye, encode

pytestmark = pytest.mark.slow


def _start_fleet(fleet, scheme, workers, kind: str = "mlp") -> None:  # type: ignore[no-untyped-def]
    for i in workers:
        fleet.start(scheme, i, kind=kind)
    for i in workers:
        fleet.wait_ready(i)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["state_dict", "tensordict"])
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_four_workers_exact_after_every_send(fleet, endpoint, mode, strategy) -> None:  # type: ignore[no-untyped-def]
    model = make_model("wide", seed=0)
    scheme = ZMQWeightSyncScheme(strategy, mode=mode, endpoint=endpoint, timeout=20)
    scheme.init_on_sender("policy", model=model, num_workers=4)
    try:
        _start_fleet(fleet, scheme, range(4), kind="wide")
        # connect() is a rendez-vous: before any send, every worker (its model built
        # from another seed) holds the learner's weights, as version 0.
        initial = zmqsync.checksum(model, strategy)
        for i in range(4):
            assert fleet.ask(i, "state")["checksum"] == initial, f"worker {i} kept its own"
            assert fleet.ask(i, "state")["version"] == 0
        for version in (1, 2, 3):
            bump(model)
            scheme.send()
            expected = zmqsync.checksum(model, strategy)
            for i in range(4):
                state = fleet.ask(i, "state")
                assert state["version"] == version
                assert state["checksum"] == expected, f"worker {i} differs at version {version}"
        # Over ipc every worker is on this host: versions travel as places in shared
        # blocks (the sender's snapshot), read in place. Over tcp, every byte is inline.
        shared_sends = scheme.get_sender().transport.counters().get("shm_shared_sends", 0)
        shared_frames = [
            fleet.ask(i, "state")["transport"].get("shm_shared_frames", 0) for i in range(4)
        ]
        if endpoint.startswith("ipc://"):
            assert shared_sends >= 1 and all(n >= 1 for n in shared_frames), shared_frames
        else:
            assert shared_sends == 0 and shared_frames == [0] * 4
        # Reading in place is not aliasing: the learner changing its weights without
        # sending changes no worker (each copied the block into its own tensors).
        bump(model)
        for i in range(4):
            assert fleet.ask(i, "state")["checksum"] == expected, f"worker {i} aliases"
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_targeting_isolation_dead_worker_and_late_joiner(fleet, tcp_endpoint) -> None:  # type: ignore[no-untyped-def]
    """One fleet, the promises in order: targeting, no aliasing, a SIGKILLed worker named
    by the timeout, the living still served, and a late joiner catching up on connect."""
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode="pubsub", endpoint=tcp_endpoint, timeout=10)
    scheme.init_on_sender("policy", model=model)  # targets every connected worker
    try:
        _start_fleet(fleet, scheme, range(4))
        bump(model)
        scheme.send()
        v1 = zmqsync.checksum(model)

        # worker_ids=[0] changes worker 0 and no other.
        bump(model)
        scheme.send(worker_ids=[0])
        v2 = zmqsync.checksum(model)
        assert fleet.ask(0, "checksum") == v2
        assert [fleet.ask(i, "checksum") for i in (1, 2, 3)] == [v1] * 3

        # The sender changing its own weights without sending changes no worker.
        bump(model)
        time.sleep(0.3)  # give a (wrong) aliasing implementation time to show itself
        assert fleet.ask(0, "checksum") == v2
        assert [fleet.ask(i, "checksum") for i in (1, 2, 3)] == [v1] * 3

        # A worker killed with SIGKILL: the next send names it within timeout + 1 s.
        fleet.kill(3)
        scheme.get_sender().timeout = 3.0
        start = time.monotonic()
        with pytest.raises(SyncTimeout) as info:
            scheme.send()
        took = time.monotonic() - start
        assert info.value.missing_workers == [3]
        assert isinstance(info.value, TimeoutError)
        assert "worker 3" in str(info.value)
        assert took < 3.0 + 1.0, f"the timeout took {took:.2f}s"

        # The following send to the living workers succeeds.
        bump(model)
        scheme.send(worker_ids=[0, 1, 2])
        latest = zmqsync.checksum(model)
        assert [fleet.ask(i, "checksum") for i in (0, 1, 2)] == [latest] * 3

        # A worker started after those versions reaches the latest on connect.
        fleet.start(scheme, 7)
        fleet.wait_ready(7)
        state = fleet.ask(7, "state")
        assert state["checksum"] == latest
        assert state["version"] == scheme.get_sender().version
    finally:
        scheme.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_restarted_sender_is_followed(fleet, tmp_path, mode) -> None:  # type: ignore[no-untyped-def]
    endpoint = f"ipc://{tmp_path}/restart"
    model = make_model(seed=0)
    first = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=endpoint, timeout=15)
    first.init_on_sender("policy", model=model, num_workers=2)
    _start_fleet(fleet, first, range(2))
    for _ in range(3):
        bump(model)
        first.send()
    old_epoch = first.get_sender().epoch
    first.shutdown()

    second = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=endpoint, timeout=15)
    fresh = make_model(seed=5)
    second.init_on_sender("policy", model=fresh, num_workers=2)
    try:
        assert second.get_sender().epoch != old_epoch
        second.send()  # version 1 of the new epoch, below the 3 the workers hold
        for i in range(2):
            state = fleet.ask(i, "state")
            assert state["epoch"] == second.get_sender().epoch
            assert state["version"] == 1
            assert state["checksum"] == zmqsync.checksum(fresh)
    finally:
        second.shutdown()


#: A ZMTP 3.0 greeting asking for a security mechanism nobody speaks: what a peer with
#: the wrong configuration sends. libzmq must refuse it (a counted handshake failure).
_BAD_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"BOGUS".ljust(20, b"\0") + bytes(32)


def _garbage_at(address: str) -> None:
    """Raw bytes that are not a valid ZeroMQ peer at a tcp port."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    for payload in (os.urandom(256), _BAD_GREETING):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(2)
            try:
                while s.recv(1024):
                    pass
            except OSError:
                pass


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_garbage_at_every_socket_is_counted_and_harmless(fleet, mode) -> None:  # type: ignore[no-untyped-def]
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint="tcp://127.0.0.1:*", timeout=15)
    scheme.init_on_sender("policy", model=model, num_workers=2)
    sender = scheme.get_sender()
    try:
        _start_fleet(fleet, scheme, range(2))
        scheme.send()
        announced = sender.transport.announce()
        bound = [sender.endpoint, *announced.values()]

        # Raw non-ZeroMQ bytes at every bound port.
        for address in bound:
            _garbage_at(address)
        # Well-formed ZeroMQ messages that are not zmqsync messages, at every socket
        # that reads: the ROUTER (as a DEALER) and the ack PULL (as a PUSH).
        ctx = zmq.Context.instance()
        with ctx.socket(zmq.DEALER) as dealer, ctx.socket(zmq.PUSH) as push:
            dealer.linger = push.linger = 0
            dealer.connect(sender.endpoint)
            push.connect(announced["ack_endpoint"])
            for junk in ([b"junk"], [os.urandom(60), b"{}"], [b"ZSY1" + bytes(60)]):
                dealer.send_multipart(junk)
                push.send_multipart(junk)
            # The sender answers malformed requests with an error, not silence.
            assert dealer.poll(5000), "no error reply to a malformed request"
            reply = zmqsync.protocol.decode(dealer.recv_multipart())
            assert isinstance(reply, zmqsync.protocol.ErrorMessage)
            assert reply.code == "malformed"

        # Garbage the other way: the sender's own transport fans junk out to workers.
        sender_hub = sender.transport
        with sender._holding_baton():
            sender_hub.send_frames([b"not a zmqsync message"])

        deadline = time.monotonic() + 10
        while True:
            totals = sender.status()["totals"]
            if totals["rejected_frames"] >= 6 and totals["handshake_failures"] >= len(bound):
                break
            assert time.monotonic() < deadline, f"garbage not counted: {totals}"
            time.sleep(0.05)

        # Both sides keep working: the next send succeeds everywhere.
        bump(model)
        scheme.send()
        for i in range(2):
            state = fleet.ask(i, "state")
            assert state["checksum"] == zmqsync.checksum(model)
        rejected = [fleet.ask(i, "state")["stats"]["rejected_frames"] for i in range(2)]
        assert all(r >= 1 for r in rejected), f"workers did not count the junk: {rejected}"
        workers = {w["worker"]: w for w in sender.status()["workers"]}
        assert all(workers[i]["rejected_frames"] >= 1 for i in range(2))
    finally:
        scheme.shutdown()


def _worker_status(scheme, worker: int) -> dict:  # type: ignore[no-untyped-def]
    return next(w for w in scheme.get_sender().status()["workers"] if w["worker"] == worker)


def _until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


@pytest.mark.timeout(240)
def test_a_worker_that_leaves_is_no_longer_waited_for(fleet, ipc_endpoint) -> None:  # type: ignore[no-untyped-def]
    """A fleet that is whoever connected: a worker that shuts down says goodbye, the
    next send does not wait for it, the shared blocks stop counting it, and it is
    welcome back."""
    model = make_model("wide", seed=0)  # large enough to travel through shared memory
    scheme = ZMQWeightSyncScheme("state_dict", mode="pubsub", endpoint=ipc_endpoint, timeout=10)
    scheme.init_on_sender("policy", model=model)  # num_workers=None
    sender = scheme.get_sender()
    try:
        _start_fleet(fleet, scheme, range(3), kind="wide")
        bump(model)
        scheme.send()
        assert sender.transport.counters()["shm_peers"] == 3

        fleet.stop(2)
        _until(lambda: _worker_status(scheme, 2)["left"], 10, "the sender heard the goodbye")
        assert sender.status()["totals"]["goodbyes"] == 1
        assert sender.transport.counters()["shm_peers"] == 2
        bump(model)
        start = time.monotonic()
        scheme.send()  # would wait out the 10 s timeout for worker 2 without the goodbye
        took = time.monotonic() - start
        assert took < 2.0, f"send took {took:.2f}s"
        latest = zmqsync.checksum(model)
        assert [fleet.ask(i, "checksum") for i in (0, 1)] == [latest] * 2
        state = _worker_status(scheme, 2)
        assert (state["left"], state["live"]) == (True, False)
        assert state["version"] == 1  # what it held when it left

        # It comes back (a new process, the same id): caught up on connect, and counted.
        fleet.start(scheme, 2, kind="wide")
        fleet.wait_ready(2)
        assert fleet.ask(2, "checksum") == latest
        assert _worker_status(scheme, 2)["left"] is False
        bump(model)
        scheme.send()
        assert fleet.ask(2, "checksum") == zmqsync.checksum(model)
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_a_fleet_of_known_size_names_a_worker_that_left_at_once(fleet, tcp_endpoint, mode) -> None:  # type: ignore[no-untyped-def]
    """num_workers=2: a send to a worker that left fails at once, naming it, instead of
    waiting out the timeout. A goodbye forged by another peer changes nothing."""
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme("state_dict", mode=mode, endpoint=tcp_endpoint, timeout=10)
    scheme.init_on_sender("policy", model=model, num_workers=2)
    sender = scheme.get_sender()
    try:
        _start_fleet(fleet, scheme, range(2))
        bump(model)
        scheme.send()

        # Someone else's goodbye for worker 0 (without its session) is counted and ignored.
        ctx = zmq.Context.instance()
        forger = ctx.socket(zmq.DEALER)
        forger.linger = 0
        forger.connect(sender.endpoint)
        try:
            forger.send_multipart(encode(Goodbye("policy", 1, sender.epoch, worker=0)))
            _until(
                lambda: sender.status()["totals"]["forged"] == 1,
                10,
                "the forged goodbye was counted",
            )
        finally:
            forger.close()
        bump(model)
        scheme.send()
        assert _worker_status(scheme, 0)["left"] is False

        fleet.stop(1)
        _until(lambda: _worker_status(scheme, 1)["left"], 10, "the sender heard the goodbye")
        bump(model)
        start = time.monotonic()
        with pytest.raises(SyncTimeout) as info:
            scheme.send()
        took = time.monotonic() - start
        assert took < 2.0, f"the error took {took:.2f}s"
        assert info.value.missing_workers == [1]
        assert "worker 1" in str(info.value) and "said goodbye" in str(info.value)
        scheme.send(worker_ids=[0])
        assert fleet.ask(0, "checksum") == zmqsync.checksum(model)
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_a_silent_worker_drops_out_of_a_fleet_of_whoever_connected(fleet, tcp_endpoint) -> None:  # type: ignore[no-untyped-def]
    """A SIGKILLed worker says nothing: the next send names it; once it has missed
    three heartbeats, sends to "every live worker" no longer wait for it."""
    model = make_model(seed=0)
    scheme = ZMQWeightSyncScheme(
        "state_dict", mode="pubsub", endpoint=tcp_endpoint, timeout=10, heartbeat=0.2
    )
    scheme.init_on_sender("policy", model=model)
    sender = scheme.get_sender()
    try:
        _start_fleet(fleet, scheme, range(3))
        bump(model)
        scheme.send()
        fleet.kill(2)
        sender.timeout = 0.3  # shorter than three heartbeats: still counted as live
        with pytest.raises(SyncTimeout) as info:
            scheme.send()
        assert info.value.missing_workers == [2]
        sender.timeout = 10.0
        _until(lambda: not _worker_status(scheme, 2)["live"], 10, "worker 2 went silent")
        assert _worker_status(scheme, 2)["left"] is False  # it never said goodbye
        bump(model)
        start = time.monotonic()
        scheme.send()
        assert time.monotonic() - start < 2.0
        assert [fleet.ask(i, "checksum") for i in (0, 1)] == [zmqsync.checksum(model)] * 2
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_a_rendez_vous_without_a_snapshot_costs_chunks_not_a_model(fleet) -> None:  # type: ignore[no-untyped-def]
    """``retain_snapshot=False``: the learner's weights published at init reach workers
    that connect before the first send whole (version 0, the model's checksum), read
    from the model chunk by chunk: the learner's own memory grows by a few chunks, not
    by a copy of the model, from init_on_sender to the end of connect()."""
    import tracemalloc

    model = make_model("big", seed=0)  # 32 MiB
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    chunk = 256 * 1024
    scheme = ZMQWeightSyncScheme(
        mode="pubsub", endpoint="tcp://127.0.0.1:*", retain_snapshot=False, chunk_bytes=chunk
    )
    tracemalloc.start()  # numpy's arrays (the sender's memory) are traced
    try:
        base = tracemalloc.get_traced_memory()[0]
        scheme.init_on_sender("policy", model=model, num_workers=2)
        _start_fleet(fleet, scheme, [0, 1], kind="big")  # each returned from connect()
        scheme.connect(timeout=60)
        held = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    try:
        expected = zmqsync.checksum(model, scheme.strategy)
        for i in (0, 1):
            state = fleet.ask(i, "state")
            assert state["version"] == 0 and state["checksum"] == expected
        # At most the ring's 32 chunks (a few normally), never the model's 128.
        assert held <= 32 * chunk + 2 * 1024 * 1024 < model_bytes, held
        bump(model)
        scheme.send()
        expected = zmqsync.checksum(model, scheme.strategy)
        assert all(fleet.ask(i, "state")["checksum"] == expected for i in (0, 1))
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_a_model_changed_before_connect_reaches_workers_whole(fleet) -> None:  # type: ignore[no-untyped-def]
    """``retain_snapshot=False``: the model changed in place after init_on_sender (a
    checkpoint loaded, say) no longer matches what was published and no copy of that
    is kept. The learner's connect(), where the model holds still, publishes it anew:
    its workers return holding the changed weights as version 0, never a mix."""
    model = make_model("big", seed=0)
    scheme = ZMQWeightSyncScheme(
        mode="router", endpoint="tcp://127.0.0.1:*", retain_snapshot=False, chunk_bytes=256 * 1024
    )
    try:
        scheme.init_on_sender("policy", model=model, num_workers=2)
        bump(model)
        for i in (0, 1):
            fleet.start(scheme, i, kind="big")
        scheme.connect(timeout=90)
        for i in (0, 1):
            fleet.wait_ready(i)
        expected = zmqsync.checksum(model, scheme.strategy)
        for i in (0, 1):
            state = fleet.ask(i, "state")
            assert state["version"] == 0 and state["checksum"] == expected
        assert scheme.get_sender().version == 0 and not scheme.get_sender().published_changed
    finally:
        scheme.shutdown()
