"""ZeroMQ over ipc: large frames read in place from the hub's shared blocks.

Real sockets and real processes; a spoke that cannot open the blocks runs in a pid
namespace of its own (``unshare``), as a container on the same host would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import zmq

from zmqsync.protocol import Ack, encode
from zmqsync.transport import resolve
from zmqsync.transport._zmq import SPOKE_PREFIX, ZMQHub, ZMQSpoke, lending
from zmqsync.transport.shm import records

MODES = ["pubsub", "router"]
PAYLOAD = 256 * 1024
DEADLINE = 10.0


def _fleet(mode: str, tmp_path: Any, n: int) -> tuple[ZMQHub, list[ZMQSpoke]]:
    hub_cls, spoke_cls = resolve(f"zmq-{mode}")
    hub = hub_cls(f"ipc://{tmp_path}/hub")
    return hub, [spoke_cls(hub.endpoint, identity=str(i)) for i in range(n)]


def _pump(
    hub: ZMQHub,
    spokes: list[ZMQSpoke],
    until: Any,
    what: str,
    within: float = DEADLINE,
    admit: bool = False,
) -> list[Any]:
    """Run both sides until ``until()``; returns what the hub received meanwhile.
    ``admit``: admit each peer heard from (as a sender welcomes a worker's hello)."""
    got = []
    deadline = time.monotonic() + within
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        incoming = hub.recv_frames(0.02)
        if incoming is not None:
            got.append([bytes(f) for f in incoming.frames])
            if admit and incoming.peer is not None:
                hub.peer_joined(incoming.peer)
        for spoke in spokes:
            frames = spoke.recv_frames(0.005)
            assert frames is None, f"a spoke got a message during {what}: {frames!r:.80}"
    return got


def _admit(hub: ZMQHub, spokes: list[ZMQSpoke]) -> None:
    """Each spoke speaks (as a Hello does) and is admitted (as its Welcome is)."""
    for spoke in spokes:
        spoke.send_frames([b"hello"])
        spoke.follow(hub.announce())
        deadline = time.monotonic() + DEADLINE
        incoming = None
        while incoming is None:
            assert time.monotonic() < deadline, "a spoke's hello never reached the hub"
            incoming = hub.recv_frames(0.05)
        assert [bytes(f) for f in incoming.frames] == [b"hello"]
        assert incoming.peer == spoke.peer_id
        hub.peer_joined(spoke.peer_id)


def _join(hub: ZMQHub, spokes: list[ZMQSpoke]) -> None:
    """Each spoke is admitted, answers the hub's offer, and is counted."""
    _admit(hub, spokes)
    got = _pump(
        hub, spokes, lambda: all(s.counters()["borrowing"] for s in spokes), "the handshake"
    )
    assert got == [], "the handshake must not reach the hub's user"


def _shared(hub: ZMQHub, payload: bytes) -> list[Any]:
    """A message whose large frame lies in memory the hub lent (as a sender's snapshot)."""
    buf = hub.lend(len(payload))
    assert buf is not None, "a hub with registered ipc peers lends shared memory"
    buf[:] = np.frombuffer(payload, dtype=np.uint8)
    return [b"head", memoryview(buf).toreadonly()]


def _send_until_all(hub: ZMQHub, spokes: list[ZMQSpoke], frames: list[Any]) -> list[Any]:
    """Fan out until every spoke has a copy (a new subscription may miss the first)."""
    got: list[Any] = [None] * len(spokes)
    deadline = time.monotonic() + DEADLINE
    while any(g is None for g in got):
        assert time.monotonic() < deadline, "fan-out never reached every spoke"
        hub.send_frames(frames)
        for i, spoke in enumerate(spokes):
            if got[i] is None:
                got[i] = spoke.recv_frames(0.05)
    for spoke in spokes:  # repeats: drop them (their views die here)
        while spoke.recv_frames(0.2) is not None:
            pass
    return got


def _release(hub: ZMQHub, spokes: list[ZMQSpoke], n: int) -> None:
    """The spokes send what they let go of (as before an ack); wait for ``n`` releases."""
    before = hub.counters().get("shm_releases", 0)
    for spoke in spokes:
        assert spoke.recv_frames(0) is None  # any receive or send flushes releases first
    _pump(
        hub, spokes, lambda: hub.counters().get("shm_releases", 0) >= before + n, f"{n} release(s)"
    )


def _first_version(hub: ZMQHub, spokes: list[ZMQSpoke]) -> tuple[bytes, list[Any], Any, list[Any]]:
    """Join, then send one shared message to every spoke: (payload, frames, block, got)."""
    _join(hub, spokes)
    payload = os.urandom(PAYLOAD)
    frames = _shared(hub, payload)
    return payload, frames, _block(hub, frames[1]), _send_until_all(hub, spokes, frames)


def _block(hub: ZMQHub, frame: Any) -> Any:
    assert hub._lender is not None
    found = hub._lender.pool.locate(frame)
    assert found is not None
    return found[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_ipc_peers_read_in_place_and_a_block_is_rewritten_only_once_released(
    mode: str, tmp_path: Any
) -> None:
    hub, spokes = _fleet(mode, tmp_path, 2)
    try:
        first, frames, block, got = _first_version(hub, spokes)
        for received in got:
            assert bytes(received[0]) == b"head"
            view = received[1]
            assert isinstance(view, np.ndarray) and not view.flags.writeable
            assert bytes(view) == first
        assert hub.counters()["shm_shared_sends"] >= 1
        assert all(s.counters()["shm_shared_frames"] >= 1 for s in spokes)
        # Worker 0 still reads its frame; worker 1 let go.
        held = got[0][1]
        got = received = view = None
        _release(hub, spokes, 1)
        del frames
        assert set(block.leases) == {spokes[0].peer_id}
        second = os.urandom(PAYLOAD)
        frames = _shared(hub, second)
        assert _block(hub, frames[1]) is not block, "a block a worker still reads was lent"
        _send_until_all(hub, spokes, frames)
        assert bytes(held) == first, "a block was rewritten under a worker reading it"
        # Once it lets go, the block is free again and reused.
        held = frames = None
        _release(hub, spokes, 2)
        assert not block.leases
        third = _shared(hub, os.urandom(PAYLOAD))
        assert _block(hub, third[1]) is block, "a released block was not reused"
        assert hub.counters()["shm_bytes"] <= 2 * block.size
    finally:
        for end in (hub, *spokes):
            end.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_caller_memory_is_never_copied_into_a_block(mode: str, tmp_path: Any) -> None:
    """Zero-copy sends stay zero-copy: only memory the hub lent travels as a place."""
    hub, spokes = _fleet(mode, tmp_path, 1)
    try:
        _join(hub, spokes)
        before = hub.counters()["shm_bytes"]
        payload = bytearray(os.urandom(PAYLOAD))
        (got,) = _send_until_all(hub, spokes, [b"head", memoryview(payload)])
        assert bytes(got[1]) == bytes(payload)
        assert hub.counters()["shm_bytes"] == before
        assert hub.counters().get("shm_shared_sends", 0) == 0
        assert spokes[0].counters().get("shm_shared_frames", 0) == 0
    finally:
        for end in (hub, *spokes):
            end.close()


_NAMESPACED_SPOKE = """
import hashlib, json, sys
from zmqsync.transport import resolve
mode, endpoint, announced = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spoke = resolve("zmq-" + mode)[1](endpoint, identity="ns")
spoke.send_frames([b"hello"])
spoke.follow(announced)
frames = None
for _ in range(200):
    frames = spoke.recv_frames(0.1)
    if frames is not None:
        break
print(json.dumps({
    "frames": None if frames is None else [hashlib.sha256(f).hexdigest() for f in frames],
    "borrowing": spoke.counters()["borrowing"],
    "counters": spoke.counters(),
}))
spoke.close()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_a_peer_that_cannot_open_the_blocks_gets_every_byte_inline(
    mode: str, tmp_path: Any
) -> None:
    """A worker in another pid namespace (a container on this host) cannot open the
    learner's /proc entries: it declines the offer and gets the same bytes inline,
    while a worker that can reads them in place."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail(
            "this test needs root and unshare(1) (util-linux) to start a worker in a "
            "pid namespace of its own: run the suite as root, as the netns tests need"
        )
    hub, (local,) = _fleet(mode, tmp_path, 1)
    try:
        _join(hub, [local])
        proc = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                sys.executable,
                "-c",
                _NAMESPACED_SPOKE,
                mode,
                hub.endpoint,
                json.dumps(hub.announce()),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # Its hello, then its refusal of the offer (which the hub keeps to itself).
            got = _pump(
                hub,
                [local],
                lambda: hub.counters().get("shm_declined") == 1,
                "the namespaced worker",
                60.0,
                admit=True,
            )
            assert got == [[b"hello"]]
            payload = os.urandom(PAYLOAD)
            frames = _shared(hub, payload)
            deadline = time.monotonic() + 30
            local_got = None
            while proc.poll() is None:  # it may miss a fan-out while it subscribes
                assert time.monotonic() < deadline, "the namespaced worker got nothing"
                hub.send_frames(frames)
                local_got = local.recv_frames(0.1) or local_got
            out, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        result = json.loads(out)
        assert result["frames"] == [hashlib.sha256(b).hexdigest() for b in (b"head", payload)]
        assert result["borrowing"] == 0
        assert result["counters"].get("shm_not_readable") == 1
        assert result["counters"].get("shm_shared_frames", 0) == 0
        assert local_got is not None and bytes(local_got[1]) == payload
        assert local.counters()["shm_shared_frames"] >= 1
        assert hub.counters()["shm_peers"] == 1
    finally:
        hub.close()
        local.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_forged_and_malformed_records_are_counted_and_change_nothing(
    mode: str, tmp_path: Any
) -> None:
    hub, spokes = _fleet(mode, tmp_path, 1)
    context = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    dealer = context.socket(zmq.DEALER)
    dealer.routing_id = SPOKE_PREFIX + b"forger"  # it claims to be a worker
    try:
        _, frames, block, (got,) = _first_version(hub, spokes)
        assert set(block.leases) == {spokes[0].peer_id}
        for sock, address in ((push, hub.announce()["ack_endpoint"]), (dealer, hub.endpoint)):
            sock.linger = 0
            sock.connect(address)
        member = hub._lender._members[spokes[0].peer_id]  # type: ignore[union-attr]
        forged = [
            records.encode(records.Holding(member.slot, b"12345678", (10**6, 10**6), frozenset())),
            records.encode(records.Holding(member.slot, b"wrongsec", (0, 0), frozenset())),
            records.encode(records.Holding(0, bytes(8), (0, 0), frozenset()))[:7],
        ]
        for record in forged:
            push.send(record)
        # A forged release in front of a message: the record is refused, the message
        # behind it still reaches the hub's user (a release rides in front of an ack).
        push.send_multipart([forged[1], b"behind"])
        dealer.send(records.encode(records.Join(bytes(records.TOKEN_BYTES))))  # a wrong token
        dealer.send(records.encode(records.Offer(0, 0, 0)))  # an offer, which only a hub makes
        # A device block's handle, which only a hub gives, and a GPU named by a peer that
        # never joined the lending (nothing proves it is on this host).
        dealer.send(records.encode(records.DeviceGrant(1 << 30, 1, b"h" * 64)))
        dealer.send(records.encode(records.TakesDevice(bytes(range(16)))))
        bad = 0
        reached: list[Any] = []
        deadline = time.monotonic() + DEADLINE
        while bad < 8:
            assert time.monotonic() < deadline, f"{bad} of 8 bad records counted"
            incoming = hub.recv_frames(0.05)
            if incoming is not None:
                reached.append([bytes(f) for f in incoming.frames])
            bad = hub.counters().get("shm_bad_records", 0)
        assert reached == [[b"behind"]], "a record reached the hub's user"
        assert set(block.leases) == {spokes[0].peer_id}, "a forged release freed a block"
        assert hub.counters()["shm_peers"] == 1
        # Both sides keep working: the worker's real release, in front of its ack, frees
        # the block, and the ack arrives as it was sent.
        del got, frames  # the worker lets go of its frame
        releases = hub.counters().get("shm_releases", 0)
        ack = encode(Ack("policy", 1, 1, 0, True))
        spokes[0].send_frames(ack, ack=True)
        acks = _pump(
            hub,
            spokes,
            lambda: hub.counters().get("shm_releases", 0) > releases,
            "the release in front of the ack",
        )
        acks += _pump(hub, spokes, lambda: bool(acks), "the ack")
        assert acks == [[bytes(f) for f in ack]]
        assert not block.leases
    finally:
        push.close(linger=0)
        dealer.close(linger=0)
        for end in (hub, *spokes):
            end.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_peer_holding_a_block_past_its_lease_is_dropped_and_the_block_never_rewritten(
    mode: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that keeps a block (stopped, stuck) costs memory, never correctness: the
    hub retires the block rather than reuse it, counts the worker no more, and the
    worker joins again once it sees that."""
    hub, spokes = _fleet(mode, tmp_path, 2)
    try:
        first, frames, block, got = _first_version(hub, spokes)
        held = got[0][1]
        got = frames = None
        _release(hub, spokes, 1)
        second = os.urandom(PAYLOAD)
        frames = _shared(hub, second)
        monkeypatch.setattr(lending, "LEASE_SECONDS", 0.0)  # worker 0 has now held it too long
        hub.send_frames(frames)
        monkeypatch.setattr(lending, "LEASE_SECONDS", 10.0)
        got = _send_until_all(hub, spokes, frames)
        assert hub.counters()["shm_expired"] == 1
        assert block.id not in hub._lender.pool.live_ids()  # type: ignore[union-attr]
        assert bytes(held) == first
        assert [bytes(g[1]) for g in got] == [second, second]
        # Worker 0 read it inline (or skipped the shared copy and got it inline).
        assert spokes[0].counters()["shm_shared_frames"] == 1
        held = got = frames = None
        for spoke in spokes:  # any word to the hub: it offers again to a peer it dropped
            spoke.send_frames([b"heartbeat"])
        _pump(hub, spokes, lambda: hub.counters()["shm_peers"] == 2, "the rejoin")
        third = os.urandom(PAYLOAD)
        got = _send_until_all(hub, spokes, _shared(hub, third))
        assert [bytes(g[1]) for g in got] == [third, third]
        assert spokes[0].counters()["shm_shared_frames"] == 2
    finally:
        for end in (hub, *spokes):
            end.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("endpoint", "shared_memory", "expected"),
    [
        ("ipc", None, True),
        ("ipc", False, False),
        ("tcp", None, False),
        ("tcp", True, True),
    ],
)
def test_shared_memory_is_on_for_ipc_unless_asked_otherwise(
    endpoint: str, shared_memory: bool | None, expected: bool, tmp_path: Any
) -> None:
    """ipc peers share by default; tcp peers only when asked (a tcp peer on this host,
    in this pid namespace, can then read the blocks too)."""
    hub_cls, spoke_cls = resolve("zmq-router")
    address = f"ipc://{tmp_path}/hub" if endpoint == "ipc" else "tcp://127.0.0.1:*"
    hub = hub_cls(address, shared_memory=shared_memory)
    spoke = spoke_cls(hub.endpoint, identity="0")
    try:
        spoke.send_frames([b"hello"])
        spoke.follow(hub.announce())
        deadline = time.monotonic() + DEADLINE
        heard = False
        while not heard or (expected and not spoke.counters()["borrowing"]):
            assert time.monotonic() < deadline, "the hello or the handshake never completed"
            incoming = hub.recv_frames(0.05)
            if incoming is not None and incoming.peer is not None:
                hub.peer_joined(incoming.peer)  # as its Welcome does
                heard = True
            assert spoke.recv_frames(0.01) is None
        payload = os.urandom(PAYLOAD)
        buf = hub.lend(PAYLOAD)
        if not expected:
            assert buf is None and spoke.counters()["borrowing"] == 0
            assert not any(k.startswith("shm_") for k in spoke.counters())
            return
        buf[:] = np.frombuffer(payload, dtype=np.uint8)
        (got,) = _send_until_all(hub, [spoke], [b"head", memoryview(buf).toreadonly()])
        assert bytes(got[1]) == payload
        assert spoke.counters()["shm_shared_frames"] == 1
    finally:
        hub.close()
        spoke.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_a_peer_that_never_opened_the_probe_block_cannot_join(mode: str, tmp_path: Any) -> None:
    """Joining proves that a peer read the token in the hub's probe block, so the offer
    must not carry it: a client that answers with whatever the offer holds is not
    counted as a reader of shared blocks, while a real worker on this host still is."""
    hub, spokes = _fleet(mode, tmp_path, 1)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    dealer.routing_id = SPOKE_PREFIX + b"mapless"  # it claims to be a worker
    try:
        _join(hub, spokes)
        dealer.connect(hub.endpoint)
        dealer.send(b"hello", zmq.NOBLOCK)
        deadline = time.monotonic() + DEADLINE
        offer = None
        while offer is None:
            assert time.monotonic() < deadline, "the hub made no offer to a new peer"
            incoming = hub.recv_frames(0.02)
            if incoming is not None and incoming.peer == dealer.routing_id:
                hub.peer_joined(incoming.peer)  # as its Welcome does: offered the blocks
            if dealer.poll(10):
                record = dealer.recv_multipart(zmq.NOBLOCK)
                if records.is_record(record) and isinstance(
                    records.decode(record[0]), records.Offer
                ):
                    offer = record[0]
        token_size = records.TOKEN_BYTES
        body = offer[4:]
        # Every token-sized piece of the offer (at any alignment), as a join.
        guesses = {body[i : i + token_size] for i in range(len(body) - token_size + 1)}
        guesses.add(body[-token_size:].rjust(token_size, b"\0"))
        for guess in guesses:
            dealer.send(records.encode(records.Join(guess)), zmq.NOBLOCK)
        bad = hub.counters().get("shm_bad_records", 0)
        deadline = time.monotonic() + DEADLINE
        while hub.counters().get("shm_bad_records", 0) < bad + len(guesses):
            assert time.monotonic() < deadline, (
                f"{hub.counters().get('shm_bad_records', 0) - bad} of {len(guesses)} joins "
                "refused; the others registered a peer that never opened the probe block"
            )
            hub.recv_frames(0.02)
        assert dealer.routing_id not in hub._lender.members()  # type: ignore[union-attr]
        assert hub.counters()["shm_joined"] == 1
        assert hub.counters()["shm_peers"] == 1
        assert spokes[0].counters()["borrowing"] == 1
        # The real worker still reads in place.
        payload = os.urandom(PAYLOAD)
        (got,) = _send_until_all(hub, spokes, _shared(hub, payload))
        assert bytes(got[1]) == payload
        assert spokes[0].counters()["shm_shared_frames"] >= 1
    finally:
        dealer.close(linger=0)
        for end in (hub, *spokes):
            end.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_a_block_held_past_its_lease_is_reclaimed_while_other_blocks_are_released(
    mode: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease runs per lent block: a worker that keeps one old block while it reads
    and releases newer ones does not renew the old block's lease with those releases."""
    lease = 1.0
    monkeypatch.setattr(lending, "LEASE_SECONDS", lease)
    hub, spokes = _fleet(mode, tmp_path, 1)
    try:
        first, frames, block, (got,) = _first_version(hub, spokes)
        held = got[1]  # kept: the worker never lets go of the first block
        lent_at = time.monotonic()
        got = frames = None
        releases = 0
        deadline = lent_at + 10 * lease
        while not hub.counters().get("shm_expired"):
            assert time.monotonic() < deadline, (
                f"the first block was never reclaimed, though {releases} releases of newer "
                f"blocks arrived over {time.monotonic() - lent_at:.1f}s (lease {lease:g}s)"
            )
            # A newer version in another block, read and let go of: a release each time.
            frames = _shared(hub, os.urandom(PAYLOAD))
            assert _block(hub, frames[1]) is not block
            _send_until_all(hub, spokes, frames)
            frames = None
            if not hub.counters().get("shm_expired"):
                _release(hub, spokes, 1)
                releases += 1
        assert releases >= 2, "the test must show releases of other blocks meanwhile"
        assert block.id not in hub._lender.pool.live_ids()  # type: ignore[union-attr]
        assert bytes(held) == first, "a block was rewritten under a worker reading it"
        assert hub.counters()["shm_peers"] == 0
    finally:
        for end in (hub, *spokes):
            end.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_a_learner_restarted_in_the_same_process_on_the_same_path_is_read_anew(
    mode: str, tmp_path: Any
) -> None:
    """A learner closed and made again in the same process, on the same ipc path, numbers
    its shared-memory blocks from the start again: its worker must read the new blocks,
    not its mapping of the old life's block of the same id (it once applied the new
    life's version 1 with the old life's bytes, under the right label)."""
    import torch

    from zmqsync import WeightReceiver, WeightSender, checksum

    endpoint = f"ipc://{tmp_path}/restart.sock"
    torch.manual_seed(0)
    learner = {"w": torch.randn(512, 512)}
    worker = {"w": torch.zeros(512, 512)}

    hub_cls, spoke_cls = resolve(f"zmq-{mode}")

    def make_sender() -> WeightSender:
        hub = hub_cls(endpoint)
        return WeightSender(hub, model=learner, strategy="state_dict", num_workers=1, timeout=20)

    sender = make_sender()
    receiver = WeightReceiver(spoke_cls(endpoint), model=worker, strategy="state_dict", timeout=20)
    try:
        receiver.connect()
        receiver.start()
        for _ in range(2):
            with torch.no_grad():
                learner["w"].add_(1.0)
            sender.send()
        assert checksum(worker, "state_dict") == checksum(learner, "state_dict")
        sender.close()
        with torch.no_grad():
            learner["w"].mul_(-3.0)
        sender = make_sender()
        for _ in range(2):
            with torch.no_grad():
                learner["w"].add_(5.0)
            sender.send()  # returns once the worker acked it: it followed the new life
            assert receiver.epoch == sender.epoch
            assert checksum(worker, "state_dict") == checksum(learner, "state_dict")
        assert sender.status()["totals"]["bytes_sent"] > 0
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("apply_mode", ["auto", "shared"])
@pytest.mark.parametrize("mode", MODES)
def test_the_version_a_worker_joins_on_is_read_in_place(
    mode: str, apply_mode: str, tmp_path: Any
) -> None:
    """The learner's version 0 lies in one of the hub's blocks though no worker had
    joined its lending when it was taken, so the first worker gets it leased once it
    joined: a shared-mode worker maps it, a default-mode one copies it straight into its
    model (no staging buffer, no frames through the socket). Before, it went through the
    socket: copied into a read-only private copy, or gathered in a staging buffer the
    worker then kept for good (its model twice)."""
    import torch

    from zmqsync import WeightReceiver, WeightSender, checksum

    hub_cls, spoke_cls = resolve(f"zmq-{mode}")
    learner = {f"w{i}": torch.full((768, 1024), float(i)) for i in range(4)}  # 12 MB
    worker = {k: torch.zeros_like(v) for k, v in learner.items()}
    hub = hub_cls(f"ipc://{tmp_path}/hub")
    sender = WeightSender(hub, model=learner, strategy="state_dict", num_workers=1, timeout=20)
    receiver = WeightReceiver(
        spoke_cls(hub.endpoint, identity="0"),
        model=worker,
        strategy="state_dict",
        worker_idx=0,
        apply_mode=apply_mode,
    )
    try:
        receiver.connect(timeout=20)
        with receiver.lock:
            assert receiver.version == 0 and checksum(worker) == checksum(learner)
        assert receiver.transport.counters()["shm_shared_frames"] > 0  # read in place
        assert receiver.staging.nbytes == 0
        if apply_mode == "shared":
            assert receiver.stats["shared_mapped"] == 1
            assert receiver.stats["shared_copied"] == 0
        receiver.start()
        for version in (1, 2):
            for t in learner.values():
                t.add_(1.0)
            sender.send()
            with receiver.lock:
                assert receiver.version == version
                assert checksum(worker) == checksum(learner)
        assert receiver.staging.nbytes == 0
    finally:
        receiver.close()
        sender.close()
