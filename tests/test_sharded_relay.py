"""A relay in front of a sharded learner: it opens a session with every rank, gathers
each version's parts, and serves its own workers whole versions; its acks, refusals and
the workers it speaks for go to every rank.

In-process ranks (``RowsPart`` over memory hubs) for the protocol's cases, and an FSDP2
learner of two ranks over gloo with a relay and its workers in processes of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _faults import until
from _sharded_fixtures import (
    Processes,
    answer,
    answers,
    ask,
    below_of,
    collective,
    ipc_endpoints,
    rank_senders,
    sends,
)

from zmqsync import Relay, SyncTimeout, WeightReceiver, WeightSender, WeightsRejected, checksum
from zmqsync.chunking.layout import STREAM_ALIGN
from zmqsync.transport.memory import MemoryHub, MemorySpoke

#: The relay's own chunks: small, so that each gathered version goes on in several.
RELAY_CHUNK = 1 << 16
BEAT = 0.2


def _learner() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(517, 129, generator=g),  # uneven rows over the ranks
        "v": torch.randn(9, 4, 4, generator=g),
        "b": torch.randn(7, generator=g),  # whole, from rank 0
    }


def _bump(learner: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in learner.values():
            t.add_(torch.randn_like(t))


def _part_bytes(learner: dict[str, torch.Tensor], part: int, parts: int) -> int:
    """The bytes of ``part``'s own boxes (as ``RowsPart`` cuts them), unaligned."""
    total = 0
    for t in learner.values():
        if t.dim() < 2:
            total += t.nbytes if part == 0 else 0
            continue
        n = t.shape[0]
        rows = (part + 1) * n // parts - part * n // parts
        total += rows * math.prod(t.shape[1:]) * t.element_size()
    return total


def _bytes_sent(sender: WeightSender) -> int:
    """What ``sender`` sent, versions and repairs (late joiners) together."""
    totals = sender.status()["totals"]
    return int(totals["bytes_sent"] + totals["repair_bytes"])


@contextlib.contextmanager
def _sharded(
    name: str, ranks: int, learner: dict[str, torch.Tensor], **relay_options: Any
) -> Iterator[tuple[list[WeightSender], Relay, str]]:
    """``ranks`` in-process ranks of a sharded learner, and a relay (worker 9 of theirs)
    connected to them all, serving at the endpoint given."""
    names = [f"memory://{name}-rank{r}" for r in range(ranks)]
    senders: list[WeightSender] = []
    relay = None
    try:
        senders.extend(rank_senders(names, learner, timeout=20, epoch=77, heartbeat=BEAT))
        below = f"memory://{name}-relay"
        relay = Relay(
            MemorySpoke(names[0]),
            MemoryHub(below),
            strategy="state_dict",
            worker_idx=9,
            heartbeat=BEAT,
            timeout=20,
            chunk_bytes=RELAY_CHUNK,
            connect_rank=MemorySpoke,
            **relay_options,
        )
        relay.connect()
        relay.start()
        assert relay.receiver.ranks == tuple(names)
        yield senders, relay, below
    finally:
        if relay is not None:
            relay.close()
        for s in senders:
            s.close()


def _leaf(endpoint: str, idx: int, model: Any = None, **kw: Any) -> WeightReceiver:
    """A plain worker below the relay: no change from a worker of a plain learner."""
    leaf = WeightReceiver(
        MemorySpoke(endpoint), model=model, strategy="state_dict", worker_idx=idx, timeout=20, **kw
    )
    try:
        leaf.connect()
    except BaseException:
        leaf.close()
        raise
    leaf.start()
    return leaf


@pytest.mark.timeout(120)
@pytest.mark.parametrize("retain", [True, False], ids=["snapshot", "no-snapshot"])
def test_a_relay_gathers_every_ranks_part_and_serves_whole_versions(retain: bool) -> None:
    """Three ranks, a relay, two workers below it (one staged, one written in place):
    every version whole with the learner's checksum; each rank sends its part once (one
    relay); every rank knows the workers behind the relay; a late joiner below the relay
    gets the latest whole version (from the relay's snapshot: no rank sends again; or,
    without one, from each rank's part fetched again)."""
    learner = _learner()
    whole = sum(t.nbytes for t in learner.values())
    ranks = 3
    leaves: list[WeightReceiver] = []
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(3)]
    name = f"relayed-{retain}"
    with _sharded(name, ranks, learner, retain_snapshot=retain) as (senders, relay, below):
        try:
            leaves.append(_leaf(below, 0, models[0], apply_mode="staged"))
            leaves.append(_leaf(below, 1, models[1], apply_mode="in_place"))
            for s in senders:
                until(lambda s=s: below_of(s, 9) == {0, 1}, 20, "the relay claimed 0 and 1")
            for version in (1, 2, 3):
                _bump(learner)
                before = [_bytes_sent(s) for s in senders]
                forwarded = relay.stats["chunks_forwarded"]
                assert sends(senders) == [None] * ranks
                # Returned on every rank: both workers hold the whole version.
                assert [leaf.version for leaf in leaves] == [version] * 2
                assert [checksum(m, "state_dict") for m in models[:2]] == (
                    [checksum(learner, "state_dict")] * 2
                )
                # Each rank sent its own part once, to the relay alone.
                for r, s in enumerate(senders):
                    sent, part = _bytes_sent(s) - before[r], _part_bytes(learner, r, ranks)
                    assert part <= sent <= part + len(learner) * STREAM_ALIGN, (r, sent, part)
                # The relay sent it on in its own chunks (a chunk's size, not a model's).
                assert relay.stats["chunks_forwarded"] - forwarded >= whole // RELAY_CHUNK
            assert relay.stats["versions_forwarded"] >= 3
            assert all(leaf.stats["chunks"] >= 3 * (whole // RELAY_CHUNK) for leaf in leaves)
            before = [_bytes_sent(s) for s in senders]
            leaves.append(_leaf(below, 2, models[2]))
            assert leaves[2].version == 3
            assert checksum(models[2], "state_dict") == checksum(learner, "state_dict")
            after = [_bytes_sent(s) for s in senders]
            if retain:
                assert after == before  # served from the relay's snapshot
            else:
                assert relay.stats["refetches"] >= 1
                assert all(a > b for a, b in zip(after, before, strict=True))
            for s in senders:
                until(lambda s=s: below_of(s, 9) == {0, 1, 2}, 20, "the late joiner claimed")
        finally:
            for leaf in leaves:
                leaf.close()


@pytest.mark.timeout(120)
def test_a_refusal_below_the_relay_goes_up_to_every_rank() -> None:
    """A sink behind the relay raises: every rank's send() raises WeightsRejected naming
    that worker behind the relay and its reason; the next version goes through."""
    learner = _learner()
    fail = threading.Event()
    got: dict[str, torch.Tensor] = {}

    def sink(tensors: list[tuple[str, torch.Tensor]]) -> None:
        if fail.is_set():
            raise RuntimeError("engine out of KV-cache memory")
        got.update((k, t.clone()) for k, t in tensors)

    with _sharded("refused", 2, learner) as (senders, _relay, below):
        leaf = _leaf(below, 4, sink=sink)
        try:
            for s in senders:
                until(lambda s=s: below_of(s, 9) == {4}, 20, "the relay claimed worker 4")
            fail.set()
            _bump(learner)
            errors = sends(senders)
            for r, exc in enumerate(errors):
                assert isinstance(exc, WeightsRejected), (r, exc)
                message = str(exc)
                assert "worker 4 (behind relay 9)" in message, (r, message)
                assert "engine out of KV" in message, (r, message)
            fail.clear()
            _bump(learner)
            assert sends(senders) == [None, None]
            assert checksum(got, "state_dict") == checksum(learner, "state_dict")
        finally:
            leaf.close()


@pytest.mark.timeout(120)
def test_a_worker_behind_the_relay_that_stops_is_named_by_every_ranks_timeout() -> None:
    """The relay waits for its workers 0 and 1; worker 1 stops taking versions (its
    process hung): every rank's send() raises SyncTimeout naming the relay and worker 1
    behind it. Worker 0 holds the version; once worker 1 is back, the next send goes."""
    learner = _learner()
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    with _sharded("stopped", 2, learner, num_workers=2) as (senders, _relay, below):
        leaves = [_leaf(below, i, models[i]) for i in range(2)]
        try:
            for s in senders:
                until(lambda s=s: below_of(s, 9) == {0, 1}, 20, "the relay claimed 0 and 1")
            _bump(learner)
            assert sends(senders) == [None, None]
            leaves[1].stop()
            for s in senders:
                s.timeout = 3.0
            _bump(learner)
            errors = sends(senders)
            for r, exc in enumerate(errors):
                assert isinstance(exc, SyncTimeout), (r, exc)
                assert list(exc.missing_workers) == [9], (r, exc.missing_workers)
                message = str(exc)
                assert "a relay for 2 worker(s)" in message, (r, message)
                assert "worker 1 holds 1" in message, (r, message)
            assert checksum(models[0], "state_dict") == checksum(learner, "state_dict")
            assert checksum(models[1], "state_dict") != checksum(learner, "state_dict")
            for s in senders:
                s.timeout = 20.0
            leaves[1].start()
            _bump(learner)
            assert sends(senders) == [None, None]
            assert [checksum(m, "state_dict") for m in models] == (
                [checksum(learner, "state_dict")] * 2
            )
        finally:
            for leaf in leaves:
                leaf.close()


# --- an FSDP2 learner over gloo, a relay and its workers in processes of their own ------


@dataclasses.dataclass
class _Job:
    """An FSDP2 learner of two ranks, the ``zmqsync relay`` process in front of it and
    the plain workers behind the relay, each process with the test's end of its pipe."""

    learners: list[Any]
    workers: list[Any]
    worker_procs: list[Any]
    relay: Any


@contextlib.contextmanager
def _fsdp2_behind_a_relay(
    tmp_path: Any, leaves: tuple[int, ...], rank_timeout: float, relay_args: tuple[str, ...] = ()
) -> Iterator[_Job]:
    """Two FSDP2 ranks over gloo (uneven shards, a ``Shard(1)`` tensor, a replica, a
    buffer), the ``zmqsync relay`` command (worker 0 of theirs) given rank 0's endpoint
    alone, and plain workers ``leaves`` behind it (the last one writing in place): all
    connected, each holding version 0, the gathered model."""
    from _sharded import run_plain_worker, run_rank
    from conftest import free_port
    from test_cli_processes import Cli

    port = free_port()
    endpoints = ipc_endpoints(tmp_path, 2)
    job = _Job([], [], [], None)
    with Processes() as procs:
        try:
            # Each rank's connect() waits for the relay; its sends, for the workers
            # behind it too (the relay acks once they hold the version).
            after = ("pubsub", True, 120.0, rank_timeout, 1)
            job.learners = procs.ranks(run_rank, port, endpoints, after)
            answers(job.learners, "ready")
            job.relay = Cli(
                [
                    "relay",
                    endpoints[0],
                    "--endpoint",
                    f"ipc://{tmp_path}/relay",
                    "--relay-idx",
                    "0",
                    "--strategy",
                    "state_dict",
                    "--timeout",
                    "120",
                    *relay_args,
                ],
                cwd=tmp_path,
                env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="160"),
            )
            below = job.relay.expect(r"zmqsync relay: listening on (ipc://\S+) .* as worker 0", 150)
            for w in leaves:
                mode = "in_place" if w == leaves[-1] else "auto"
                job.workers.append(
                    procs.start(run_plain_worker, below[1], w, after=("pubsub", mode))
                )
                job.worker_procs.append(procs.procs[-1])
            # The rendez-vous: worker 0, the relay.
            replies = collective(job.learners, "connect")
            for c in job.workers:
                assert answer(c, "ready") == "ready"
            expected = replies[0][2]
            assert replies[1][2] == expected
            for c in job.workers:
                assert ask(c, "state") == (0, expected)
            yield job
        finally:
            if job.relay is not None:
                job.relay.stop()


@pytest.mark.timeout(300)
def test_an_fsdp2_learner_of_two_ranks_through_a_relay_process(tmp_path: Any) -> None:
    """Each version's ``send()``, on both ranks, returns once both workers behind the
    relay hold the whole version: the gathered model's checksum."""
    with _fsdp2_behind_a_relay(tmp_path, (1, 2), 30.0) as job:
        for version in (1, 2, 3):
            replies = collective(job.learners, "send")
            assert {a[1] for a in replies} == {version}
            expected = replies[0][2]
            assert replies[1][2] == expected
            for c in job.workers:
                assert ask(c, "state") == (version, expected)
        job.relay.expect(r"^version 3: forwarded to 2 worker", 30)


@pytest.mark.timeout(300)
def test_a_stopped_worker_behind_the_relay_process_is_named_by_both_ranks(
    tmp_path: Any,
) -> None:
    """The relay waits for its workers 0 and 1 (``--workers 2``); worker 1's process is
    SIGSTOPped: both ranks' ``send()`` raise SyncTimeout naming the relay and worker 1
    behind it; worker 0 holds the version. SIGCONT: the next version reaches both."""
    timeout = 4.0
    with _fsdp2_behind_a_relay(tmp_path, (0, 1), timeout, ("--workers", "2")) as job:
        known = {a[1]: a[2] for a in collective(job.learners, "bump")}
        os.kill(job.worker_procs[1].pid, signal.SIGSTOP)
        for r, reply in enumerate(collective(job.learners, "push")):
            assert reply[:2] == ("timeout", 1), (r, reply)
            missing_workers, missing_ranks, message = reply[2], reply[3], reply[4]
            assert list(missing_workers) == [0] and not missing_ranks, (r, reply)
            assert "a relay for 2 worker(s)" in message, (r, message)
            assert "worker 1 holds 0" in message, (r, message)
        assert ask(job.workers[0], "state") == (1, known[1])
        os.kill(job.worker_procs[1].pid, signal.SIGCONT)
        known.update({a[1]: a[2] for a in collective(job.learners, "bump")})
        pushed = collective(job.learners, "push", timeout=120)
        assert [a[:2] for a in pushed] == [("push", 2)] * len(job.learners)
        for c in job.workers:
            assert ask(c, "state") == (2, known[2])


@pytest.mark.timeout(120)
def test_two_relays_a_dead_one_and_its_restart_each_get_every_ranks_part_once() -> None:
    """Relays 8 and 9 below two ranks, a worker behind each (worker 0 behind relay 8,
    with relay 9 to fail over to): each rank sends its part once per relay. Relay 8
    closes: worker 0 fails over to relay 9, every rank's claims follow, and the next
    version costs each rank its part once. Relay 8 restarts (a new process would do the
    same: a new session with every rank) and serves a late joiner; the version after
    costs each rank its part twice again."""
    import functools

    learner = _learner()
    ranks = 2
    parts = [_part_bytes(learner, r, ranks) for r in range(ranks)]
    slack = len(learner) * STREAM_ALIGN
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(3)]
    names = [f"memory://two-relays-rank{r}" for r in range(ranks)]
    senders = rank_senders(names, learner, timeout=20, epoch=78, heartbeat=BEAT)
    relays: dict[str, Relay] = {}
    leaves: list[WeightReceiver] = []

    def relay(idx: int, endpoint: str) -> Relay:
        node = Relay(
            MemorySpoke(names[0]),
            MemoryHub(endpoint),
            strategy="state_dict",
            worker_idx=idx,
            heartbeat=BEAT,
            timeout=20,
            connect_rank=MemorySpoke,
        )
        relays[endpoint] = node
        node.connect()
        node.start()
        return node

    def step(times: int) -> None:
        """One version, each rank sending its part ``times`` times (once per relay)."""
        _bump(learner)
        before = [_bytes_sent(s) for s in senders]
        assert sends(senders) == [None] * ranks
        for r, s in enumerate(senders):
            sent = _bytes_sent(s) - before[r]
            assert times * parts[r] <= sent <= times * (parts[r] + slack), (r, sent, times)

    try:
        relay(8, "memory://relay-a")
        relay(9, "memory://relay-b")
        back = [functools.partial(MemorySpoke, e) for e in ("memory://relay-b", "memory://relay-a")]
        leaves.append(_leaf("memory://relay-a", 0, models[0], failover=back))
        leaves.append(_leaf("memory://relay-b", 1, models[1]))
        for s in senders:
            until(lambda s=s: below_of(s, 8) == {0} and below_of(s, 9) == {1}, 20, "claims")
        step(2)
        relays.pop("memory://relay-a").close()  # goodbye to every rank
        for s in senders:
            until(lambda s=s: below_of(s, 9) == {0, 1}, 30, "worker 0 followed to relay 9")
        step(1)
        assert [leaf.stats["failovers"] for leaf in leaves] == [1, 0]
        before = [_bytes_sent(s) for s in senders]
        relay(8, "memory://relay-a2")
        for r, s in enumerate(senders):  # its own copy, fetched from every rank once
            assert _bytes_sent(s) - before[r] <= parts[r] + slack
        leaves.append(_leaf("memory://relay-a2", 2, models[2]))
        assert leaves[2].version == 2
        step(2)
        assert [leaf.version for leaf in leaves] == [3, 3, 3]
        assert [checksum(m, "state_dict") for m in models] == [checksum(learner, "state_dict")] * 3
    finally:
        for leaf in leaves:
            leaf.close()
        for node in relays.values():
            node.close()
        for s in senders:
            s.close()


@pytest.mark.timeout(120)
def test_with_curve_every_rank_takes_the_claims_of_relay_keys_only() -> None:
    """Two ranks over tcp with CURVE; a relay whose key every rank was given as a
    relay's, and a client with a valid key that is not one, each with a worker behind
    it. Both reach every rank (with the same keys) and forward every version; every
    rank takes the relay's claims and refuses the other's, so a send to the worker
    behind the other client times out on every rank, naming that worker."""
    from zmqsync.security import CurveClient, CurveServer, generate_keypair
    from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke

    server_public, server_secret = generate_keypair()
    relay_keys, other_keys = generate_keypair(), generate_keypair()
    curve = CurveServer(server_public, server_secret).with_relays({relay_keys[0]})
    learner = _learner()
    hubs = [PubSubHub("tcp://127.0.0.1:*", curve=curve) for _ in range(2)]
    endpoints = [h.endpoint for h in hubs]
    senders = rank_senders(
        endpoints, learner, hubs=dict(enumerate(hubs)), timeout=20, epoch=79, heartbeat=BEAT
    )
    relays: list[Relay] = []
    leaves: list[WeightReceiver] = []
    models = {w: {k: torch.zeros_like(t) for k, t in learner.items()} for w in (5, 6)}
    try:
        for idx, (public, secret) in ((1, relay_keys), (2, other_keys)):
            node = Relay.over_zmq(
                endpoints[0],
                curve_client=CurveClient(public, secret, server_public),
                strategy="state_dict",
                worker_idx=idx,
                heartbeat=BEAT,
                timeout=30,
            )
            relays.append(node)
            node.connect()
            node.start()
            assert node.receiver.ranks == tuple(endpoints)
        for node, w in zip(relays, (5, 6), strict=True):
            leaf = WeightReceiver(
                PubSubSpoke(node.endpoint, identity=f"leaf{w}"),
                model=models[w],
                strategy="state_dict",
                worker_idx=w,
                timeout=30,
            )
            leaves.append(leaf)
            leaf.connect()
            leaf.start()
        for s in senders:
            until(lambda s=s: below_of(s, 1) == {5}, 20, "relay 1 claimed worker 5")
            until(
                lambda s=s: s.status()["totals"]["refused_claims"] >= 3,
                20,
                "the other client's claims were refused, heartbeat after heartbeat",
            )
            assert below_of(s, 2) == set()
        _bump(learner)
        assert sends(senders) == [None, None]  # every version reaches both, through both
        assert [checksum(m, "state_dict") for m in models.values()] == (
            [checksum(learner, "state_dict")] * 2
        )
        for s in senders:
            s.timeout = 3.0
        _bump(learner)
        for r, exc in enumerate(sends(senders, worker_ids=[6])):
            assert isinstance(exc, SyncTimeout), (r, exc)
            assert list(exc.missing_workers) == [6], (r, exc.missing_workers)
    finally:
        for leaf in leaves:
            leaf.close()
        for node in relays:
            node.close()
        for s in senders:
            s.close()


@pytest.mark.timeout(120)
def test_a_targeted_send_through_the_relay_reaches_only_the_workers_named() -> None:
    """``send(worker_ids=[0])`` on every rank, worker 0 behind the relay: the relay
    forwards the gathered version to worker 0 alone and acks once it holds it; worker 1
    keeps what it holds, and the next send to all reaches both."""
    learner = _learner()
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    with _sharded("targeted", 2, learner) as (senders, _relay, below):
        leaves = [_leaf(below, i, models[i]) for i in range(2)]
        try:
            for s in senders:
                until(lambda s=s: below_of(s, 9) == {0, 1}, 20, "the relay claimed 0 and 1")
            _bump(learner)
            assert sends(senders, worker_ids=[0]) == [None, None]
            assert [leaf.version for leaf in leaves] == [1, 0]
            assert checksum(models[0], "state_dict") == checksum(learner, "state_dict")
            assert checksum(models[1], "state_dict") != checksum(learner, "state_dict")
            _bump(learner)
            assert sends(senders) == [None, None]
            assert [leaf.version for leaf in leaves] == [2, 2]
            assert [checksum(m, "state_dict") for m in models] == (
                [checksum(learner, "state_dict")] * 2
            )
        finally:
            for leaf in leaves:
                leaf.close()


@pytest.mark.timeout(120)
def test_a_restarted_sharded_learner_is_followed_through_the_relay() -> None:
    """Every rank of the learner job restarts on the same addresses (a new epoch,
    versions from 1 again): the relay follows every rank's new life, and its workers
    get the new job's versions whole."""
    learner = _learner()
    names = [f"memory://restarted-rank{r}" for r in range(2)]

    def job(epoch: int) -> list[WeightSender]:
        return rank_senders(names, learner, timeout=20, epoch=epoch, heartbeat=BEAT)

    senders = job(101)
    models = [{k: torch.zeros_like(t) for k, t in learner.items()} for _ in range(2)]
    relay = Relay(
        MemorySpoke(names[0]),
        MemoryHub("memory://restarted-relay"),
        strategy="state_dict",
        worker_idx=9,
        heartbeat=BEAT,
        timeout=30,
        connect_rank=MemorySpoke,
    )
    leaves: list[WeightReceiver] = []
    try:
        relay.connect()
        relay.start()
        leaves.extend(_leaf("memory://restarted-relay", w, models[w]) for w in range(2))
        for _ in range(2):
            _bump(learner)
            assert sends(senders) == [None, None]
        for s in senders:
            s.close()
        _bump(learner)
        senders = job(202)  # a new job: every rank, a new epoch
        until(lambda: relay.receiver.epoch == 202, 30, "the relay followed the new job")
        until(lambda: all(leaf.epoch == 202 for leaf in leaves), 30, "its workers followed")
        assert [checksum(m, "state_dict") for m in models] == (
            [checksum(learner, "state_dict")] * 2
        )
        _bump(learner)
        assert sends(senders) == [None, None]
        assert [(leaf.epoch, leaf.version) for leaf in leaves] == [(202, 1)] * 2
        assert [checksum(m, "state_dict") for m in models] == (
            [checksum(learner, "state_dict")] * 2
        )
    finally:
        for leaf in leaves:
            leaf.close()
        relay.close()
        for s in senders:
            s.close()
