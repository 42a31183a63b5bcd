"""A public kit for testing transports and fleets.

:func:`check_transport` is the conformance suite every adapter passes (the memory, ZeroMQ,
pipe and Ray ones in zmqsync's own tests, and yours)::

    def make_fleet(n):
        hub = MyHub(...)
        spokes = [MySpoke(hub.endpoint) for _ in range(n)]
        return hub, spokes

    zmqsync.testing.check_transport(make_fleet)

A fleet factory returns a hub and ``n`` spokes that can reach it. The suite closes them.
Each ability an end declares (``Lends``, ``Counted``..., see :mod:`zmqsync.transport.base`)
is checked too: its methods are the end's own, and they do what the ability promises.
"""

from __future__ import annotations

import json
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias

from zmqsync.errors import TransportClosed
from zmqsync.protocol import Buffer
from zmqsync.transport.base import (
    HUB_ABILITIES,
    SPOKE_ABILITIES,
    Ability,
    AdmitsPeers,
    Announces,
    Borrows,
    Counted,
    Follows,
    ForgetsPeers,
    HubTransport,
    Lends,
    Peekable,
    PeerId,
    SpokeTransport,
    Stream,
    TracksPeers,
    Waitable,
    ZeroCopy,
)
from zmqsync.transport.memory import MemoryHub, MemorySpoke

__all__ = ["ABILITY_CHECKS", "FleetFactory", "check_transport", "memory_fleet"]

FleetFactory = Callable[[int], tuple[HubTransport, Sequence[SpokeTransport]]]

#: Generous bound for one message to arrive on a loaded 2-core CI machine.
ARRIVAL: Final = 5.0
#: Bytes the Lends and ZeroCopy checks send: a frame this large a hub sends from its
#: lent memory or the caller's, never inline.
LENT_BYTES: Final = 1 << 20


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


# --- abilities --------------------------------------------------------------------------
#
# Each check takes the fleet once introduced: the hub, its spokes and their peer ids (which
# a check may update, as a peer that comes back may have a new one).

Check: TypeAlias = Callable[[HubTransport, Sequence[SpokeTransport], list[PeerId]], None]


def _declared(end: HubTransport | SpokeTransport) -> list[type[Ability]]:
    """The abilities ``end`` declares; AssertionError if one is not for its kind of end,
    or lacks a method of its own (renamed, or declared by registration only)."""
    kind, mine = (
        ("hub", HUB_ABILITIES) if isinstance(end, HubTransport) else ("spoke", SPOKE_ABILITIES)
    )
    cls = type(end).__name__
    for ability in (*HUB_ABILITIES, *SPOKE_ABILITIES):
        if ability not in mine and isinstance(end, ability):
            raise AssertionError(f"{cls} declares {ability.__name__}, which no {kind} can have")
    declared = [a for a in mine if isinstance(end, a)]
    for ability in declared:
        for name in sorted(ability.__abstractmethods__):
            method = getattr(type(end), name, None)
            if not callable(method) or getattr(method, "__isabstractmethod__", False):
                raise AssertionError(
                    f"{cls} declares {ability.__name__} but has no {name}() of its own "
                    f"(renamed?): define {name}(), or stop declaring {ability.__name__}"
                )
    return declared


def _recv_raw(spoke: SpokeTransport) -> list[Buffer]:
    """The next message at ``spoke`` as received (not copied to bytes)."""
    deadline = time.monotonic() + ARRIVAL
    while time.monotonic() < deadline:
        frames = spoke.recv_frames(max(0.0, deadline - time.monotonic()))
        if frames is not None:
            return frames
    raise AssertionError(f"spoke received nothing within {ARRIVAL}s")


def _check_counted(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """Every end that is Counted returns counts: str keys, ints >= 0."""
    for end in (hub, *spokes):
        if not isinstance(end, Counted):
            continue
        cls, counts = type(end).__name__, end.counters()
        assert isinstance(counts, dict), f"{cls}.counters() must return a dict, not {counts!r}"
        for key, value in counts.items():
            assert isinstance(key, str), f"{cls}.counters() has a key that is no str: {key!r}"
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, (
                f"{cls}.counters()[{key!r}] must be a count (an int >= 0), not {value!r}"
            )


def _check_waitable(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """Once a waiter looked until the hub was quiet (as a pump does before it waits), a
    message that comes makes a wait handle readable, and then ``has_input()`` True."""
    assert isinstance(hub, Waitable)
    handles, without_acks = hub.wait_handles(), hub.wait_handles(acks=False)
    for fds in (handles, without_acks):
        assert isinstance(fds, list) and all(isinstance(fd, int) for fd in fds), (
            f"wait_handles() must return a list of file descriptors, not {fds!r}"
        )
    assert set(without_acks) <= set(handles), "wait_handles(acks=False) may only leave out"
    deadline = time.monotonic() + ARRIVAL
    while hub.has_input():
        assert hub.recv_frames(0) is None, "the hub received a message nobody sent"
        assert time.monotonic() < deadline, "has_input() stays True with nothing to read"
    poller = select.poll()
    for fd in handles:
        poller.register(fd, select.POLLIN)
    spokes[0].send_frames([b"waitable"])
    deadline = time.monotonic() + ARRIVAL
    while not hub.has_input():  # readable means "look again": look, then wait again
        remaining_ms = max(0.0, deadline - time.monotonic()) * 1000
        assert poller.poll(remaining_ms), "a message came and no wait handle became readable"
    assert _b(_hub_recv(hub).frames) == [b"waitable"]


def _check_lends(hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]) -> None:
    """Memory the hub lends is writable, and its read-only views arrive whole; where the
    hub lends to some peer, a spoke that Borrows says so of what it read from it."""
    assert isinstance(hub, Lends)
    lending = hub.lending()
    assert isinstance(lending, bool), f"lending() must return a bool, not {lending!r}"
    lent = hub.lend(LENT_BYTES)
    if lent is None:
        return  # nothing to lend now: no peer reads in place, or every block is busy
    view = memoryview(lent).cast("B")
    assert view.nbytes >= LENT_BYTES and not view.readonly, (
        f"lend({LENT_BYTES}) must return that many writable bytes, or None"
    )
    pattern = (bytes(range(251)) * (LENT_BYTES // 251 + 1))[:LENT_BYTES]
    view[:LENT_BYTES] = pattern
    hub.send_frames([b"lent", view[:LENT_BYTES].toreadonly()], to=peers)
    said = []
    for spoke in spokes:
        frames = _recv_raw(spoke)
        assert _b(frames) == [b"lent", pattern], "a message sent from lent memory changed"
        if isinstance(spoke, Borrows):
            said.append(spoke.borrowed(frames))
        del frames  # let go of the lent memory, as a receiver does
    del view, lent
    assert not lending or not said or any(said), (
        "the hub lends to some peer, and no spoke that Borrows says it read lent memory"
    )


def _check_zero_copy(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """Small and large buffers still arrive whole once sent from the caller's memory."""
    assert isinstance(hub, ZeroCopy)
    hub.zero_copy_from(0)
    small, large = b"s" * 4096, b"L" * LENT_BYTES
    hub.send_frames([b"zero-copy", memoryview(small), memoryview(large)], to=[peers[1]])
    assert _spoke_recv(spokes[1]) == [b"zero-copy", small, large]


def _check_announces(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """The announcement is a dict that travels as JSON (in a sender's Welcome)."""
    assert isinstance(hub, Announces)
    announced = hub.announce()
    assert isinstance(announced, dict), f"announce() must return a dict, not {announced!r}"
    try:
        json.dumps(announced)
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"announce() must return what JSON can carry: {exc}") from exc


def _check_follows(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """Following the same announcement again changes nothing: acks and fan-outs arrive."""
    announced = hub.announce() if isinstance(hub, Announces) else {}
    for spoke in spokes:
        if isinstance(spoke, Follows):
            spoke.follow(dict(announced))
    for i, spoke in enumerate(spokes):
        spoke.send_frames([b"ack", str(i).encode()], ack=True)
        assert _b(_hub_recv(hub).frames) == [b"ack", str(i).encode()]
    _fan_out_until_all(hub, spokes, [b"fan", b"after following again"])


def _check_admits(hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]) -> None:
    """Admitting a peer again changes nothing: one fan-out reaches each spoke once."""
    assert isinstance(hub, AdmitsPeers)
    for peer in peers:
        hub.peer_joined(peer)
    hub.send_frames([b"once"])
    for i, spoke in enumerate(spokes):
        assert _spoke_recv(spoke) == [b"once"], f"spoke {i} missed a fan-out"
        assert spoke.recv_frames(0.2) is None, f"a fan-out reached spoke {i} twice"


def _check_forgets(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """A peer the hub was told left comes back with a hello, and is reached again."""
    assert isinstance(hub, ForgetsPeers)
    hub.peer_left(peers[2])
    spokes[2].send_frames([b"hello", b"again"])
    incoming = _hub_recv(hub)
    assert _b(incoming.frames) == [b"hello", b"again"], _b(incoming.frames)
    assert incoming.peer is not None, "a spoke's message must carry its peer id"
    peers[2] = incoming.peer
    if isinstance(hub, AdmitsPeers):
        hub.peer_joined(incoming.peer)
    hub.send_frames([b"welcome back"], to=[incoming.peer])
    assert _spoke_recv(spokes[2]) == [b"welcome back"], "a peer that came back is not reached"


def _check_tracks(hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]) -> None:
    """No open peer is lost, and each fixed peer is bound to a worker id of its own."""
    assert isinstance(hub, TracksPeers)
    lost, reserved = hub.lost_peers(), hub.reserved_workers()
    assert isinstance(lost, frozenset), f"lost_peers() must return a frozenset, not {lost!r}"
    assert not lost & set(peers), f"peers reported lost while they are open: {sorted(lost)}"
    assert isinstance(reserved, frozenset) and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in reserved
    ), f"reserved_workers() must return a frozenset of worker ids, not {reserved!r}"
    assert len(reserved) == len(peers), f"{len(peers)} fixed peers, worker ids {sorted(reserved)}"


def _check_peekable(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """A message that waits makes ``has_input()`` True (False only when surely none)."""
    for spoke, peer in zip(spokes, peers, strict=True):
        if not isinstance(spoke, Peekable):
            continue
        hub.send_frames([b"peek"], to=[peer])
        deadline = time.monotonic() + ARRIVAL
        while not spoke.has_input():
            assert time.monotonic() < deadline, "has_input() stayed False while a message came"
            time.sleep(0.01)  # a spoke has nothing to wait on but this answer
        assert _spoke_recv(spoke) == [b"peek"]


def _check_borrows(
    hub: HubTransport, spokes: Sequence[SpokeTransport], peers: list[PeerId]
) -> None:
    """``borrowed()`` answers, with a bool, for what a spoke received (see Lends' check)."""
    for spoke, peer in zip(spokes, peers, strict=True):
        if not isinstance(spoke, Borrows):
            continue
        hub.send_frames([b"borrowed?"], to=[peer])
        frames = _recv_raw(spoke)
        assert _b(frames) == [b"borrowed?"], _b(frames)
        answer = spoke.borrowed(frames)
        assert isinstance(answer, bool), f"borrowed() must return a bool, not {answer!r}"


#: What each ability is checked for, in the order run: a check runs where the hub or a
#: spoke declares its ability. ZeroCopy comes late, as it changes what the hub copies;
#: Counted last, to read the counts after all the rest.
ABILITY_CHECKS: Final[dict[type[Ability], Check]] = {
    Announces: _check_announces,
    Follows: _check_follows,
    AdmitsPeers: _check_admits,
    ForgetsPeers: _check_forgets,
    TracksPeers: _check_tracks,
    Peekable: _check_peekable,
    Borrows: _check_borrows,
    Waitable: _check_waitable,
    Lends: _check_lends,
    ZeroCopy: _check_zero_copy,
    Counted: _check_counted,
}


def check_transport(make_fleet: FleetFactory) -> None:
    """Run the transport contract (see :mod:`zmqsync.transport.base`) on an adapter.

    Raises ``AssertionError`` naming the first broken promise. Each ability a hub or
    spoke declares is checked as :data:`ABILITY_CHECKS` says.
    """
    hub, spokes = make_fleet(3)
    try:
        declared = set(_declared(hub)).union(*(_declared(spoke) for spoke in spokes))
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

        # The abilities the ends declare.
        for ability, check in ABILITY_CHECKS.items():
            if ability in declared:
                check(hub, spokes, peers)

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
