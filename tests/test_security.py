"""CURVE on every socket: the right keys sync, wrong or unknown keys get nothing through."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from torch import nn

import zmqsync
from zmqsync import EndpointError, SyncTimeout, ZMQWeightSyncScheme
from zmqsync.protocol import StatusRequest, encode
from zmqsync.security import CurveClient, CurveServer, generate_keypair
from zmqsync.testing import check_transport
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke
from zmqsync.transport.zmq_router import RouterHub, RouterSpoke


@pytest.fixture
def keys():  # type: ignore[no-untyped-def]
    server_pub, server_sec = generate_keypair()
    good_pub, good_sec = generate_keypair()
    bad_pub, bad_sec = generate_keypair()
    server = CurveServer(server_pub, server_sec, frozenset({good_pub}))
    good = CurveClient(good_pub, good_sec, server_pub)
    unknown = CurveClient(bad_pub, bad_sec, server_pub)  # valid keys, not allowed
    wrong_server = CurveClient(good_pub, good_sec, generate_keypair()[0])
    return server, good, unknown, wrong_server


@pytest.mark.parametrize(
    ("hub_cls", "spoke_cls"), [(PubSubHub, PubSubSpoke), (RouterHub, RouterSpoke)]
)
def test_transports_pass_the_contract_with_curve(keys, hub_cls, spoke_cls) -> None:  # type: ignore[no-untyped-def]
    server, good, _, _ = keys

    def make(n: int):  # type: ignore[no-untyped-def]
        hub = hub_cls("tcp://127.0.0.1:*", curve=server)
        return hub, [spoke_cls(hub.endpoint, identity=str(i), curve=good) for i in range(n)]

    check_transport(make)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_wrong_or_unknown_keys_get_nothing_through(keys, mode) -> None:  # type: ignore[no-untyped-def]
    server, good, unknown, wrong_server = keys
    model = nn.Linear(4, 4)
    scheme = ZMQWeightSyncScheme(
        "state_dict", mode=mode, endpoint="tcp://127.0.0.1:*", timeout=3, curve_server=server
    )
    scheme.init_on_sender("policy", model=model)
    workers = []
    try:
        # A worker with the allowed key syncs.
        ok = ZMQWeightSyncScheme(
            "state_dict", mode=mode, endpoint=scheme.endpoint, curve_client=good
        )
        ok.init_on_receiver(model_id="policy", model=nn.Linear(4, 4), worker_idx=0)
        ok.connect(timeout=10)
        ok.start_receiver_thread()
        workers.append(ok)
        scheme.send()
        assert zmqsync.checksum(ok.model) == zmqsync.checksum(model)

        # Unknown client key, or the wrong server key: connect never gets an answer,
        # so no weights are received and no ack or request reaches the sender.
        for bad_keys in (unknown, wrong_server, None):
            bad = ZMQWeightSyncScheme(
                "state_dict", mode=mode, endpoint=scheme.endpoint, curve_client=bad_keys
            )
            bad.init_on_receiver(model_id="policy", model=nn.Linear(4, 4), worker_idx=9)
            workers.append(bad)
            with pytest.raises(SyncTimeout, match="no sender answered"):
                bad.connect(timeout=1.0)
            assert bad.get_receiver().version == 0
        # A sneaky ack from an unauthenticated PUSH and a status request from an
        # unauthenticated DEALER never arrive.
        ctx = zmq.Context.instance()
        announced = scheme.get_sender().transport.announce()
        with ctx.socket(zmq.PUSH) as push, ctx.socket(zmq.DEALER) as dealer:
            push.linger = dealer.linger = 0
            unknown.apply(push)
            unknown.apply(dealer)
            push.connect(announced["ack_endpoint"])
            dealer.connect(scheme.endpoint)
            ack = zmqsync.protocol.Ack(
                "policy", 99, scheme.get_sender().epoch, worker=0, applied=True
            )
            push.send_multipart(encode(ack), flags=zmq.NOBLOCK) if push.poll(
                100, zmq.POLLOUT
            ) else None
            dealer.send_multipart(encode(StatusRequest()), flags=zmq.NOBLOCK) if dealer.poll(
                100, zmq.POLLOUT
            ) else None
            assert dealer.poll(1000) == 0, "an unauthenticated status request was answered"
        status = scheme.status()
        assert {w["worker"] for w in status["workers"]} == {0}
        assert status["workers"][0]["version"] == 1  # the forged ack for 99 never counted
        deadline = time.monotonic() + 5
        while scheme.status()["totals"]["handshake_failures"] < 3:
            assert time.monotonic() < deadline, scheme.status()["totals"]
            time.sleep(0.05)
        # The real worker is untouched by all that.
        with torch.no_grad():
            model.weight.add_(1)
        scheme.send()
        assert zmqsync.checksum(ok.model) == zmqsync.checksum(model)
    finally:
        for w in workers:
            w.shutdown()
        scheme.shutdown()


def test_non_loopback_bind_needs_keys_or_insecure(caplog) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EndpointError, match="insecure=True"):
        PubSubHub("tcp://0.0.0.0:*")
    with caplog.at_level("WARNING", logger="zmqsync.transport"):
        hub = PubSubHub("tcp://0.0.0.0:*", insecure=True)
    hub.close()
    assert "without CURVE keys" in caplog.text


def test_key_files_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server_pub, server_sec = zmq.auth.create_certificates(tmp_path, "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    _, client_sec = zmq.auth.create_certificates(clients, "worker")
    server = CurveServer.from_files(server_sec, allowed_clients_dir=clients)
    client = CurveClient.from_files(client_sec, server_public_file=server_pub)
    assert client.server_key == server.public_key
    assert server.allowed_clients == {client.public_key}
    with pytest.raises(FileNotFoundError, match="zmqsync keys"):
        CurveClient.from_files(tmp_path / "nope.key_secret", server_public_file=server_pub)
    with pytest.raises(ValueError, match="secret"):
        CurveServer.from_files(server_pub)


def test_the_server_secret_never_travels_to_workers(keys) -> None:  # type: ignore[no-untyped-def]
    import pickle

    server, good, _, _ = keys
    scheme = ZMQWeightSyncScheme(curve_server=server, curve_client=good)
    clone = pickle.loads(pickle.dumps(scheme))
    assert clone.curve_server is None and clone.curve_client == good
