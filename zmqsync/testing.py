"""A public kit for testing transports and fleets.

:func:`check_transport` is the conformance suite every adapter passes (the memory, ZeroMQ,
pipe and Ray ones in zmqsync's own tests, and yours)::

    def make_fleet(n):
        hub = MyHub(...)
        spokes = [MySpoke(hub.endpoint) for _ in range(n)]
        return hub, spokes

    zmqsync.testing.check_transport(make_fleet)

A fleet factory returns a hub and ``n`` spokes that can reach it. The suite closes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from zmqsync.errors import TransportClosed
from zmqsync.protocol import Buffer
from zmqsync.transport.base import (
    AdmitsPeers,
    Announces,
    Follows,
    HubTransport,
    PeerId,
    SpokeTransport,
    Stream,
)
from zmqsync.transport.memory import MemoryHub, MemorySpoke

__all__ = ["FleetFactory", "check_transport", "memory_fleet"]

FleetFactory = Callable[[int], tuple[HubTransport, Sequence[SpokeTransport]]]

#: Generous bound for one message to arrive on a loaded 2-core CI machine.
ARRIVAL: Final = 5.0


def memory_fleet(n: int) -> tuple[MemoryHub, list[MemorySpoke]]:
    """An in-memory hub with ``n`` spokes."""
    hub = MemoryHub()
    return hub, [MemorySpoke(hub.endpoint) for _ in range(n)]


def _b(frames: Sequence[Buffer] | None) -> list[bytes] | None:
    return None if frames is None else [bytes(f) for f in frames]


def _hub_recv(hub: HubTransport, timeout: float = ARRIVAL):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        incoming = hub.recv_frames(max(0.0, deadline - time.monotonic()))
        if incoming is not None:
            return incoming
    raise AssertionError(f"hub received nothing within {timeout}s")


def _spoke_recv(spoke: SpokeTransport, timeout: float = ARRIVAL) -> list[bytes]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frames = spoke.recv_frames(max(0.0, deadline - time.monotonic()))
        if frames is not None:
            return _b(frames) or []
    raise AssertionError(f"spoke received nothing within {timeout}s")


def _introduce(hub: HubTransport, spokes: Sequence[SpokeTransport]) -> list[PeerId]:
    """Each spoke speaks first, so the hub knows its peer id (as a sender's Hello does),
    and a hub that admits peers is told it may keep them (as a sender's Welcome does)."""
    peers: list[PeerId] = []
    for i, spoke in enumerate(spokes):
        spoke.send_frames([b"hello", str(i).encode()])
        incoming = _hub_recv(hub)
        assert _b(incoming.frames) == [b"hello", str(i).encode()], _b(incoming.frames)
        assert incoming.peer is not None, "a spoke's message must carry its peer id"
        if isinstance(hub, AdmitsPeers):
            hub.peer_joined(incoming.peer)
        peers.append(incoming.peer)
    assert len(set(peers)) == len(peers), f"peer ids must be unique: {peers}"
    announced = hub.announce() if isinstance(hub, Announces) else {}
    for spoke in spokes:
        if isinstance(spoke, Follows):
            spoke.follow(announced)
    return peers


def _fan_out_until_all(
    hub: HubTransport, spokes: Sequence[SpokeTransport], frames: list[bytes]
) -> None:
    """Fan-out may miss a spoke whose subscription is not live yet (ZeroMQ's slow
    joiner); like the receiver's probe, repeat until every spoke has one copy."""
    pending = set(range(len(spokes)))
    deadline = time.monotonic() + ARRIVAL
    while pending:
        assert time.monotonic() < deadline, f"fan-out never reached spokes {sorted(pending)}"
        hub.send_frames(frames)
        for i in sorted(pending):
            got = _b(spokes[i].recv_frames(0.05))
            if got is not None:
                assert got == frames, got
                pending.discard(i)
    for spoke in spokes:  # drop the repeats: until a spoke has been quiet for a while
        while spoke.recv_frames(0.3) is not None:
            pass


def check_transport(make_fleet: FleetFactory) -> None:
    """Run the transport contract (see :mod:`zmqsync.transport.base`) on an adapter.

    Raises ``AssertionError`` naming the first broken promise.
    """
    hub, spokes = make_fleet(3)
    try:
        peers = _introduce(hub, spokes)

        # Order and integrity, spoke -> hub, with empty and multi-MiB frames.
        big = bytes(range(256)) * (4 * 4096)
        for n in range(5):
            spokes[0].send_frames([b"seq", str(n).encode(), b"", big[: n * 1000]])
        for n in range(5):
            incoming = _hub_recv(hub)
            assert _b(incoming.frames) == [b"seq", str(n).encode(), b"", big[: n * 1000]]
            assert incoming.peer == peers[0]

        # Addressed sends reach exactly their peers, with memoryviews sent as given.
        hub.send_frames([b"to-1", memoryview(big)], to=[peers[1]])
        assert _spoke_recv(spokes[1]) == [b"to-1", big]
        for other in (spokes[0], spokes[2]):
            assert other.recv_frames(0.1) is None, "an addressed send reached another peer"
        hub.send_frames([b"to-0-2"], to=[peers[0], peers[2]])
        assert _spoke_recv(spokes[0]) == [b"to-0-2"]
        assert _spoke_recv(spokes[2]) == [b"to-0-2"]

        # Fan-out reaches every spoke.
        _fan_out_until_all(hub, spokes, [b"fan", big])

        # A version's chunks, marked as such, arrive in order; an ack arrives whole (on
        # an ack channel, perhaps, where the hub cannot tell who sent it).
        hub.send_frames([b"chunk", b"0"], to=[peers[1]], stream=Stream.START)
        hub.send_frames([b"chunk", b"1"], to=[peers[1]], stream=Stream.MORE)
        assert _spoke_recv(spokes[1]) == [b"chunk", b"0"]
        assert _spoke_recv(spokes[1]) == [b"chunk", b"1"]
        spokes[0].send_frames([b"ack", b"0"], ack=True)
        incoming = _hub_recv(hub)
        assert _b(incoming.frames) == [b"ack", b"0"], _b(incoming.frames)
        assert incoming.peer in (None, peers[0]), "an ack came from another peer"

        # The sender may change its buffer once send_frames returned and the peer has it.
        scratch = bytearray(b"A" * 1024)
        hub.send_frames([b"x", memoryview(scratch)], to=[peers[0]])
        got = _spoke_recv(spokes[0])
        scratch[:] = b"B" * 1024
        assert got == [b"x", b"A" * 1024], "a received message changed with the sender's memory"

        # Timeouts: recv returns None, promptly, and does not wait much past its timeout.
        start = time.monotonic()
        assert hub.recv_frames(0.2) is None
        assert spokes[0].recv_frames(0.2) is None
        took = time.monotonic() - start
        assert 0.35 <= took < 2.0, f"two 0.2 s receives took {took:.2f}s"
        assert hub.recv_frames(0) is None

        # wake() from another thread ends a blocked recv.
        timer = threading.Timer(0.1, hub.wake)
        start = time.monotonic()
        timer.start()
        assert hub.recv_frames(10.0) is None
        assert time.monotonic() - start < 5.0, "wake() did not end a blocked recv_frames"
        timer.join(5.0)

        # Sending to a peer that is gone neither raises nor blocks.
        spokes[2].close()
        start = time.monotonic()
        hub.send_frames([b"to-the-dead"], to=[peers[2]])
        hub.send_frames([b"fan-with-a-dead-one"])
        assert time.monotonic() - start < 2.0, "sending to a closed peer blocked"
        assert _spoke_recv(spokes[0])[:1] == [b"fan-with-a-dead-one"]

        # Closing: idempotent; any use afterwards raises TransportClosed.
        for end in (hub, *spokes):
            end.close()
            end.close()
            assert end.closed
        for call in (
            lambda: hub.send_frames([b"x"]),
            lambda: hub.recv_frames(0),
            lambda: spokes[0].send_frames([b"x"]),
            lambda: spokes[0].recv_frames(0),
        ):
            try:
                call()
            except TransportClosed:
                continue
            raise AssertionError("a closed transport must raise TransportClosed when used")
    finally:
        for end in (hub, *spokes):
            end.close()
