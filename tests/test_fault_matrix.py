"""The fault matrix: each fault or forgery, on each transport it applies to.

Faults: SIGKILL (the worker restarted after), SIGSTOP + SIGCONT, forged acks, goodbyes
and snapshot requests from a peer with valid keys, a port squatter, garbage, oversized
messages, and a peer with the wrong CURVE keys. ZeroMQ runs over tcp with CURVE on
every socket; pipes and Ray actors have no listening socket, so only the process faults
apply to them.

Every case ends with the same checks: every live worker holds the latest version, every
version a worker applied has the checksum the learner sent for it, no worker went
backwards, no send outlived its timeout, and the learner's memory stayed bounded.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import _workers
import pytest
import ray
import zmq
from _faults import raw_sockets, rss_bytes, squatter, stop, until
from _workers import bump, make_model
from conftest import Fleet

import zmqsync
from zmqsync import MultiProcessWeightSyncScheme, SyncTimeout, ZMQWeightSyncScheme
from zmqsync.protocol import Ack, Goodbye, SnapshotRequest, encode
from zmqsync.schemes.ray import RayWeightSyncScheme
from zmqsync.security import CurveClient, CurveServer, generate_keypair
from zmqsync.transport.ray import WeightSyncActorMixin

pytestmark = pytest.mark.slow

# Ray's workers cannot import the test modules: ship them (and the model maker) by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(_workers)

#: Seconds a send waits for acks, and what a loaded 2-core machine may add to it.
TIMEOUT = 2.0
SLACK = 3.0
#: The most the learner's resident memory may grow over a case (its model is 64 KiB).
RSS_BOUND = 256 * 1024 * 1024
ZMQ_FAULTS = ("sigkill", "sigstop", "forged", "squatter", "garbage", "oversized", "wrong_curve")
PROCESS_FAULTS = ("sigkill", "sigstop")


@dataclass
class Learner:
    """A scheme's sender side, with what each version's bytes were and how long each
    send took."""

    scheme: Any
    model: Any
    sent: dict[int, str] = field(default_factory=dict)
    slowest: float = 0.0
    timeouts: int = 0

    def __post_init__(self) -> None:
        # Version 0: the weights the learner started with, what a worker gets at connect.
        self.sent[0] = zmqsync.checksum(self.model)

    def send(self, **kw: Any) -> None:
        """Bump the model (a training step) and send it; a timeout is counted, not
        raised, and every send must return within its timeout."""
        bump(self.model)
        checksum = zmqsync.checksum(self.model)
        sender = self.scheme.get_sender()
        start = time.monotonic()
        try:
            self.scheme.send(**kw)
        except SyncTimeout:
            self.timeouts += 1
        finally:
            self.sent[sender.version] = checksum
            elapsed = time.monotonic() - start
            self.slowest = max(self.slowest, elapsed)
            assert elapsed < TIMEOUT + SLACK, f"a send took {elapsed:.1f}s"

    def exact(self, applied: list[tuple[int, int, str]], who: str) -> None:
        versions = [v for _, v, _ in applied]
        assert versions == sorted(set(versions)), f"{who} went backwards: {versions}"
        for _, version, checksum in applied:
            assert checksum == self.sent.get(version), f"{who} applied a torn version {version}"
        assert versions and versions[-1] == self.scheme.get_sender().version, (
            f"{who} ended at {versions[-1:]}, not {self.scheme.get_sender().version}"
        )


def _report(case: str, learner: Learner, rss: int) -> None:
    totals = learner.scheme.get_sender().status()["totals"]
    counted = {k: totals.get(k, 0) for k in ("rejected_frames", "forged", "handshake_failures")}
    print(
        f"\nFAULT {case}: {len(learner.sent) - 1} sends, {learner.timeouts} timed out, slowest "
        f"{learner.slowest:.2f}s, counted {counted}, learner RSS +{rss / 2**20:.0f} MiB"
    )


# --- ZeroMQ: every fault ------------------------------------------------------------


@pytest.fixture(scope="module")
def curve() -> tuple[CurveServer, CurveClient, CurveClient]:
    server_pub, server_sec = generate_keypair()
    good_pub, good_sec = generate_keypair()
    bad_pub, bad_sec = generate_keypair()
    server = CurveServer(server_pub, server_sec, frozenset({good_pub}))
    return (
        server,
        CurveClient(good_pub, good_sec, server_pub),
        CurveClient(bad_pub, bad_sec, server_pub),
    )


def _fault(
    fault: str, fleet: Fleet, learner: Learner, keys: tuple[CurveClient, CurveClient]
) -> None:
    """Do ``fault`` to a fleet of workers 0 and 1, sending meanwhile."""
    good, bad = keys
    sender = learner.scheme.get_sender()
    addresses = [sender.endpoint, *sender.transport.announce().values()]
    ack_endpoint = sender.transport.announce()["ack_endpoint"]
    both = [(zmq.PUSH, ack_endpoint), (zmq.DEALER, sender.endpoint)]  # acks, requests
    if fault == "sigkill":
        fleet.kill(1)
        learner.send()  # worker 1 is missing: a timeout that names it
        fleet.start(learner.scheme, 1, kind="wide")  # restarted: same id, new process
        fleet.wait_ready(1)
    elif fault == "sigstop":
        stop(fleet.procs[1].pid)  # type: ignore[arg-type]
        try:
            learner.send()
            bump(learner.model)  # the next step changes the tensors in place, unsent
            learner.send()
        finally:
            os.kill(fleet.procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
    elif fault == "forged":
        with raw_sockets(*both, keys=good) as (p, d):
            forged = [SnapshotRequest("policy", 0, 0, 100 + i) for i in range(100)]
            forged += [Goodbye("policy", 1, sender.epoch, 1, "0" * 32)]
            for message in forged:
                p.send_multipart(encode(message))
                d.send_multipart(encode(message))
            stop(fleet.procs[1].pid)  # type: ignore[arg-type]
            try:
                ack = Ack("policy", sender.version + 1, sender.epoch, 1, True, session="0" * 32)
                for _ in range(5):
                    p.send_multipart(encode(ack))
                learner.send()  # the forged acks do not stand in for the stopped worker
                assert learner.timeouts == 1
            finally:
                os.kill(fleet.procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
    elif fault == "squatter":
        with squatter(addresses) as squatted:
            stop(fleet.procs[1].pid)  # type: ignore[arg-type]
            try:
                learner.send()
            finally:
                os.kill(fleet.procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
        assert not squatted, f"a squatter bound {squatted}"
    elif fault == "garbage":
        for address in addresses:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(os.urandom(4096))
        with raw_sockets(*both, keys=good) as (p, d):
            for junk in ([b"junk"], [os.urandom(60), b"{}"], [b"ZSY1" + bytes(60)]):
                p.send_multipart(junk)
                d.send_multipart(junk)
        learner.send()
    elif fault == "oversized":
        with raw_sockets(*both, keys=good) as (p, d):
            big = os.urandom(4 * 1024 * 1024)  # over the control sockets' 1 MiB limit
            for _ in range(20):
                p.send_multipart([big])
                d.send_multipart([big])
        learner.send()
    elif fault == "wrong_curve":
        wrong_server = CurveClient(good.public_key, good.secret_key, generate_keypair()[0])
        for keys_used in (bad, wrong_server):
            with raw_sockets((zmq.DEALER, sender.endpoint), keys=keys_used) as (d,):
                # Its handshake fails: once the learner has refused it, the DEALER has no
                # connection to queue the request to (zmq.Again), which is fine too.
                with contextlib.suppress(zmq.Again):
                    d.send_multipart(encode(SnapshotRequest("policy", 0, 0, 1)), flags=zmq.NOBLOCK)
                assert not d.poll(1000), "a peer with the wrong keys was answered"
        until(
            lambda: sender.status()["totals"]["handshake_failures"] >= 1,
            10,
            "the failed handshakes were counted",
        )
        learner.send()
    else:
        raise AssertionError(fault)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ZMQ_FAULTS)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_zeromq_fleet_under(fault: str, mode: str, fleet: Fleet, curve: Any) -> None:
    server, good, bad = curve
    model = make_model("wide", seed=0)
    scheme = ZMQWeightSyncScheme(
        "state_dict",
        mode=mode,
        endpoint="tcp://127.0.0.1:*",
        timeout=TIMEOUT,
        heartbeat=0.5,
        curve_server=server,
        curve_client=good,
    )
    scheme.init_on_sender("policy", model=model, num_workers=2)
    learner = Learner(scheme, model)
    try:
        for i in range(2):
            fleet.start(scheme, i, kind="wide")
        for i in range(2):
            fleet.wait_ready(i)
        learner.send()
        rss = rss_bytes()
        _fault(fault, fleet, learner, (good, bad))
        # Everyone converges: the next sends reach both workers.
        until(
            lambda: _settled(learner),
            60,
            "both workers acked a send after the fault",
        )
        growth = rss_bytes() - rss
        assert growth < RSS_BOUND, f"the learner grew by {growth / 2**20:.0f} MiB"
        for i in range(2):
            learner.exact(fleet.ask(i, "applied"), f"worker {i}")
            assert fleet.ask(i, "state")["checksum"] == zmqsync.checksum(model)
        _report(f"{mode} {fault}", learner, growth)
    finally:
        scheme.shutdown()


def _settled(learner: Learner) -> bool:
    """Send once more; True when every targeted worker acked it."""
    before = learner.timeouts
    learner.send()
    return learner.timeouts == before


# --- pipes: process faults ------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", PROCESS_FAULTS)
@pytest.mark.parametrize("share", [False, True], ids=["copy", "share_params"])
def test_pipe_fleet_under(fault: str, share: bool, fleet: Fleet) -> None:
    spawn = mp.get_context("spawn")
    pipes = [spawn.Pipe() for _ in range(2)]
    model = make_model("wide", seed=0)
    # share_params: the workers copy from the learner's own tensors, which the learner
    # changes in place between sends (a stopped worker must still read whole versions).
    scheme = MultiProcessWeightSyncScheme("state_dict", timeout=TIMEOUT, share_params=share)
    for i, (_, child) in enumerate(pipes):
        fleet.start(scheme, i, kind="wide", init_kwargs={"pipe": child, "worker_idx": None})
        child.close()
    scheme.init_on_sender("policy", pipes=[p for p, _ in pipes], model=model, num_workers=2)
    learner = Learner(scheme, model)
    try:
        for i in range(2):
            fleet.wait_ready(i)
        learner.send()
        rss = rss_bytes()
        if fault == "sigkill":
            fleet.kill(1)
            learner.send()  # worker 1's pipe broke: named at once
            assert learner.timeouts == 1
            assert learner.slowest < TIMEOUT, "a broken pipe was waited out"
            live = [0]
            until(lambda: _settled_for(learner, [0]), 60, "worker 0 acked")
        else:
            stop(fleet.procs[1].pid)  # type: ignore[arg-type]
            try:
                learner.send()
                bump(model)
                learner.send()
            finally:
                os.kill(fleet.procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
            live = [0, 1]
            until(lambda: _settled(learner), 60, "both workers acked")
        growth = rss_bytes() - rss
        assert growth < RSS_BOUND
        for i in live:
            learner.exact(fleet.ask(i, "applied"), f"pipe worker {i}")
        if share:
            assert scheme.get_sender().status()["share_params"] == "on"
        _report(f"pipe {fault}{' share_params' if share else ''}", learner, growth)
    finally:
        scheme.shutdown()


def _settled_for(learner: Learner, workers: list[int]) -> bool:
    before = learner.timeouts
    learner.send(worker_ids=workers)
    return learner.timeouts == before


# --- Ray actors: process faults --------------------------------------------------------


@ray.remote(num_cpus=0)
class LoggingActor(WeightSyncActorMixin):
    """An actor that logs every version it applies, with its model's checksum."""

    def __init__(self, seed: int) -> None:
        self.model = make_model("wide", seed=seed)
        self.applied: list[tuple[int, int, str]] = []

    def setup(self, scheme: RayWeightSyncScheme) -> int:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)
        scheme.get_receiver().on_applied.append(
            lambda epoch, version: self.applied.append(
                (epoch, version, zmqsync.checksum(self.model, scheme.strategy))
            )
        )
        return os.getpid()

    def log(self) -> list[tuple[int, int, str]]:
        return list(self.applied)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("fault", PROCESS_FAULTS)
@pytest.mark.parametrize("share", [False, True], ids=["copy", "share_params"])
def test_ray_fleet_under(fault: str, share: bool) -> None:
    model = make_model("wide", seed=0)
    scheme = RayWeightSyncScheme("state_dict", timeout=TIMEOUT, share_params=share)
    actors = [LoggingActor.remote(10 + i) for i in range(2)]  # type: ignore[attr-defined]
    try:
        pids = ray.get([a.setup.remote(scheme) for a in actors], timeout=60)
        scheme.init_on_sender("policy", remote_collectors=actors, source_model=model)
        scheme.connect(timeout=60)  # the actors have joined
        learner = Learner(scheme, model)
        learner.send()
        rss = rss_bytes()
        if fault == "sigkill":
            os.kill(pids[1], signal.SIGKILL)
            learner.send()  # the actor is dead: named
            assert learner.timeouts == 1
            live = [0]
            until(lambda: _settled_for(learner, [0]), 60, "actor 0 acked")
        else:
            stop(pids[1])
            try:
                learner.send()
                bump(model)
                learner.send()
            finally:
                os.kill(pids[1], signal.SIGCONT)
            live = [0, 1]
            until(lambda: _settled(learner), 60, "both actors acked")
        growth = rss_bytes() - rss
        assert growth < RSS_BOUND
        for i in live:
            learner.exact(ray.get(actors[i].log.remote(), timeout=60), f"actor {i}")
        if share:  # the actors are on the learner's host
            assert scheme.get_sender().status()["share_params"] == "on"
        _report(f"ray {fault}{' share_params' if share else ''}", learner, growth)
    finally:
        scheme.shutdown()
        for actor in actors:
            ray.kill(actor, no_restart=True)
