"""Every transport adapter passes the same contract (zmqsync.testing.check_transport)."""

from __future__ import annotations

import socket

import pytest

from zmqsync.testing import check_transport, memory_fleet
from zmqsync.transport import resolve


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
