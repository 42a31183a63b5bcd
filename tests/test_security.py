"""CURVE on every socket: the right keys sync, wrong or unknown keys get nothing through."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
import torch
import zmq
from torch import nn

import zmqsync
from zmqsync import EndpointError, SyncTimeout, ZMQWeightSyncScheme
from zmqsync.protocol import StatusRequest, encode
from zmqsync.security import CurveClient, CurveServer, generate_keypair
from zmqsync.testing import check_transport
from zmqsync.tools.client import create_curve_keypair
from zmqsync.transport._zmq import HANDSHAKE_SECONDS
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


# --- key files ---------------------------------------------------------------------

_IN_ATTRIB = 0x004  # inotify: a file's metadata (its mode, among others) changed
_IN_CREATE = 0x100  # inotify: a file was created in the watched directory
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, name length


def _inotify_watch(directory: Path) -> int:
    """An inotify descriptor (non-blocking) watching ``directory`` for new files and
    changed metadata. The kernel queues events during the very syscalls that cause
    them, so reading after the code under test returns sees all of them."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    if libc.inotify_add_watch(fd, str(directory).encode(), _IN_CREATE | _IN_ATTRIB) < 0:
        os.close(fd)
        raise OSError(ctypes.get_errno(), "inotify_add_watch")
    return fd


def _inotify_events(fd: int) -> list[tuple[str, int]]:
    """The (file name, event mask) pairs queued on ``fd`` so far."""
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return []
    events, offset = [], 0
    while offset < len(data):
        _, mask, _, length = _INOTIFY_EVENT.unpack_from(data, offset)
        offset += _INOTIFY_EVENT.size
        name = data[offset : offset + length].rstrip(b"\0").decode()
        offset += length
        events.append((name, mask))
    return events


def test_a_secret_key_file_is_private_from_its_creation(tmp_path: Path) -> None:
    """The secret file is created with mode 0600, not created readable and chmodded
    after: no change of its metadata ever follows its creation."""
    watch = _inotify_watch(tmp_path)
    try:
        public, secret = create_curve_keypair(tmp_path, "learner")
        events = [mask for name, mask in _inotify_events(watch) if name == secret.name]
    finally:
        os.close(watch)
    assert events == [_IN_CREATE], f"the secret file changed after its creation: {events}"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not stat.S_IMODE(public.stat().st_mode) & 0o022  # nobody else writes it
    server = CurveServer.from_files(secret)
    assert CurveClient.from_files(secret, server_public_file=public).server_key == (
        server.public_key
    )


def test_new_keys_never_go_into_an_existing_file_or_link(tmp_path: Path) -> None:
    """--force makes a fresh file (a reader that held the old one open never sees the
    new key), and a planted link is never followed."""
    _, secret = create_curve_keypair(tmp_path, "learner")
    secret.chmod(0o644)  # an old key file, once readable by others
    with secret.open("rb") as old:
        _, again = create_curve_keypair(tmp_path, "learner", force=True)
        new_key = zmq.auth.load_certificate(again)[1]
        assert new_key is not None and new_key not in old.read()
    assert stat.S_IMODE(again.stat().st_mode) == 0o600
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "planted.key_secret").symlink_to(elsewhere)
    with pytest.raises(FileExistsError):
        create_curve_keypair(tmp_path, "planted")
    assert not elsewhere.exists(), "the secret key was written through a planted link"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_loading_a_secret_key_file_others_can_read_warns(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    public, secret = create_curve_keypair(tmp_path, "learner")
    with caplog.at_level(logging.WARNING, logger="zmqsync.security"):
        CurveServer.from_files(secret)
    assert not caplog.records, "a private secret key file needs no warning"
    secret.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="zmqsync.security"):
        CurveServer.from_files(secret)
        CurveClient.from_files(secret, server_public_file=public)
    assert len(caplog.records) == 2
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert str(secret) in caplog.text and f"chmod 600 {secret}" in caplog.text


def test_a_tcp_loopback_hub_without_keys_warns_that_local_users_reach_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server_pub, server_sec = generate_keypair()
    with caplog.at_level(logging.WARNING, logger="zmqsync.transport"):
        for quiet in (
            PubSubHub(f"ipc://{tmp_path}/hub"),
            RouterHub("tcp://127.0.0.1:*", curve=CurveServer(server_pub, server_sec)),
        ):
            quiet.close()
        assert not caplog.records, caplog.text
        for hub_cls in (PubSubHub, RouterHub):
            hub_cls("tcp://127.0.0.1:*").close()
    assert len(caplog.records) == 2
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert "every user of this host" in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hub_cls", [PubSubHub, RouterHub])
def test_a_connection_that_never_handshakes_is_dropped_quickly(hub_cls) -> None:  # type: ignore[no-untyped-def]
    """A client that connects to a listening socket and says nothing holds a connection
    (a descriptor) of the hub only for the handshake interval, not ZeroMQ's 30 s."""
    hub = hub_cls("tcp://127.0.0.1:*")
    announced = hub.announce()
    addresses = [hub.endpoint, announced["ack_endpoint"], announced.get("data_endpoint")]
    idle = []
    try:
        for address in filter(None, addresses):
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        opened = time.monotonic()
        deadline = opened + HANDSHAKE_SECONDS + 5
        open_ones = list(idle)
        while open_ones:
            assert time.monotonic() < deadline, (
                f"{len(open_ones)} of {len(idle)} silent connections still open after "
                f"{time.monotonic() - opened:.1f}s"
            )
            for sock in list(open_ones):
                sock.settimeout(0.1)
                try:
                    if sock.recv(4096) == b"":  # the hub's greeting comes first, then EOF
                        open_ones.remove(sock)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    open_ones.remove(sock)
        assert time.monotonic() - opened >= HANDSHAKE_SECONDS * 0.5  # not refused at once
    finally:
        for sock in idle:
            sock.close()
        hub.close()
