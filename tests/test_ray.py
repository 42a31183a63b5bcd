"""The Ray transport and RayWeightSyncScheme on a real local Ray cluster: the transport
contract, then the promises end to end with real actors."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from _workers import bump
from conftest import actors_started, kill_actor
from torch import nn

import zmqsync
from zmqsync import SyncTimeout
from zmqsync.errors import TransportClosed
from zmqsync.protocol import Buffer
from zmqsync.schemes.ray import RayWeightSyncScheme
from zmqsync.testing import check_transport
from zmqsync.transport.base import SpokeTransport, Stream
from zmqsync.transport.ray import RayHub, RaySpoke, WeightSyncActorMixin
from zmqsync.transport.ray import actor as ray_actor
from zmqsync.transport.ray.driver import log as driver_log

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

# This module is not importable in Ray's worker processes: ship its actor classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Generous bound for one Ray call on a loaded 2-core machine.
CALL_TIMEOUT = 60.0


def make_model(seed: int) -> nn.Module:
    """~280 KB of weights: big enough to travel through the object store."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 4)
    )


# --- the transport contract ---------------------------------------------------------------


@ray.remote(num_cpus=0, max_concurrency=4)
class SpokeHost(WeightSyncActorMixin):
    """An actor holding a real RaySpoke; the suite drives it through :class:`SpokeProxy`."""

    def __init__(self, channel: str) -> None:
        self.spoke = RaySpoke(channel)

    def send(self, frames: list[bytes]) -> None:
        self.spoke.send_frames(frames)

    def recv(self, timeout: float) -> list[bytes] | None:
        frames = self.spoke.recv_frames(timeout)
        return None if frames is None else [bytes(f) for f in frames]

    def counters(self) -> dict[str, int]:
        return self.spoke.counters()

    def close(self) -> None:
        self.spoke.close()


class SpokeProxy(SpokeTransport):
    """The suite's remote control for a spoke that lives in an actor: each call runs there.

    (A threaded actor does not keep its calls in order, so each call here waits for the
    previous one.)
    """

    name = "ray"

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def endpoint(self) -> str:
        return "ray://proxy"

    def send_frames(self, frames: Sequence[Buffer], *, ack: bool = False) -> None:
        if self._closed:
            raise TransportClosed("proxy closed")
        ray.get(self.actor.send.remote([bytes(f) for f in frames]), timeout=CALL_TIMEOUT)

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        if self._closed:
            raise TransportClosed("proxy closed")
        reply = ray.get(self.actor.recv.remote(timeout), timeout=(timeout or 0) + CALL_TIMEOUT)
        return None if reply is None else list(reply)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            ray.get(self.actor.close.remote(), timeout=CALL_TIMEOUT)


@pytest.fixture
def actors() -> Iterator[list[Any]]:
    """Actors a test starts, killed at its end whatever happened."""
    started: list[Any] = []
    yield started
    for actor in started:
        ray.kill(actor, no_restart=True)


@pytest.mark.timeout(240)
def test_ray_transport_conformance(actors) -> None:  # type: ignore[no-untyped-def]
    def make_fleet(n: int) -> tuple[RayHub, list[SpokeProxy]]:
        hosts = [SpokeHost.remote("conformance") for _ in range(n)]
        actors.extend(hosts)
        actors_started(hosts)
        return RayHub(hosts, channel="conformance"), [SpokeProxy(h) for h in hosts]

    check_transport(make_fleet)


def test_an_actor_without_the_method_is_refused_clearly(actors) -> None:  # type: ignore[no-untyped-def]
    @ray.remote(num_cpus=0)
    class Plain:
        def ping(self) -> int:
            return 1

    plain = Plain.remote()
    actors.append(plain)
    with pytest.raises(TypeError, match="WeightSyncActorMixin"):
        RayHub([plain])


@ray.remote(num_cpus=0)
class Confused:
    """Has the method, answers nonsense."""

    def zmqsync_deliver(self, channel: str, peer_index: int, frames: Any, seq: Any) -> Any:
        return "not a list of messages"


def test_an_actor_answering_nonsense_is_counted_not_trusted(
    actors: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    confused = Confused.remote()
    actors.append(confused)
    hub = RayHub([confused], channel="confused")
    try:
        with caplog.at_level(logging.WARNING, logger=driver_log.name):
            hub.send_frames([b"anyone there?"])
            deadline = time.monotonic() + CALL_TIMEOUT
            while hub.counters()["remote_errors"] < 2:  # the send's answer and a poll's
                assert time.monotonic() < deadline, hub.counters()
                assert hub.recv_frames(0.1) is None
        warnings = [r.getMessage() for r in caplog.records if r.name == driver_log.name]
        assert any("not a list of messages" in w for w in warnings), warnings
    finally:
        hub.close()


# --- end to end: real actors with real models ------------------------------------------------


@ray.remote(num_cpus=0)
class PolicyActor(WeightSyncActorMixin):
    """A plain (non-threaded) actor with its own model, as a collector would be."""

    def __init__(self, seed: int) -> None:
        self.model = make_model(seed)  # differs from the sender's
        self.scheme: RayWeightSyncScheme | None = None

    def setup(self, scheme: RayWeightSyncScheme) -> None:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)  # returns at once

    def state(self) -> tuple[int, str]:
        assert self.scheme is not None
        with self.scheme.lock:
            receiver = self.scheme.get_receiver()
            return receiver.version, zmqsync.checksum(self.model, self.scheme.strategy)

    def leave(self) -> None:
        """Close this actor's receiver (the actor itself lives on)."""
        assert self.scheme is not None
        self.scheme.shutdown()

    def shared_frames(self) -> int:
        """Frames this actor read in place from the sender's shared memory."""
        assert self.scheme is not None
        transport = self.scheme.receiver_transport
        assert isinstance(transport, RaySpoke)
        return transport.counters()["shared_frames"]

    def zero_copy_views(self) -> int:
        """Frames this actor read straight from the object store, without a copy."""
        assert self.scheme is not None
        transport = self.scheme.receiver_transport
        assert isinstance(transport, RaySpoke)
        return transport.counters()["read_only_views"]


def _sender_and_actors(
    scheme: RayWeightSyncScheme, model: nn.Module, actors: list[Any], seeds: list[int]
) -> list[Any]:
    """Actors with their receivers set up, then the sender initialised for them."""
    fleet = [PolicyActor.remote(seed) for seed in seeds]
    actors.extend(fleet)
    ray.get([a.setup.remote(scheme) for a in fleet], timeout=CALL_TIMEOUT)
    scheme.init_on_sender("policy", remote_collectors=fleet, source_model=model)
    return fleet


def _wait_for(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_ray_actors_exact_targeted_isolated_dead_named_late_joiner(actors) -> None:  # type: ignore[no-untyped-def]
    """Through Ray's object store (the path actors on other hosts take)."""
    model = make_model(0)
    # No timed repairs (a loaded machine may trigger one): each send's puts are counted.
    scheme = RayWeightSyncScheme(timeout=5, shared_memory=False, repair_after=60.0)
    fleet = [PolicyActor.remote(100 + i) for i in range(3)]
    actors.extend(fleet)
    ray.get([a.setup.remote(scheme) for a in fleet], timeout=CALL_TIMEOUT)
    scheme.init_on_sender("policy", remote_collectors=fleet, source_model=model)
    try:
        scheme.connect(timeout=CALL_TIMEOUT)  # every actor joined

        def states(which: Sequence[int]) -> list[tuple[int, str]]:
            return ray.get([fleet[i].state.remote() for i in which], timeout=CALL_TIMEOUT)

        def puts() -> int:
            return int(scheme.status()["totals"]["object_store_puts"])

        # Every actor exact after send(), version after version.
        for version in (1, 2):
            # (Version 1 may also go to an actor still finishing its join, as a repair.)
            before = puts()
            bump(model)
            scheme.send()
            assert states(range(3)) == [(version, zmqsync.checksum(model))] * 3

        # Version 2 went into the object store once for the three actors, and they read
        # it in place.
        assert puts() - before == 1
        assert all(n > 0 for n in ray.get([a.zero_copy_views.remote() for a in fleet]))

        # worker_ids=[0] changes actor 0 and no other.
        v2 = zmqsync.checksum(model)
        bump(model)
        scheme.send(worker_ids=[0])
        v3 = zmqsync.checksum(model)
        assert states([0, 1, 2]) == [(3, v3), (2, v2), (2, v2)]

        # The sender changing its weights without sending changes no actor.
        bump(model)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # look for a (wrong) change for a while
            assert [s for _, s in states([0, 1])] == [v3, v2]

        # A killed actor is named by the timeout, within timeout + 1 s.
        kill_actor(fleet[2], CALL_TIMEOUT)
        start = time.monotonic()
        with pytest.raises(SyncTimeout) as info:
            scheme.send()
        took = time.monotonic() - start
        assert info.value.missing_workers == [2]
        assert info.value.transports == {2: "ray"}
        assert "worker 2" in str(info.value)
        assert took <= scheme.timeout + 1.0, took
        _wait_for(lambda: scheme.status()["totals"]["peers_lost"] == 1, "counting the dead actor")

        # The next send to the living succeeds.
        bump(model)
        scheme.send(worker_ids=[0, 1])
        latest = (scheme.get_sender().version, zmqsync.checksum(model))
        assert states([0, 1]) == [latest, latest]

        # A late joiner reaches the latest version on joining, without a resend to all.
        sent = scheme.status()["totals"]["versions_sent"]
        late = PolicyActor.remote(200)
        actors.append(late)
        ray.get(late.setup.remote(scheme), timeout=CALL_TIMEOUT)
        assert scheme.add_remote_collector(late) == 3
        _wait_for(
            lambda: ray.get(late.state.remote(), timeout=CALL_TIMEOUT) == latest,
            "the late joiner catching up",
        )
        assert scheme.status()["totals"]["versions_sent"] == sent

        # From then on it is one of the fleet.
        bump(model)
        scheme.send(worker_ids=[0, 1, 3])
        latest = (scheme.get_sender().version, zmqsync.checksum(model))
        late_state = ray.get(late.state.remote(), timeout=CALL_TIMEOUT)
        assert [*states([0, 1]), late_state] == [latest] * 3
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_ray_actors_on_this_host_read_versions_in_place_from_shared_memory(actors) -> None:  # type: ignore[no-untyped-def]
    """Actors on the learner's host say they can read its blocks, then get every version
    as places in them: no object in Ray's store, blocks reused, holds of a killed actor
    forgotten."""
    model = make_model(0)
    # No timed repairs (a loaded machine may trigger one): each send's messages are counted.
    scheme = RayWeightSyncScheme(timeout=5, repair_after=60.0)
    fleet = _sender_and_actors(scheme, model, actors, seeds=[300, 301])
    try:
        scheme.connect(timeout=CALL_TIMEOUT)
        hub = scheme.get_sender().transport
        assert isinstance(hub, RayHub)
        _wait_for(lambda: all(a.shared for a in hub._actors.values()), "both actors answering yes")
        before = hub.counters()
        for version in (1, 2, 3, 4):
            bump(model)
            scheme.send()
            states = ray.get([a.state.remote() for a in fleet], timeout=CALL_TIMEOUT)
            assert states == [(version, zmqsync.checksum(model))] * 2
        after = hub.counters()
        assert after["object_store_puts"] == before["object_store_puts"]
        # Each version to each actor through the hub's blocks; on a loaded machine one
        # more may go (a heartbeat written before the actor applied a version and read
        # while it is sent makes the learner send it once more: its first repair), never
        # through the object store.
        assert after["shared_sends"] - before["shared_sends"] >= 8
        assert all(n >= 4 for n in ray.get([a.shared_frames.remote() for a in fleet]))
        nbytes = sum(t.nbytes for t in model.state_dict().values())
        assert after["shm_bytes"] <= 3 * nbytes, "blocks were not reused"
        assert after["bad_releases"] == 0
        # Every actor let go of what it applied (releases ride on the next replies).
        _wait_for(
            lambda: not any(b.leases for b in hub._lending.pool._blocks.values()),  # type: ignore[union-attr]
            "the actors releasing their blocks",
        )

        # A killed actor is named; whatever it held is forgotten, and the other goes on.
        kill_actor(fleet[1], CALL_TIMEOUT)
        bump(model)
        with pytest.raises(SyncTimeout):
            scheme.send()
        bump(model)
        scheme.send(worker_ids=[0])
        assert ray.get(fleet[0].state.remote(), timeout=CALL_TIMEOUT) == (
            scheme.get_sender().version,
            zmqsync.checksum(model),
        )
        _wait_for(
            lambda: not any(1 in b.leases for b in hub._lending.pool._blocks.values()),  # type: ignore[union-attr]
            "the dead actor's holds being forgotten",
        )
    finally:
        scheme.shutdown()


@pytest.mark.timeout(240)
def test_an_actor_whose_receiver_closes_says_goodbye(actors) -> None:  # type: ignore[no-untyped-def]
    """Its goodbye waits in the spoke's outbox when it closes; the hub's next call (a
    poll) still takes it, so a fleet of known size fails a send to it at once, naming
    it, instead of waiting out the timeout."""
    model = make_model(0)
    scheme = RayWeightSyncScheme(timeout=30)
    fleet = _sender_and_actors(scheme, model, actors, seeds=[300, 301])
    try:
        scheme.connect(timeout=CALL_TIMEOUT)
        bump(model)
        scheme.send()
        ray.get(fleet[1].leave.remote(), timeout=CALL_TIMEOUT)
        _wait_for(lambda: scheme.status()["totals"]["goodbyes"] == 1, "the goodbye arriving")
        left = {w["worker"]: w["left"] for w in scheme.status()["workers"]}
        assert left == {0: False, 1: True}
        bump(model)
        start = time.monotonic()
        with pytest.raises(SyncTimeout, match="said goodbye") as info:
            scheme.send()
        assert info.value.missing_workers == [1]
        assert time.monotonic() - start < 5.0  # not the 30 s timeout
        scheme.send(worker_ids=[0])
        assert ray.get(fleet[0].state.remote(), timeout=CALL_TIMEOUT) == (
            3,
            zmqsync.checksum(model, scheme.strategy),
        )
    finally:
        scheme.shutdown()


def test_an_actor_that_calls_init_on_worker_late_joins_at_the_latest_version(actors) -> None:  # type: ignore[no-untyped-def]
    """The sender knows both actors from the start; actor 1 sets up its receiver only
    after two versions went to actor 0. It joins at version 2 on its own (the sender's
    polls find it), from the context-style init."""

    class Context:
        def __init__(self, remote_collectors: list[Any], policy: nn.Module) -> None:
            self.remote_collectors = remote_collectors
            self.policy = policy

    model = make_model(0)
    scheme = RayWeightSyncScheme("tensordict", timeout=10)
    fleet = [PolicyActor.remote(100 + i) for i in range(2)]
    actors.extend(fleet)
    ray.get(fleet[0].setup.remote(scheme), timeout=CALL_TIMEOUT)
    scheme.init_on_sender("policy", Context(fleet, model))
    try:
        _wait_for(
            lambda: any(w["worker"] == 0 and w["connected"] for w in scheme.status()["workers"]),
            "actor 0 joining",
        )
        for _ in range(2):
            bump(model)
            scheme.send(worker_ids=[0])
        latest = (2, zmqsync.checksum(model, "tensordict"))
        ray.get(fleet[1].setup.remote(scheme), timeout=CALL_TIMEOUT)
        scheme.connect(timeout=CALL_TIMEOUT)
        _wait_for(
            lambda: ray.get(fleet[1].state.remote(), timeout=CALL_TIMEOUT) == latest,
            "actor 1 catching up",
        )
        assert ray.get(fleet[0].state.remote(), timeout=CALL_TIMEOUT) == latest
        assert scheme.status()["totals"]["versions_sent"] == 2
    finally:
        scheme.shutdown()


@ray.remote(num_cpus=0, max_concurrency=4)
class MisfitActor(WeightSyncActorMixin):
    """A threaded actor (so it can wait in connect()) whose model lacks the learner's
    last layer."""

    def __init__(self) -> None:
        torch.manual_seed(7)
        self.model = nn.Sequential(
            nn.Linear(16, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256)
        )
        self.before = zmqsync.checksum(self.model)
        self.scheme: RayWeightSyncScheme | None = None

    def setup(self, scheme: RayWeightSyncScheme) -> None:
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)

    def join(self, timeout: float) -> tuple[Any, ...]:
        """What connect() did: ("raised", message, key) or ("returned", version)."""
        assert self.scheme is not None
        try:
            self.scheme.connect(timeout=timeout)
        except zmqsync.SchemaMismatchError as exc:
            return ("raised", str(exc), exc.key)
        return ("returned", self.scheme.get_receiver().version)

    def unchanged(self) -> bool:
        return zmqsync.checksum(self.model) == self.before

    def leave(self) -> float:
        """Seconds closing this actor's receiver took."""
        assert self.scheme is not None
        start = time.monotonic()
        self.scheme.shutdown()
        return time.monotonic() - start


@pytest.mark.timeout(240)
def test_an_actor_whose_model_does_not_fit_fails_connect(actors) -> None:  # type: ignore[no-untyped-def]
    """Its connect() used to return as if it had joined while it kept its own weights."""
    model = make_model(0)
    scheme = RayWeightSyncScheme(timeout=30)
    (good,) = _sender_and_actors(scheme, model, actors, seeds=[400])
    try:
        scheme.connect(timeout=CALL_TIMEOUT)
        bump(model)
        scheme.send()  # version 1
        misfit = MisfitActor.remote()
        actors.append(misfit)
        ray.get(misfit.setup.remote(scheme), timeout=CALL_TIMEOUT)
        assert scheme.add_remote_collector(misfit) == 1
        outcome = ray.get(misfit.join.remote(CALL_TIMEOUT), timeout=2 * CALL_TIMEOUT)
        assert outcome[0] == "raised", outcome
        assert "weights carry '4.weight', which the model lacks" in outcome[1]
        assert outcome[2] == "4.weight"
        assert ray.get(misfit.unchanged.remote(), timeout=CALL_TIMEOUT)

        # The learner counted the refusal; a send names the actor that refuses it (at
        # once, not at the timeout) and reaches the one that fits.
        def rejections() -> list[str]:
            status = {w["worker"]: w for w in scheme.status()["workers"]}
            return list(status.get(1, {}).get("rejections", []))

        _wait_for(rejections, "the refusal reaching the learner")
        assert "'4.weight'" in rejections()[-1]
        bump(model)
        with pytest.raises(zmqsync.WeightsRejected) as info:
            scheme.send()
        assert list(info.value.rejections) == [1] and "'4.weight'" in info.value.rejections[1]
        assert ray.get(good.state.remote(), timeout=CALL_TIMEOUT) == (
            2,
            zmqsync.checksum(model, scheme.strategy),
        )
        assert ray.get(misfit.unchanged.remote(), timeout=CALL_TIMEOUT)
        assert ray.get(misfit.leave.remote(), timeout=CALL_TIMEOUT) < 5.0
    finally:
        scheme.shutdown()


def test_scheme_surface_before_init() -> None:
    scheme = RayWeightSyncScheme()
    assert scheme.strategy == "state_dict"
    with pytest.raises(RuntimeError, match="init_on_sender"):
        scheme.get_sender()
    with pytest.raises(RuntimeError, match="init_on_worker"):
        scheme.get_receiver()
    with pytest.raises(ValueError, match="remote_collectors"):
        scheme.init_on_sender("policy", model=nn.Linear(2, 2))
    weights = scheme.prepare_weights(nn.Linear(2, 3), "policy", "state_dict")
    assert set(weights) == {"weight", "bias"}


@ray.remote(num_cpus=0)
class LonelyActor(WeightSyncActorMixin):
    """An actor whose learner never calls it."""

    def wait_to_join(self, scheme: RayWeightSyncScheme) -> tuple[str, float]:
        """What this actor's connect() (no timeout given) raised, and after how long."""
        scheme.init_on_worker("policy", model=nn.Linear(2, 2))
        start = time.monotonic()
        try:
            scheme.connect()
        except SyncTimeout as exc:
            return str(exc), time.monotonic() - start
        finally:
            scheme.shutdown()
        return "joined", time.monotonic() - start


@pytest.mark.timeout(120)
def test_both_sides_wait_connect_timeout_to_join_not_the_send_timeout(actors) -> None:  # type: ignore[no-untyped-def]
    lonely = LonelyActor.remote()
    actors.append(lonely)
    said, took = ray.get(
        lonely.wait_to_join.remote(RayWeightSyncScheme(timeout=0.2, connect_timeout=1.5)),
        timeout=CALL_TIMEOUT,
    )
    assert "did not join the sender of 'policy' within 1.5s" in said
    assert 1.4 <= took < 5.0

    # A learner whose actor never sets up its receiver gives up after connect_timeout.
    scheme = RayWeightSyncScheme(timeout=30, connect_timeout=1.0)
    idle = PolicyActor.remote(0)
    actors.append(idle)
    actors_started([idle])
    scheme.init_on_sender("policy", remote_collectors=[idle], source_model=make_model(0))
    try:
        begun = time.monotonic()
        with pytest.raises(SyncTimeout, match=r"workers \[0\] did not connect within 1s"):
            scheme.connect()
        assert 0.9 <= time.monotonic() - begun < 10.0
        assert scheme.worker_versions() == {0: 0}  # expected, never joined
    finally:
        scheme.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "object-store"])
def test_versions_of_many_chunks_reach_plain_and_threaded_actors_whole(
    actors, shared_memory: bool
) -> None:  # type: ignore[no-untyped-def]
    """~280 KB in 64 KiB chunks: each chunk is a call of its own. A threaded actor may
    run two calls at once (the spoke queues them in the hub's order), and neither kind
    of actor may wait inside a call for the next chunk (it comes with a later call)."""
    model = make_model(0)
    scheme = RayWeightSyncScheme(
        timeout=20, repair_after=60.0, chunk_bytes=64 * 1024, shared_memory=shared_memory
    )
    # A plain actor, and the same one threaded (two of the hub's calls may run at once).
    fleet = [PolicyActor.remote(400), PolicyActor.options(max_concurrency=4).remote(401)]  # type: ignore[attr-defined]
    actors.extend(fleet)
    ray.get([a.setup.remote(scheme) for a in fleet], timeout=CALL_TIMEOUT)
    scheme.init_on_sender("policy", remote_collectors=fleet, source_model=model)
    try:
        scheme.connect(timeout=CALL_TIMEOUT)
        for version in range(1, 6):
            bump(model)
            scheme.send()
            states = ray.get([a.state.remote() for a in fleet], timeout=CALL_TIMEOUT)
            assert states == [(version, zmqsync.checksum(model))] * 2
        assert scheme.get_sender().status()["totals"]["chunks_sent"] >= 5 * 4  # 4+ a version
    finally:
        scheme.shutdown()


@pytest.mark.timeout(60)
def test_a_threaded_actors_spoke_queues_calls_in_the_hubs_order_without_waiting() -> None:
    """Calls that overtake an earlier one (a threaded actor, or an argument fetched late
    from the object store) return at once, and their messages reach the receiver in the
    hub's order once the earlier call came: nothing holds an actor's thread, however long
    the earlier call is delayed."""
    spoke = RaySpoke("order-test")
    try:
        assert spoke.exchange(3, [b"a"], seq=0) == []
        started = time.monotonic()
        spoke.exchange(3, [b"c"], seq=2)  # overtook seq 1
        spoke.exchange(3, None, seq=3)  # a poll overtook it too
        spoke.exchange(3, [b"d"], seq=4)
        assert time.monotonic() - started < 1.0  # returned at once, waited for nothing
        assert spoke.recv_frames(0) == [b"a"]
        assert spoke.recv_frames(0) is None  # c and d wait for b
        spoke.exchange(3, [b"b"], seq=1)
        got = [spoke.recv_frames(0) for _ in range(3)]
        assert [bytes(f[0]) for f in got if f] == [b"b", b"c", b"d"]
        assert spoke.counters()["order_gaps"] == 0
        # A new hub numbers its calls anew: what waited for the old hub's calls goes.
        spoke.exchange(3, [b"old"], seq=9)
        spoke.exchange(4, [b"new"], seq=0)
        assert spoke.recv_frames(0) == [b"new"]
        assert spoke.recv_frames(0) is None
        # A gap that is never filled is given up once MAX_EARLY calls wait behind it:
        # their messages are queued as they are (the sync layer repairs the version).
        for seq in range(2, 3 + ray_actor.MAX_EARLY):
            spoke.exchange(4, [b"%d" % seq], seq=seq)
        got = []
        while (frames := spoke.recv_frames(0)) is not None:
            got.append(int(bytes(frames[0])))
        assert got == list(range(2, 3 + ray_actor.MAX_EARLY))
        assert spoke.counters()["order_gaps"] == 1
    finally:
        spoke.close()


@pytest.mark.timeout(60)
def test_a_new_hubs_first_call_run_after_its_second_still_comes_first() -> None:
    """A hub tags its calls with a numbering of its own: a restarted learner's hub
    whose call 1 runs before its call 0 (a threaded actor) is told from the old hub by
    the tag, so call 1's messages wait for call 0's, not for calls that never come; a
    late call from the old hub is dropped and counted, not taken for a third hub."""
    span = ray_actor.SEQ_SPAN
    spoke = RaySpoke("epoch-test")
    try:
        old, new = 5 * span, 9 * span
        spoke.exchange(0, [b"o0"], seq=old + 0)
        spoke.exchange(0, [b"o1"], seq=old + 1)
        assert [bytes(spoke.recv_frames(0)[0]) for _ in range(2)] == [b"o0", b"o1"]  # type: ignore[index]
        started = time.monotonic()
        spoke.exchange(0, [b"n1"], seq=new + 1)  # the new hub's call 1 ran first
        assert time.monotonic() - started < 1.0
        assert spoke.recv_frames(0) is None  # waits for call 0, which is under way
        assert spoke.exchange(0, [b"o2"], seq=old + 2) == []  # the old hub, late
        spoke.exchange(0, [b"n0"], seq=new + 0)
        spoke.exchange(0, [b"n2"], seq=new + 2)
        got = []
        while (frames := spoke.recv_frames(0)) is not None:
            got.append(bytes(frames[0]))
        assert got == [b"n0", b"n1", b"n2"]
        counters = spoke.counters()
        assert counters["order_gaps"] == 0
        assert counters["stale_calls"] == 1
    finally:
        spoke.close()


@pytest.mark.timeout(60)
def test_a_spoke_opened_while_the_hub_calls_goes_on_from_the_hubs_last_call() -> None:
    """Calls that come before a spoke opens are dropped, and a spoke that closes leaves
    the hub calling: the spoke opened next knows where the hub's numbering stands, so a
    call that overtakes the next one waits for it (neither starts a numbering anew)."""
    span = ray_actor.SEQ_SPAN
    epoch = 3 * span
    for number in range(3):  # no spoke yet: dropped
        assert ray_actor.deliver("late-test", 0, [b"early"], epoch + number) == []
    spoke = RaySpoke("late-test")
    try:
        spoke.exchange(0, [b"4"], seq=epoch + 4)  # overtook call 3
        assert spoke.recv_frames(0) is None
        spoke.exchange(0, [b"3"], seq=epoch + 3)
        assert [bytes(spoke.recv_frames(0)[0]) for _ in range(2)] == [b"3", b"4"]  # type: ignore[index]
    finally:
        spoke.close()
    spoke = RaySpoke("late-test")  # a receiver made again on the same actor
    try:
        spoke.exchange(0, [b"6"], seq=epoch + 6)  # overtook call 5
        assert spoke.recv_frames(0) is None
        spoke.exchange(0, [b"5"], seq=epoch + 5)
        assert [bytes(spoke.recv_frames(0)[0]) for _ in range(2)] == [b"5", b"6"]  # type: ignore[index]
        assert spoke.counters()["order_gaps"] == 0
    finally:
        spoke.close()


@pytest.mark.timeout(120)
def test_a_restarted_learners_hub_reaches_a_threaded_actor_in_order(actors) -> None:  # type: ignore[no-untyped-def]
    """A learner restarts: a new hub calls the same threaded actor (its calls may run
    in any order there). Every message of the new hub reaches the actor's receiver once,
    in the order sent, with no order gap given up on the way."""
    host = SpokeHost.remote("restarted")
    actors.append(host)
    actors_started([host])
    proxy = SpokeProxy(host)

    def deliver(hub: RayHub, tag: bytes, count: int) -> None:
        for i in range(count):
            hub.send_frames([tag + b" %d" % i])
        got: list[bytes] = []
        deadline = time.monotonic() + CALL_TIMEOUT
        while len(got) < count:
            assert time.monotonic() < deadline, got
            hub.recv_frames(0.01)
            frames = proxy.recv_frames(0.01)
            if frames is not None:
                got.append(bytes(frames[0]))
        assert got == [tag + b" %d" % i for i in range(count)]

    for tag in (b"first", b"restarted", b"again"):
        hub = RayHub([host], channel="restarted", shared_memory=False)
        try:
            deliver(hub, tag, 12)  # fewer than the calls a hub has under way
        finally:
            hub.close()
    assert ray.get(host.counters.remote(), timeout=CALL_TIMEOUT)["order_gaps"] == 0


@pytest.mark.timeout(120)
def test_chunks_that_wait_for_an_actor_go_together_in_its_next_call(actors) -> None:  # type: ignore[no-untyped-def]
    """An actor has at most two calls with chunks under way; the chunks that wait
    meanwhile (small ones, that travel in the call) go together in one call, and reach
    the actor's receiver one by one, in order."""
    host = SpokeHost.remote("batched")
    actors.append(host)
    actors_started([host])
    hub = RayHub([host], channel="batched", shared_memory=False)
    proxy = SpokeProxy(host)
    try:
        # The hub's first call (a poll) numbers the calls to come.
        deadline = time.monotonic() + CALL_TIMEOUT
        while hub.counters()["polls"] < 1 or hub._actors[b"ray:0"].in_flight:
            assert time.monotonic() < deadline, hub.counters()
            hub.recv_frames(0.05)
        # The hub hands on finished calls only in recv_frames: until then two calls are
        # under way and the other eight chunks wait.
        for i in range(10):
            hub.send_frames([b"chunk %d" % i], stream=Stream.START if i == 0 else Stream.MORE)
        assert hub.counters()["batched_messages"] == 0
        got: list[bytes] = []
        deadline = time.monotonic() + CALL_TIMEOUT
        while len(got) < 10:
            assert time.monotonic() < deadline, got
            hub.recv_frames(0.05)
            frames = proxy.recv_frames(0.05)
            if frames is not None:
                got.append(bytes(frames[0]))
        assert got == [b"chunk %d" % i for i in range(10)], got
        assert hub.counters()["batched_messages"] == 8  # in one call, after the first two
        assert hub.counters()["dropped_sends"] == 0
    finally:
        hub.close()


def test_a_malformed_batch_is_counted_and_the_spoke_goes_on() -> None:
    spoke = RaySpoke("batch-test")
    try:
        good = ray_actor.batch([[b"a"], [b"b", b"c"]])
        assert spoke.exchange(0, good, seq=0) == []
        assert spoke.recv_frames(0) == [b"a"]
        assert spoke.recv_frames(0) == [b"b", b"c"]
        for bad in (
            [good[0]],  # counts frames that are not there
            [*good, b"extra"],  # ... or fewer than there are
            [good[0][:6]],  # a header cut short
            [ray_actor._BATCH + struct.pack("<I", ray_actor.MAX_BATCH + 1)],
            [ray_actor._BATCH + struct.pack("<II", 1, 0)],  # a message of no frames
        ):
            spoke.exchange(0, bad, seq=None)
        assert spoke.counters()["malformed_batches"] == 5
        assert spoke.recv_frames(0) is None
        spoke.exchange(0, [b"after"], seq=1)
        assert spoke.recv_frames(0) == [b"after"]
    finally:
        spoke.close()


@pytest.mark.timeout(300)
def test_a_scheme_left_open_after_ray_shutdown_starts_no_new_cluster() -> None:
    """``ray.shutdown()`` with the sender still open: its thread's next poll must not
    start a new local Ray cluster (Ray connects on first use); every actor is lost at
    once, the next send fails naming them, and the scheme closes. (It used to start a
    cluster from the sender's thread, log every poll's failure, and wait out the send's
    timeout.)"""
    script = Path(__file__).with_name("_ray_after_shutdown.py")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ray_after_polls"] is False and out["ray_at_end"] is False, out
    assert out["lost"] == 2, out
    assert out["send"].startswith("SyncTimeout"), out
    assert out["send"].count("its transport says it is gone") == 2, out
