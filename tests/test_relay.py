"""Relays: a learner sends each version once per relay, relays forward chunks as they
come, and ``send()`` still returns only when the leaves hold the version.

Every case checks each leaf's checksum against the learner's, and what moved against
the sender's own byte counters.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from _faults import until
from _workers import run_leaves

from zmqsync import Relay, SyncTimeout, WeightReceiver, WeightSender, checksum
from zmqsync.protocol import Buffer, Chunk, decode
from zmqsync.transport.zmq_pubsub import PubSubHub, PubSubSpoke
from zmqsync.transport.zmq_router import RouterHub, RouterSpoke

MIB = 1 << 20
SPAWN = mp.get_context("spawn")


def _model(mib: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"layer{i}.weight": torch.randn(mib * MIB // 4 // 4, generator=g) for i in range(4)}
    out["layer0.bias"] = torch.randn(16, generator=g)
    return out


def _hub(mode: str = "pubsub"):  # type: ignore[no-untyped-def]
    return (PubSubHub if mode == "pubsub" else RouterHub)("tcp://127.0.0.1:*", insecure=True)


def _spoke(endpoint: str, name: str, mode: str = "pubsub"):  # type: ignore[no-untyped-def]
    return (PubSubSpoke if mode == "pubsub" else RouterSpoke)(endpoint, identity=name)


def _bump(model: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in model.values():
            t.add_(torch.randn_like(t))


@contextlib.contextmanager
def _leaves(
    upstream: str,
    ids: list[int],
    models: dict[int, dict[str, torch.Tensor]],
    mib: int = 4,
    **kw: object,
) -> Iterator[dict[int, WeightReceiver]]:
    receivers = {}
    try:
        for i in ids:
            models[i] = {k: torch.zeros_like(v) for k, v in _model(mib).items()}
            receivers[i] = WeightReceiver(
                _spoke(upstream, f"leaf{i}"),
                model=models[i],
                strategy="state_dict",
                worker_idx=i,
                **kw,  # type: ignore[arg-type]
            )
            receivers[i].connect(timeout=30)
            receivers[i].start()
        yield receivers
    finally:
        for r in receivers.values():
            r.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_two_relays_forward_every_version_and_the_learner_sends_once_per_relay(
    mode: str,
) -> None:
    model = _model()
    nbytes = sum(t.numel() * 4 for t in model.values())
    learner = WeightSender(
        _hub(mode), model=model, strategy="state_dict", num_workers=2, timeout=30
    )
    relays = [
        Relay(
            _spoke(learner.endpoint, f"relay{r}", mode),
            _hub(mode),
            strategy="state_dict",
            worker_idx=r,
            num_workers=None,
            heartbeat=0.2,
            chunk_bytes=MIB,
        )
        for r in range(2)
    ]
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for relay in relays:
            relay.connect(timeout=30)
            relay.start()
        with (
            _leaves(relays[0].endpoint, [10, 11, 12], models),
            _leaves(relays[1].endpoint, [20, 21, 22], models),
        ):
            for _ in range(4):
                _bump(model)
                before = learner.status()["totals"]["bytes_sent"]
                learner.send()
                # Returned: every leaf holds it (each relay acked for its own).
                assert {i: checksum(m) for i, m in models.items()} == dict.fromkeys(
                    models, checksum(model)
                )
                assert learner.status()["totals"]["bytes_sent"] - before == 2 * nbytes
            for relay in relays:
                forwarded = relay.status()["relay"]
                assert forwarded["versions_forwarded"] >= 4, forwarded
            until(
                lambda: all(
                    row["below"] is not None and len(row["below"]) == 3
                    for row in learner.status()["workers"]
                ),
                10,
                "each relay named its workers in a heartbeat",
            )
    finally:
        for relay in relays:
            relay.close()
        learner.close()


@pytest.mark.timeout(120)
def test_a_late_joiner_is_served_by_its_relay_and_a_tree_of_two_levels_converges() -> None:
    model = _model()
    learner = WeightSender(_hub(), model=model, strategy="state_dict", timeout=30)
    top = Relay(_spoke(learner.endpoint, "top"), _hub(), strategy="state_dict", heartbeat=0.2)
    mid = Relay(_spoke(top.endpoint, "mid"), _hub(), strategy="state_dict", heartbeat=0.2)
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for relay in (top, mid):
            relay.connect(timeout=30)
            relay.start()
        with _leaves(mid.endpoint, [1, 2], models):
            for _ in range(3):
                _bump(model)
                learner.send()
                assert [checksum(m) for m in models.values()] == [checksum(model)] * 2
            # A worker joins the lower relay late: it is served from that relay's copy;
            # nothing more comes down from the learner or the upper relay.
            received = (top.receiver.stats["received_bytes"], mid.receiver.stats["received_bytes"])
            with _leaves(mid.endpoint, [3], models):
                assert checksum(models[3]) == checksum(model)
                assert (
                    top.receiver.stats["received_bytes"],
                    mid.receiver.stats["received_bytes"],
                ) == received
                _bump(model)
                learner.send()
                assert [checksum(m) for m in models.values()] == [checksum(model)] * 3
    finally:
        mid.close()
        top.close()
        learner.close()


@pytest.mark.timeout(120)
def test_a_timeout_names_the_relay_and_the_worker_behind_it_that_lags() -> None:
    model = _model()
    learner = WeightSender(_hub(), model=model, strategy="state_dict", num_workers=1, timeout=2)
    relay = Relay(
        _spoke(learner.endpoint, "relay"),
        _hub(),
        strategy="state_dict",
        worker_idx=0,
        num_workers=3,  # an ack upstream waits for workers 0, 1 and 2
        heartbeat=0.2,
    )
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [0, 1, 2], models) as leaves:
            _bump(model)
            learner.send()
            leaves[2].stop()  # worker 2 stops applying (its session stays)
            _bump(model)
            with pytest.raises(SyncTimeout) as caught:
                learner.send()
            message = str(caught.value)
            assert "a relay for 3 worker(s)" in message, message
            assert "worker 2 holds 1" in message, message
            assert [checksum(models[i]) for i in (0, 1)] == [checksum(model)] * 2
            leaves[2].start()  # back: it catches up, and the relay acks
            _bump(model)
            learner.send()
            assert [checksum(m) for m in models.values()] == [checksum(model)] * 3
    finally:
        relay.close()
        learner.close()


@pytest.mark.timeout(120)
def test_deltas_pass_through_a_relay() -> None:
    model = _model()
    learner = WeightSender(_hub(), model=model, strategy="state_dict", delta=True, timeout=30)
    relay = Relay(_spoke(learner.endpoint, "relay"), _hub(), strategy="state_dict")
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [1, 2], models) as leaves:
            _bump(model)
            learner.send()
            for step in range(3):
                with torch.no_grad():
                    model[f"layer{step}.weight"][:1000].add_(1)
                before = relay.receiver.stats["received_bytes"]
                learner.send()
                assert relay.receiver.stats["received_bytes"] - before <= 2 * MIB
                assert [checksum(m) for m in models.values()] == [checksum(model)] * 2
            assert all(r.stats["deltas"] >= 3 for r in leaves.values())
            assert relay.receiver.stats["deltas"] >= 3
    finally:
        relay.close()
        learner.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_hundred_workers_behind_two_relays_reach_every_version() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 8192), hard), hard))
    model = {"w": torch.zeros(1024), "b": torch.zeros(16)}
    learner = WeightSender(_hub(), model=model, strategy="state_dict", num_workers=2, timeout=60)
    relays = [
        Relay(
            _spoke(learner.endpoint, f"relay{r}"),
            _hub(),
            strategy="state_dict",
            worker_idx=r,
            heartbeat=0.5,
            timeout=60,
        )
        for r in range(2)
    ]
    procs, conns = [], []
    try:
        for relay in relays:
            relay.connect(timeout=30)
            relay.start()
        for p in range(4):  # light processes of 50 receivers each
            parent, child = SPAWN.Pipe()
            ids = list(range(p * 50, (p + 1) * 50))
            proc = SPAWN.Process(
                target=run_leaves, args=([r.endpoint for r in relays], ids, child, 120), daemon=True
            )
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            assert conn.poll(180), "a process of workers did not start"
            assert conn.recv() == "ready"
        until(
            lambda: all(len(r.sender.connected_workers()) == 100 for r in relays),
            60,
            "each relay has its 100 workers",
        )
        nbytes = sum(t.numel() * 4 for t in model.values())
        for version in range(1, 4):
            with torch.no_grad():
                model["w"].add_(float(version))
            before = learner.status()["totals"]["bytes_sent"]
            learner.send()
            # Once per relay, whatever the number of workers behind them.
            assert learner.status()["totals"]["bytes_sent"] - before == 2 * nbytes
            state: dict[int, tuple[int, str]] = {}
            for conn in conns:
                conn.send("state")
                assert conn.poll(60)
                reply = conn.recv()
                assert not isinstance(reply, tuple), reply
                state.update(reply)
            assert len(state) == 200
            assert set(state.values()) == {(version, checksum(model))}
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send("stop")
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for relay in relays:
            relay.close()
        learner.close()


@pytest.mark.timeout(120)
def test_the_workers_of_a_dead_relay_fail_over_and_the_learner_names_it() -> None:
    model = _model()
    learner = WeightSender(_hub(), model=model, strategy="state_dict", num_workers=2, timeout=30)
    relays = [
        Relay(
            _spoke(learner.endpoint, f"relay{r}"),
            _hub(),
            strategy="state_dict",
            worker_idx=r,
            heartbeat=0.2,
        )
        for r in range(2)
    ]
    models: dict[int, dict[str, torch.Tensor]] = {}
    backup = relays[1].endpoint
    try:
        for relay in relays:
            relay.connect(timeout=30)
            relay.start()
        with (
            # Ids of their own: a worker id that a session of the learner holds (relay
            # 1 is worker 1) cannot be claimed by a relay.
            _leaves(
                relays[0].endpoint,
                [11, 12],
                models,
                failover=[lambda: _spoke(backup, "moved")],
            ) as moving,
            _leaves(backup, [13], models),
        ):
            _bump(model)
            learner.send()
            until(
                lambda: len(learner.status()["workers"][0]["below"] or {}) == 2,
                10,
                "relay 0 named its workers in a heartbeat",
            )
            # Relay 0 dies without a word (as a SIGKILL would leave it).
            dead = relays[0]
            dead._stop.set()
            assert dead._thread is not None
            dead._thread.join(10)
            dead.receiver.transport.close()
            dead.sender.close()
            _bump(model)
            # Shorter than the 3 heartbeats after which relay 0 is no longer live: then
            # relay 1's claim on the workers that moved to it takes them from relay 0.
            learner.timeout = 2
            with pytest.raises(SyncTimeout) as caught:
                learner.send()
            learner.timeout = 30
            assert list(caught.value.missing_workers) == [0]
            assert "a relay for 2 worker(s)" in str(caught.value)
            # Its workers move to relay 1 and catch up from it.
            until(
                lambda: {11, 12, 13} <= set(relays[1].sender.connected_workers()),
                20,
                "the workers of the dead relay joined the other one",
            )
            assert all(r.stats["failovers"] == 1 for r in moving.values())
            learner.num_workers = None  # the live relay: relay 0 is gone
            until(lambda: 0 not in learner.current_workers(), 20, "relay 0 counts as gone")
            until(
                lambda: not any(r["live"] for r in learner.status()["workers"] if r["worker"] == 0),
                20,
                "relay 0 is no longer live (a send to every live worker leaves it out)",
            )
            _bump(model)
            learner.send()
            assert [checksum(m) for m in models.values()] == [checksum(model)] * 3
    finally:
        relays[1].close()
        learner.close()


@pytest.mark.timeout(120)
def test_worker_ids_reach_workers_behind_relays_and_only_them() -> None:
    model = _model()
    nbytes = sum(t.numel() * 4 for t in model.values())
    learner = WeightSender(_hub(), model=model, strategy="state_dict", num_workers=2, timeout=30)
    top = Relay(
        _spoke(learner.endpoint, "top"), _hub(), strategy="state_dict", worker_idx=0, heartbeat=0.2
    )
    side = Relay(
        _spoke(learner.endpoint, "side"), _hub(), strategy="state_dict", worker_idx=1, heartbeat=0.2
    )
    mid = Relay(
        _spoke(top.endpoint, "mid"), _hub(), strategy="state_dict", worker_idx=5, heartbeat=0.2
    )
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for relay in (top, side, mid):
            relay.connect(timeout=30)
            relay.start()
        with (
            _leaves(top.endpoint, [10, 11], models),
            _leaves(mid.endpoint, [20, 21], models),
            _leaves(side.endpoint, [30, 31], models),
        ):
            _bump(model)
            learner.send()
            first = checksum(model)
            until(
                lambda: (
                    {w for row in learner.status()["workers"] for w in (row["below"] or {})}
                    >= {"5", "10", "11", "20", "21", "30", "31"}
                ),
                15,
                "the relays named every worker behind them, two levels down included",
            )
            _bump(model)
            before = learner.status()["totals"]["bytes_sent"]
            learner.send(worker_ids=[11, 21, 31])  # behind top, behind mid, behind side
            # Returned: exactly those three hold it; the learner sent one copy per relay.
            held = {i: checksum(m) for i, m in models.items()}
            assert {i for i, c in held.items() if c == checksum(model)} == {11, 21, 31}
            assert {i for i, c in held.items() if c == first} == {10, 20, 30}
            assert learner.status()["totals"]["bytes_sent"] - before == 2 * nbytes
            # One more, for a single worker two relays down; an id nobody knows is refused.
            _bump(model)
            learner.send(worker_ids=[20])
            assert {i for i, m in models.items() if checksum(m) == checksum(model)} == {20}
            with pytest.raises(ValueError, match="does not exist"):
                learner.send(worker_ids=[99])
    finally:
        for relay in (mid, side, top):
            relay.close()
        learner.close()


def test_targets_ride_in_the_first_chunk_and_forged_ones_are_refused() -> None:
    from zmqsync.errors import FrameError
    from zmqsync.protocol import Chunk, decode, encode
    from zmqsync.tensors.version_messages import version_messages

    (frames,) = version_messages({"w": torch.zeros(8)})
    chunk = decode(frames)
    assert isinstance(chunk, Chunk)
    for targets in [(), (3, 7, 2**40)]:
        again = decode(encode(Chunk(**{**_fields(chunk), "targets": targets})))
        assert isinstance(again, Chunk) and again.targets == targets
    with pytest.raises(ValueError, match="worker ids"):
        encode(Chunk(**{**_fields(chunk), "targets": (-1,)}))
    good = encode(Chunk(**{**_fields(chunk), "targets": (1,)}))
    body = bytes(good[1])
    for named in (b'["x"]', b"{}", b"[-1]", b"[1.5]"):
        forged = body[: -len(b"[1]") - 4] + named + len(named).to_bytes(4, "big")
        with pytest.raises(FrameError, match="targets"):
            decode([good[0], forged, good[2]])


def _fields(chunk):  # type: ignore[no-untyped-def]
    return {f: getattr(chunk, f) for f in chunk.__dataclass_fields__}


@pytest.mark.timeout(120)
def test_a_restarted_learner_is_followed_through_a_relay() -> None:
    from conftest import free_port

    model = _model()
    # A fixed address, as a restarted learner has: its control port and the data port
    # after it, both outside the range outgoing connections take their ports from.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = WeightSender(
        PubSubHub(endpoint, insecure=True), model=model, strategy="state_dict", timeout=30
    )
    relay = Relay(_spoke(endpoint, "relay"), _hub(), strategy="state_dict", heartbeat=0.2)
    models: dict[int, dict[str, torch.Tensor]] = {}
    second = None
    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [1, 2], models) as leaves:
            for _ in range(3):
                _bump(model)
                first.send()
            old_epoch = first.epoch
            first.close()
            # A new learner life on the same address: epoch new, versions from 1 again.
            _bump(model)
            second = WeightSender(
                PubSubHub(endpoint, insecure=True), model=model, strategy="state_dict", timeout=30
            )
            assert second.epoch != old_epoch
            until(lambda: relay.receiver.epoch == second.epoch, 30, "the relay followed it")
            second.send()
            assert [checksum(m) for m in models.values()] == [checksum(model)] * 2
            assert all(r.epoch == second.epoch and r.version == 1 for r in leaves.values())
    finally:
        relay.close()
        if second is not None:
            second.close()
        first.close()


@pytest.mark.timeout(120)
def test_a_relay_that_keeps_no_snapshot_fetches_the_latest_again_for_late_joiners() -> None:
    model = _model()
    size = sum(t.numel() * t.element_size() for t in model.values())
    learner = WeightSender(_hub(), model=model, strategy="state_dict", delta=True, timeout=30)
    relay = Relay(
        _spoke(learner.endpoint, "relay"),
        _hub(),
        strategy="state_dict",
        retain_snapshot=False,
        heartbeat=0.2,
    )
    models: dict[int, dict[str, torch.Tensor]] = {}

    def sent() -> int:
        totals = learner.status()["totals"]
        return int(totals["bytes_sent"] + totals["repair_bytes"])

    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [1, 2], models) as leaves:
            _bump(model)
            learner.send()
            # Deltas pass through: the relay patches nothing, its workers do.
            with torch.no_grad():
                model["layer1.weight"][:1000].add_(1)
            before = relay.receiver.stats["received_bytes"]
            learner.send()
            assert relay.receiver.stats["received_bytes"] - before <= 2 * MIB
            assert [checksum(m) for m in models.values()] == [checksum(model)] * 2
            assert all(r.stats["deltas"] == 1 for r in leaves.values())
            # A late joiner: the relay fetches the latest again and sends it to the
            # joiner only; the learner sends one copy more, its workers get nothing.
            received = [r.stats["received_bytes"] for r in leaves.values()]
            before, refetches = sent(), relay.stats["refetches"]
            with _leaves(relay.endpoint, [3], models):
                assert checksum(models[3]) == checksum(model)
                assert relay.stats["refetches"] > refetches  # asked again until it came
                assert size <= sent() - before <= size + MIB
                assert [r.stats["received_bytes"] for r in leaves.values()] == received
                # And on: a delta reaches all three.
                with torch.no_grad():
                    model["layer2.weight"][:1000].add_(1)
                learner.send()
                assert [checksum(m) for m in models.values()] == [checksum(model)] * 3
            # Nothing of a version is kept: no staging buffer, no snapshot.
            assert relay.receiver.staging._buffer is None
            assert relay.sender.snapshot is None
            assert relay.status()["upstream"]["version"] == learner.version
    finally:
        relay.close()
        learner.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [False, True], ids=["at-once", "runner-begins-late"])
@pytest.mark.parametrize("retain", [True, False], ids=["snapshot", "no-snapshot"])
def test_a_worker_that_a_relay_is_streaming_to_is_not_sent_anything_else(
    retain: bool, late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers ask for the latest version at every heartbeat while they lack it. While
    # the relay still forwards that version to them, it must not stream its older
    # snapshot (which they hold), nor fetch the version from upstream again.
    # ``late``: the relay's hub runner begins each forward only once the relay has
    # answered a worker's ask for the version the fleet already counts (a busy
    # machine's thread switch, made long): those asks are no reason either (once, on a
    # loaded CI machine, one was: a refetch).
    asked_in_window: list[bool] = []
    answered: list[Any] = []  # how many asks the relay has answered, once armed
    if late:
        from zmqsync.sender.pump import HubRunner
        from zmqsync.sender.transfers import Forwarded

        begin = HubRunner.begin

        def begin_late(runner: HubRunner, transfer: Any) -> None:
            if isinstance(transfer.copy, Forwarded) and answered:
                before = answered[0]()
                deadline = time.monotonic() + 10
                while answered[0]() == before and time.monotonic() < deadline:
                    time.sleep(0.005)
                asked_in_window.append(answered[0]() > before)
            begin(runner, transfer)

        monkeypatch.setattr(HubRunner, "begin", begin_late)
    model = _model(32)
    learner = WeightSender(
        _hub(), model=model, strategy="state_dict", timeout=60, chunk_bytes=MIB // 4
    )
    relay = Relay(
        _spoke(learner.endpoint, "relay"),
        _hub(),
        strategy="state_dict",
        heartbeat=0.01,  # its workers' heartbeat: many requests during one version
        chunk_bytes=MIB // 4,
        retain_snapshot=retain,
    )
    relay.sender.fleet.repair_after = 0.0  # each request would be answered at once
    counts = relay.sender._stats.totals  # live: what the relay's pump decided so far
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [1, 2], models, mib=32) as leaves:
            # The forwards of the three sends below (the leaves' first version came
            # as they connected) wait for an ask.
            answered.append(
                lambda: (
                    counts["repairs_skipped"] + counts["repairs_sent"] + relay.stats["refetches"]
                )
            )
            skipped = relay.status()["totals"]["repairs_skipped"]
            repairs = relay.status()["totals"]["repairs_sent"], relay.stats["refetches"]
            for _ in range(3):
                _bump(model)
                learner.send()
                assert [checksum(m) for m in models.values()] == [checksum(model)] * 2
            totals = relay.status()["totals"]
            assert (totals["repairs_sent"], relay.stats["refetches"]) == repairs
            assert totals["repairs_skipped"] > skipped  # they did ask meanwhile
            assert all(r.stats["applied"] >= 4 for r in leaves.values())
            if late:  # the window was there, and workers asked in it
                assert asked_in_window and all(asked_in_window), asked_in_window
    finally:
        relay.close()
        learner.close()


@pytest.mark.timeout(120)
def test_a_forward_whose_begin_fails_counts_nobody_as_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hub runner's begin raises (its transport failing) while a forward starts: the
    # relay drops that version and fetches it again, and the failed forward says of no
    # worker that the version is on its way to it (else its asks would go unanswered).
    from zmqsync.sender.pump import HubRunner
    from zmqsync.sender.transfers import Forwarded

    begin, failed = HubRunner.begin, []

    def begin_once_failing(runner: HubRunner, transfer: Any) -> None:
        if isinstance(transfer.copy, Forwarded) and armed and not failed:
            failed.append(relay.sender._forwarding)
            raise OSError("the transport failed (the test)")
        begin(runner, transfer)

    monkeypatch.setattr(HubRunner, "begin", begin_once_failing)
    armed = False
    model = _model()
    learner = WeightSender(
        _hub(), model=model, strategy="state_dict", timeout=60, chunk_bytes=MIB // 4
    )
    relay = Relay(_spoke(learner.endpoint, "relay"), _hub(), strategy="state_dict", heartbeat=0.05)
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [1, 2], models) as leaves:
            armed = True
            _bump(model)
            learner.send()
            assert [checksum(m) for m in models.values()] == [checksum(model)] * 2
            assert len(failed) == 1 and failed[0] is not None
            assert failed[0].starting == {}
            assert all(r.version == learner.version for r in leaves.values())
    finally:
        relay.close()
        learner.close()


class _Gate(PubSubSpoke):
    """A relay's link to its upstream (a real spoke) that can hold back one version's
    chunks from an index on, until the test opens it: the test decides when the rest of
    a stream arrives, and so catches a relay mid-forward every time."""

    def __init__(self, endpoint: str, identity: str) -> None:
        super().__init__(endpoint, identity=identity)
        #: (version, index): chunks of that version from that index on wait.
        self.hold: tuple[int, int] | None = None
        #: What waits, in the order it came (read and emptied by the relay's loop only).
        self.held: list[list[Buffer]] = []

    def has_input(self) -> bool:
        return (self.hold is None and bool(self.held)) or super().has_input()

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        hold = self.hold
        if hold is None and self.held:
            return self.held.pop(0)
        frames = super().recv_frames(timeout)
        if frames is not None and hold is not None:
            message = decode(frames)
            if (
                isinstance(message, Chunk)
                and message.version == hold[0]
                and message.index >= hold[1]
            ):
                self.held.append(frames)
                return None
        return frames


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", ["whole", "delta"])
def test_a_late_joiner_during_a_targeted_forward_gets_the_version_it_is_told(stream: str) -> None:
    # send(worker_ids=[10]) brings version v+1 (whole, or a delta the relay patches into
    # what it holds) through a relay while a worker joins it. The relay takes the
    # joiner's request while part of v+1 has landed, and serves it v, its latest whole
    # version: v's bytes, whatever v+1 writes meanwhile and after.
    model = _model()
    learner = WeightSender(
        _hub(),
        model=model,
        strategy="state_dict",
        timeout=30,
        chunk_bytes=MIB // 4,  # 17 chunks: a stream can be cut in the middle
        delta=stream == "delta",
    )
    # The relay's stream is held on purpose: the learner must not send it again meanwhile.
    learner.fleet.repair_after = 60.0
    gate = _Gate(learner.endpoint, "relay")
    relay = Relay(gate, _hub(), strategy="state_dict", heartbeat=0.2, chunk_bytes=MIB // 4)
    models: dict[int, dict[str, torch.Tensor]] = {}
    joiners: list[WeightReceiver] = []

    connected: list[tuple[int, str]] = []  # the joiner's version and checksum at connect

    def join() -> WeightReceiver:
        models[12] = {k: torch.zeros_like(t) for k, t in model.items()}
        late = WeightReceiver(
            _spoke(relay.endpoint, "leaf12"), model=models[12], strategy="state_dict", worker_idx=12
        )
        joiners.append(late)
        late.connect(timeout=30)
        # What connect() returned with, before its thread applies anything newer.
        connected.append((late.version, checksum(models[12])))
        late.start()
        return late

    try:
        relay.connect(timeout=30)
        relay.start()
        with _leaves(relay.endpoint, [10, 11], models), ThreadPoolExecutor(2) as pool:
            _bump(model)
            learner.send()
            v, held = learner.version, checksum(model)
            until(
                lambda: any("10" in (row["below"] or {}) for row in learner.status()["workers"]),
                15,
                "the relay named worker 10 in a heartbeat",
            )
            if stream == "whole":
                _bump(model)
                gate.hold = (v + 1, 8)  # about half of it
            else:
                with torch.no_grad():  # two stretches far apart: a delta of two chunks
                    model["layer0.weight"][:1000].add_(1)
                    model["layer3.weight"][-1000:].add_(1)
                gate.hold = (v + 1, 1)
            deltas = relay.receiver.stats["deltas"]
            repairs = relay.status()["totals"]["repairs_sent"]
            try:
                sending = pool.submit(learner.send, worker_ids=[10])
                # The relay asked for more after the first part: that part is staged.
                until(lambda: gate.held, 30, "the relay staged the first part of v+1")
                joining = pool.submit(join)
                until(
                    lambda: relay.status()["totals"]["repairs_sent"] > repairs,
                    30,
                    "the relay took the joiner's request",
                )
                assert gate.held and relay.version == v  # in the middle of v+1
                gate.hold = None
                late = joining.result(timeout=30)
                sending.result(timeout=30)
                # connect() returned with v and v's bytes; or, where its stream of v broke
                # (a stall on a loaded machine) and v+1 landed before it asked again, with
                # v+1 and v+1's bytes. Never one version's label on the other's bytes.
                assert connected in ([(v, held)], [(v + 1, checksum(model))]), (v, connected)
                assert checksum(models[10]) == checksum(model)
                assert checksum(models[11]) == held  # not meant for it
                assert relay.receiver.stats["deltas"] == deltas + (stream == "delta")
                # It said hello while v+1 was the relay's latest: it gets it next, as a
                # worker that joins the learner would, and whole.
                until(lambda: late.version == v + 1, 30, "the joiner got v+1")
                assert checksum(models[12]) == checksum(model)
            finally:
                gate.hold = None  # whatever failed, the send is let through
                for late in joiners:
                    late.close()
    finally:
        relay.close()
        learner.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["whole", "delta"])
def test_a_version_the_learner_streams_again_mid_forward_restarts_the_forward(
    first: str, caplog: pytest.LogCaptureFixture
) -> None:
    # On a slow link the learner repairs a relay that is still receiving the version:
    # its heartbeat says it lacks it, so after repair_after the learner streams that
    # version again, from its first chunk. The relay, in the middle of forwarding it,
    # starts its forward of that version again (its workers' streams restart too), and
    # its workers all end with the version: nothing raised, nobody torn, no timeout.
    # "delta": the first stream is a delta, which the restart (whole) cuts; the held
    # delta chunk then breaks the restarted stream too, and a later repair restarts the
    # forward of a version whose upstream stream had already broken.
    model = _model()
    learner = WeightSender(
        _hub(),
        model=model,
        strategy="state_dict",
        timeout=30,
        heartbeat=0.2,  # the relay says what it holds this often
        chunk_bytes=MIB // 4,  # 17 chunks: a stream can be cut in the middle
        delta=first == "delta",
    )
    gate = _Gate(learner.endpoint, "relay")
    relay = Relay(gate, _hub(), strategy="state_dict", heartbeat=0.2, chunk_bytes=MIB // 4)
    models: dict[int, dict[str, torch.Tensor]] = {}
    try:
        relay.connect(timeout=30)
        relay.start()
        with (
            _leaves(relay.endpoint, [1], models, apply_mode="in_place") as placed,
            _leaves(relay.endpoint, [2], models, apply_mode="staged") as staged,
            ThreadPoolExecutor(1) as pool,
        ):
            leaves = {**placed, **staged}
            _bump(model)
            learner.send()
            v = learner.version
            if first == "whole":
                _bump(model)
                cut = 8  # about half of it comes, the rest waits
            else:
                with torch.no_grad():  # two stretches far apart: a delta of two chunks
                    model["layer0.weight"][:1000].add_(1)
                    model["layer3.weight"][-1000:].add_(1)
                cut = 1
            gate.hold = (v + 1, cut)
            broken = relay.receiver.stats["broken_streams"]
            repairs = learner.status()["totals"]["repairs_sent"]
            try:
                sending = pool.submit(learner.send)
                until(lambda: gate.held, 30, "the relay forwarded the first part of v+1")
                # The relay is mid-version and says so: the learner streams it again.
                learner.fleet.repair_after = 0.3
                until(
                    lambda: learner.status()["totals"]["repairs_sent"] > repairs,
                    30,
                    "the learner sent v+1 to the relay again",
                )
                # The restart's first part came through the gate, and its rest waits
                # behind the first stream's: the relay took the restart by then.
                count = 17 if first == "whole" else 2  # the first stream's chunks
                until(
                    lambda: len(gate.held) >= (count - cut) + (17 - cut),
                    30,
                    "the rest of the restarted stream waits at the gate",
                )
                assert relay.receiver.stats["broken_streams"] > broken
                gate.hold = None
                sending.result(timeout=30)  # returned: every leaf holds v+1
            finally:
                gate.hold = None  # whatever failed, the stream is let through
            assert relay.version == learner.version == v + 1
            assert {i: checksum(m) for i, m in models.items()} == dict.fromkeys(
                models, checksum(model)
            )
            assert not any(r.torn for r in leaves.values())
            assert all(r.version == v + 1 for r in leaves.values())
        assert "forwarded after" not in caplog.text
        assert not [r for r in caplog.records if r.name == "zmqsync.relay"], caplog.text
    finally:
        relay.close()
        learner.close()
