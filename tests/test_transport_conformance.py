"""Every transport adapter passes the same contract (zmqsync.testing.check_transport)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from zmqsync.testing import ABILITY_CHECKS, check_transport, memory_fleet
from zmqsync.transport import ALIASES, resolve
from zmqsync.transport.base import (
    HUB_ABILITIES,
    SPOKE_ABILITIES,
    Counted,
    Lends,
    Peekable,
    TracksPeers,
    ZeroCopy,
    counters,
    reserved_workers,
)
from zmqsync.transport.memory import MemoryHub, MemorySpoke


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _zmq_fleet(alias: str, endpoint_kind: str, tmp_path):  # type: ignore[no-untyped-def]
    hub_cls, spoke_cls = resolve(alias)

    def make(n: int):  # type: ignore[no-untyped-def]
        if endpoint_kind == "ipc":
            endpoint = f"ipc://{tmp_path}/hub"
        elif endpoint_kind == "tcp":
            endpoint = "tcp://127.0.0.1:*"
        else:
            endpoint = f"inproc://conformance-{alias}-{_free_port()}"
        hub = hub_cls(endpoint)
        return hub, [spoke_cls(hub.endpoint, identity=str(i)) for i in range(n)]

    return make


def test_memory_transport() -> None:
    check_transport(memory_fleet)


@pytest.mark.parametrize("endpoint_kind", ["ipc", "tcp", "inproc"])
@pytest.mark.parametrize("alias", ["zmq-pubsub", "zmq-router"])
def test_zmq_transports(alias: str, endpoint_kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    check_transport(_zmq_fleet(alias, endpoint_kind, tmp_path))


def test_unknown_alias_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'zmq-router'"):
        resolve("zmq-routr")


def _until_subscribed(hub, sub) -> None:  # type: ignore[no-untyped-def]
    """Probe until ``sub``'s subscription reached the hub's PUB, then drain the probes."""
    import time

    deadline = time.monotonic() + 10
    while not sub.poll(10):  # the subscription takes a moment to reach the PUB
        hub.send_frames([b"probe"])
        assert time.monotonic() < deadline, "the subscription never reached the PUB"
    while sub.poll(0):
        sub.recv_multipart()


def test_a_zmq_hub_sends_small_buffers_from_the_callers_memory_when_told() -> None:
    """pyzmq copies parts under 64 KiB; a sender that packs nothing (``pack_threshold=0``)
    tells its hub ``zero_copy_from(0)``, and then even a 4 KiB tensor goes from its own
    memory. Over inproc a queued message still points at what was sent, so a change made
    after the send shows whether it was copied. (A sender lends a transport only memory
    it owns and never rewrites while lent; this is the transport's own behaviour.)"""
    import numpy as np
    import zmq

    from zmqsync.transport.zmq_pubsub import PubSubHub

    ctx = zmq.Context()
    hub = PubSubHub(f"inproc://zero-copy-{_free_port()}", context=ctx)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.subscribe(b"")
        sub.connect(hub.announce()["data_endpoint"])
        _until_subscribed(hub, sub)

        def sent_then_changed() -> bytes:
            weights = np.zeros(4096, dtype=np.uint8)  # a small tensor's (writable) memory
            hub.send_frames([b"head", memoryview(weights)])
            weights[:] = 7  # the caller changes its tensor after the send
            assert sub.poll(5000), "the message never arrived"
            _, body = sub.recv_multipart()
            return body

        assert sent_then_changed() == bytes(4096)  # copied: the send's values
        hub.zero_copy_from(0)
        assert sent_then_changed() == bytes([7]) * 4096  # zero-copy: the memory itself
        hub.zero_copy_from(10**9)  # never above pyzmq's own threshold
        assert sent_then_changed() == bytes(4096)
    finally:
        sub.close(linger=0)
        hub.close()
        ctx.term()


# --- abilities: declared, and checked -----------------------------------------------------


def _fleet_of(hub_cls: type[MemoryHub], spoke_cls: type[MemorySpoke] = MemorySpoke):  # type: ignore[no-untyped-def]
    def make(n: int) -> tuple[MemoryHub, list[MemorySpoke]]:
        hub = hub_cls()
        return hub, [spoke_cls(hub.endpoint) for _ in range(n)]

    return make


class _Lender(MemoryHub, Lends):
    """A memory hub that lends nothing: a correct (if idle) Lends."""

    def lending(self) -> bool:
        return False

    def lend(self, nbytes: int) -> Any:
        return None


@pytest.mark.timeout(30)
def test_a_hub_that_declares_an_ability_and_keeps_its_promise_passes() -> None:
    check_transport(_fleet_of(_Lender))


@pytest.mark.timeout(30)
def test_an_ability_whose_method_was_renamed_fails_check_transport() -> None:
    # Declared by subclassing: the class cannot even be made, here or anywhere.
    class RenamedLender(MemoryHub, Lends):
        def lending(self) -> bool:
            return False

        def lend_memory(self, nbytes: int) -> Any:  # was lend()
            return None

    with pytest.raises(TypeError, match=r"RenamedLender.* lend\b"):
        check_transport(_fleet_of(RenamedLender))


@pytest.mark.timeout(30)
def test_an_ability_registered_without_its_method_fails_check_transport() -> None:
    class RegisteredLender(MemoryHub):
        def lending(self) -> bool:
            return False

        def lend_memory(self, nbytes: int) -> Any:  # was lend()
            return None

    Lends.register(RegisteredLender)  # a declaration that Python does not check
    with pytest.raises(
        AssertionError, match=r"RegisteredLender declares Lends but has no lend\(\) of its own"
    ):
        check_transport(_fleet_of(RegisteredLender))


@pytest.mark.timeout(30)
def test_an_ability_that_breaks_its_promise_fails_check_transport() -> None:
    class Blind(MemorySpoke, Peekable):
        def has_input(self) -> bool:
            return False  # "surely nothing waits", while messages do

    with pytest.raises(AssertionError, match=r"has_input\(\) stayed False while a message came"):
        check_transport(_fleet_of(MemoryHub, Blind))

    class Unbound(MemoryHub, TracksPeers):
        def lost_peers(self) -> frozenset[bytes]:
            return frozenset()

        def reserved_workers(self) -> frozenset[int]:
            return frozenset({0})  # three fixed peers, one worker id

    with pytest.raises(AssertionError, match=r"3 fixed peers, worker ids \[0\]"):
        check_transport(_fleet_of(Unbound))


@pytest.mark.timeout(30)
def test_an_end_may_declare_only_the_abilities_of_its_kind() -> None:
    class CopyingSpoke(MemorySpoke, ZeroCopy):
        def zero_copy_from(self, nbytes: int) -> None:
            pass

    with pytest.raises(AssertionError, match="CopyingSpoke declares ZeroCopy, which no spoke"):
        check_transport(_fleet_of(MemoryHub, CopyingSpoke))


@pytest.mark.timeout(30)
def test_an_ability_is_its_declaration_not_a_method_name() -> None:
    class Undeclared(MemoryHub):
        def counters(self) -> dict[str, int]:
            return {"sends": 1}

        def reserved_workers(self) -> frozenset[int]:
            return frozenset({7})

    hub = Undeclared()
    try:
        assert not isinstance(hub, Counted | TracksPeers)
        assert counters(hub) == {}
        assert reserved_workers(hub) == frozenset()
    finally:
        hub.close()


@pytest.mark.timeout(30)
def test_every_ability_has_a_check() -> None:
    assert set(ABILITY_CHECKS) == {*HUB_ABILITIES, *SPOKE_ABILITIES}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_shipped_transports_declare_every_ability_they_have(alias: str) -> None:
    """A class with all of an ability's methods declares it: else the methods would sit
    there unused, the ability silently off."""
    for cls, kinds in zip(resolve(alias), (HUB_ABILITIES, SPOKE_ABILITIES), strict=True):
        for ability in kinds:
            names = ability.__abstractmethods__
            if all(callable(getattr(cls, name, None)) for name in names):
                assert issubclass(cls, ability), f"{cls.__name__} has {sorted(names)}, undeclared"
