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
