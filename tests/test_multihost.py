"""Multi-host fleets on real network stacks (namespaces), with the faults networks have.

Every case ends with: every live worker at the latest version, versions never went
backwards on any worker, no worker ever applied a mixed version (each applied version's
checksum equals the one the sender sent under that epoch and version), and no send
blocked past its timeout.
"""

from __future__ import annotations

import copy
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _hosts import Proc, SenderProc, host_relay, host_sender, host_worker
from netns import Topology, why_unavailable

from zmqsync import ZMQWeightSyncScheme
from zmqsync.security import CurveClient, CurveServer, generate_keypair

pytestmark = [pytest.mark.slow]

if (reason := why_unavailable()) is not None:
    pytest.fail(reason, pytrace=False)  # CI has both: missing them is an error, not a skip

PORT = 5555


class Net:
    """A learner host and worker hosts, with the records needed to check every promise."""

    def __init__(self, topo: Topology, workers: int) -> None:
        self.topo = topo
        self.names = [f"w{i}" for i in range(workers)]
        self.sender: SenderProc | None = None
        self.workers: dict[int, Proc] = {}
        self.sent: dict[tuple[int, int], str] = {}

    def start_sender(self, mb: float, **options: Any) -> Any:
        options.setdefault("endpoint", f"tcp://{self.topo.address('learner')}:{PORT}")
        options.setdefault("mode", "pubsub")
        if "curve_server" not in options:
            options.setdefault("insecure", True)
        self.sender = SenderProc(
            host_sender, self.topo.namespace("learner"), options, mb, len(self.names)
        )
        reply = self.sender.recv()
        assert reply[0] == "ready"
        epoch, version, checksum = reply[2]
        self.sent[(epoch, version)] = checksum
        return reply[1]

    def start_worker(self, i: int, scheme: Any, mb: float, slow_apply: float = 0.0) -> None:
        self.workers[i] = Proc(
            host_worker, self.topo.namespace(self.names[i]), copy.copy(scheme), i, mb, slow_apply
        )

    def ready(self, *ids: int) -> None:
        for i in ids:
            assert self.workers[i].recv() == "ready"

    def send(
        self, worker_ids: list[int] | None = None, timeout: float = 10.0
    ) -> tuple[str, list[int]]:
        assert self.sender is not None
        self.start_send(worker_ids, timeout)
        result, _sent, took, missing = self.sender.recv(timeout + 30)
        assert took < timeout + 1.0, f"send blocked {took:.2f}s past its {timeout}s timeout"
        return result, missing

    def start_send(self, worker_ids: list[int] | None, timeout: float) -> None:
        """Ask the sender for a new version; record its checksum before it goes out."""
        assert self.sender is not None
        self.sender.conn.send(("send", worker_ids, timeout))
        kind, sent = self.sender.recv(30)
        assert kind == "sending"
        self.sent[(sent[0], sent[1])] = sent[2]

    def state(self, i: int) -> dict[str, Any]:
        return self.workers[i].ask("state")  # type: ignore[no-any-return]

    def wait_for_latest(self, ids: list[int], within: float = 30.0) -> None:
        epoch, version = list(self.sent)[-1][:2]
        deadline = time.monotonic() + within
        for i in ids:
            while True:
                state = self.state(i)
                if (state["epoch"], state["version"]) == (epoch, version):
                    break
                assert time.monotonic() < deadline, (
                    f"worker {i} stuck at {state['version']} (epoch {state['epoch']}); "
                    f"latest is {version} (epoch {epoch})"
                )
                time.sleep(0.1)

    def check_histories(self, ids: list[int]) -> None:
        for i in ids:
            history = self.state(i)["history"]
            assert history, f"worker {i} applied nothing"
            per_epoch: dict[int, int] = {}
            for epoch, version, checksum in history:
                assert per_epoch.get(epoch, -1) < version, f"worker {i} went backwards: {history}"
                per_epoch[epoch] = version
                assert (epoch, version) in self.sent, f"worker {i} applied an unsent version"
                assert self.sent[(epoch, version)] == checksum, (
                    f"worker {i} applied a mixed version {version} of epoch {epoch}"
                )

    def close(self) -> None:
        for proc in self.workers.values():
            proc.close()
        if self.sender is not None:
            self.sender.close()


@pytest.fixture
def net(request) -> Iterator[Net]:  # type: ignore[no-untyped-def]
    workers = getattr(request, "param", 2)
    with Topology(["learner"] + [f"w{i}" for i in range(workers)]) as topo:
        n = Net(topo, workers)
        try:
            yield n
        finally:
            n.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pubsub", "router"])
def test_hosts_sync_over_tcp_with_curve(net: Net, mode: str) -> None:
    server_pub, server_sec = generate_keypair()
    client_pub, client_sec = generate_keypair()
    scheme = net.start_sender(
        1.0, mode=mode, curve_server=CurveServer(server_pub, server_sec, frozenset({client_pub}))
    )
    assert scheme.endpoint.startswith("tcp://198.18.77.1:")
    scheme.curve_client = CurveClient(client_pub, client_sec, server_pub)
    for i in range(2):
        net.start_worker(i, scheme, 1.0)
    net.ready(0, 1)
    for _ in range(3):
        assert net.send() == ("ok", [])
    net.wait_for_latest([0, 1], within=5)
    net.check_histories([0, 1])


@pytest.mark.timeout(180)
def test_cut_link_is_named_and_catches_up_when_restored(net: Net) -> None:
    scheme = net.start_sender(2.0)
    for i in range(2):
        net.start_worker(i, scheme, 2.0)
    net.ready(0, 1)
    assert net.send() == ("ok", [])
    net.topo.link("w1", up=False)
    for _ in range(2):  # the learner keeps training and sending while w1 is cut off
        assert net.send(timeout=3.0) == ("timeout", [1])
    assert net.state(0)["version"] == 3
    net.topo.link("w1", up=True)
    net.wait_for_latest([0, 1], within=30)  # by itself: heartbeats ask for the snapshot
    assert net.send() == ("ok", [])
    net.check_histories([0, 1])


@pytest.mark.timeout(240)
def test_delay_and_loss_do_not_break_correctness(net: Net) -> None:
    scheme = net.start_sender(4.0, mode="router")
    # Token-bucket shaping: 40 Mbit/s with a short queue -> queueing delay and drops.
    net.topo.shape("w0", rate="40mbit", burst="32kb", latency="20ms")
    net.topo.shape("w1", rate="80mbit", burst="16kb", latency="5ms")
    for i in range(2):
        net.start_worker(i, scheme, 4.0)
    net.ready(0, 1)
    for _ in range(3):
        assert net.send(timeout=30.0) == ("ok", [])
    net.check_histories([0, 1])


@pytest.mark.timeout(240)
def test_worker_stopped_mid_transfer(net: Net) -> None:
    scheme = net.start_sender(16.0)
    net.topo.shape("w1", rate="40mbit", burst="64kb", latency="50ms")  # ~3 s per version
    for i in range(2):
        net.start_worker(i, scheme, 16.0)
    net.ready(0, 1)
    assert net.send(timeout=30.0) == ("ok", [])
    sender = net.sender
    assert sender is not None
    net.start_send(None, 4.0)
    time.sleep(0.8)  # let the transfer to w1 get under way
    net.workers[1].signal(signal.SIGSTOP)
    result, _, took, missing = sender.recv(60)
    assert (result, missing) == ("timeout", [1]) and took < 5.0
    # The learner moves on while w1 is frozen (w0 keeps up); then w1 wakes up.
    assert net.send(timeout=4.0) == ("timeout", [1])
    assert net.state(0)["version"] == 3
    net.workers[1].signal(signal.SIGCONT)
    net.wait_for_latest([0, 1], within=60)
    net.check_histories([0, 1])


def _egress(net: Net, host: str) -> int:
    """The bytes that have left ``host``'s link (its eth0's tx counter)."""
    path = "/sys/class/net/eth0/statistics/tx_bytes"
    out = subprocess.run(
        ["ip", "netns", "exec", net.topo.namespace(host), "cat", path],
        check=True,
        capture_output=True,
        text=True,
        timeout=20,
    )
    return int(out.stdout)


@pytest.mark.timeout(300)
def test_a_version_slower_than_repair_after_goes_out_once_over_a_slow_link(net: Net) -> None:
    """The learner's link (100 Mbit/s) carries a 16 MiB version to two workers in about
    three seconds, longer than repair_after (1 s): the workers ask for it by heartbeat
    while its last chunks are still queued in the transport (the sender's window holds
    the whole version, so it handed all of it over at once). They are not sent it again:
    the link carries about one copy per worker (the counters, not durations, say so)."""
    scheme = net.start_sender(16.0)
    for i in range(2):
        net.start_worker(i, scheme, 16.0)
    net.ready(0, 1)
    net.wait_for_latest([0, 1])  # joined: what joining sent is not counted below
    net.topo.shape("learner", rate="100mbit", burst="256kb", latency="200ms")
    before, egress = _totals(net), _egress(net, "learner")
    for _ in range(2):
        assert net.send(timeout=60.0) == ("ok", [])
    after, egress = _totals(net), _egress(net, "learner") - egress
    # Before the fix: 17 repairs and 35 stalls, about five copies per worker. A worker
    # starved of CPU may read its version's tail past its next heartbeat once a version
    # (the transport let go of it: a repair then is a fair one), hence the slack.
    assert after["repairs_sent"] - before["repairs_sent"] <= 2, (before, after)
    sent = after["bytes_sent"] - before["bytes_sent"]
    assert sent >= 2 * 2 * 16 * 1024 * 1024  # two versions to two workers
    assert egress < 2 * sent, f"{egress} bytes left the link for {sent} sent"
    net.check_histories([0, 1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("net", [1], indirect=True)
def test_a_slow_link_that_holds_the_window_is_waited_for_not_stalled(net: Net) -> None:
    """A 40 MiB version in the default 8 MiB chunks over a 100 Mbit/s link: the window
    (4 chunks) fills, and its oldest chunk is held 0.7 s, past the stall clock's limit.
    The worker, whose chunks come slowly, says it reads them (Reading notes), so the
    window waits for it. The first version over the new link may be given up on before
    the worker's pace is known; the next ones count no stall and need no repair. Before,
    each such chunk counted as stalled (a stopped peer's), the window went on without
    it, and the worker's stream broke."""
    scheme = net.start_sender(40.0)
    net.start_worker(0, scheme, 40.0)
    net.ready(0)
    net.wait_for_latest([0])
    net.topo.shape("learner", rate="100mbit", burst="256kb", latency="200ms")
    assert net.send(timeout=60.0) == ("ok", [])  # the sender hears the worker's pace
    net.wait_for_latest([0], within=60)
    before, egress = _totals(net), _egress(net, "learner")
    for _ in range(2):
        assert net.send(timeout=60.0) == ("ok", [])
    after, egress = _totals(net), _egress(net, "learner") - egress
    assert after["stalls"] == before["stalls"], (before, after)
    assert after["repairs_sent"] == before["repairs_sent"], (before, after)
    sent = after["bytes_sent"] - before["bytes_sent"]
    assert sent >= 2 * 40 * 1024 * 1024
    assert egress < 1.5 * sent, f"{egress} bytes left the link for {sent} sent"
    net.check_histories([0])


def _totals(net: Net) -> dict[str, Any]:
    assert net.sender is not None
    return net.sender.ask(("status",))["totals"]  # type: ignore[no-any-return]


@pytest.mark.timeout(240)
def test_sender_killed_mid_broadcast_and_restarted(net: Net) -> None:
    scheme = net.start_sender(16.0)
    net.topo.shape("w1", rate="40mbit", burst="64kb", latency="50ms")
    for i in range(2):
        net.start_worker(i, scheme, 16.0)
    net.ready(0, 1)
    assert net.send(timeout=30.0) == ("ok", [])
    sender = net.sender
    assert sender is not None
    net.start_send(None, 30.0)
    time.sleep(0.8)
    sender.signal(signal.SIGKILL)  # mid-broadcast
    sender.proc.join(10)
    net.start_sender(16.0)  # same endpoint, new epoch
    assert net.send(timeout=30.0) == ("ok", [])
    net.wait_for_latest([0, 1], within=30)
    net.check_histories([0, 1])


@pytest.mark.timeout(240)
def test_slow_worker_lets_the_queue_fill(net: Net) -> None:
    scheme = net.start_sender(1.0)
    net.start_worker(0, scheme, 1.0)
    net.start_worker(1, scheme, 1.0, slow_apply=1.0)  # acks a second late, every version
    net.ready(0, 1)
    outcomes = [net.send(timeout=0.3)[1] for _ in range(12)]
    assert any(missing == [1] for missing in outcomes)
    assert all(missing in ([], [1]) for missing in outcomes)
    net.wait_for_latest([0, 1], within=60)
    net.check_histories([0, 1])


@pytest.mark.timeout(300)
def test_a_tree_over_curve_survives_a_killed_relay_a_restart_and_a_cut_link() -> None:
    """Learner -> relays r0, r1 (hosts of their own) -> two workers each, CURVE on every
    hop. Relay r0 is killed mid-stream: its workers fail over to r1 and the learner's
    timeout names r0; r0 restarts; then r1's link is cut and restored. Every worker ends
    at the latest version and only ever applied whole versions the learner sent."""
    learner_pub, learner_sec = generate_keypair()
    relay_pub, relay_sec = generate_keypair()
    actor_pub, actor_sec = generate_keypair()
    hosts = ["learner", "r0", "r1", "w0", "w1", "w2", "w3"]
    with Topology(hosts) as topo:
        net = Net(topo, 2)  # the learner's workers: the two relays
        relays: dict[int, Proc] = {}
        try:
            # The relays' key is a relay's: the learner takes its word for the workers
            # below it (and names them when they lag).
            relays_key = frozenset({relay_pub})
            net.start_sender(
                4.0, curve_server=CurveServer(learner_pub, learner_sec, relays_key, relays_key)
            )
            upstream = f"tcp://{topo.address('learner')}:{PORT}"
            ends = [f"tcp://{topo.address(f'r{r}')}:{PORT}" for r in range(2)]
            keys = (
                CurveServer(relay_pub, relay_sec, frozenset({actor_pub})),
                CurveClient(relay_pub, relay_sec, learner_pub),
            )

            def start_relay(r: int) -> None:
                relays[r] = Proc(host_relay, topo.namespace(f"r{r}"), upstream, ends[r], r, keys)
                assert relays[r].recv() == "ready"

            for r in range(2):
                start_relay(r)
            net.names = ["w0", "w1", "w2", "w3"]
            for i in range(4):
                r = i // 2  # w0, w1 behind r0; w2, w3 behind r1; each may go to the other
                scheme = ZMQWeightSyncScheme(
                    "state_dict",
                    endpoint=ends[r],
                    curve_client=CurveClient(actor_pub, actor_sec, relay_pub),
                )
                net.workers[i] = Proc(
                    host_worker,
                    topo.namespace(f"w{i}"),
                    scheme,
                    i,
                    4.0,
                    0.0,
                    failover=(ends[1 - r],),
                )
            net.ready(0, 1, 2, 3)
            assert net.send() == ("ok", [])
            net.wait_for_latest([0, 1, 2, 3], within=30)

            # r0 is killed while a version streams through its slow link.
            topo.shape("r0", rate="20mbit", burst="64kb", latency="100ms")
            sender = net.sender
            assert sender is not None
            forwarded = relays[0].ask("status")["relay"]["versions_forwarded"]
            net.start_send(None, 5.0)
            # Killed once the new version's stream reached r0 (not before it began).
            deadline = time.monotonic() + 10
            while relays[0].ask("status")["relay"]["versions_forwarded"] == forwarded:
                assert time.monotonic() < deadline, "the version never reached r0"
            relays[0].signal(signal.SIGKILL)
            result, _, _, missing = sender.recv(60)
            assert (result, missing) == ("timeout", [0])
            net.wait_for_latest([0, 1, 2, 3], within=60)  # w0 and w1 moved to r1
            start_relay(0)  # restarted: same host, same address, a new process
            assert net.send(timeout=20.0) == ("ok", [])
            net.wait_for_latest([0, 1, 2, 3], within=30)

            # r1's link is cut: the learner names it; once restored, everyone converges.
            topo.link("r1", up=False)
            result, missing = net.send(timeout=3.0)
            # Named; r0 may be late too, as r1's workers move to it and catch up there.
            assert result == "timeout" and 1 in missing
            topo.link("r1", up=True)
            deadline = time.monotonic() + 90
            while net.send(timeout=10.0) != ("ok", []):
                assert time.monotonic() < deadline, "the tree never converged"
            net.wait_for_latest([0, 1, 2, 3], within=60)
            net.check_histories([0, 1, 2, 3])
        finally:
            for proc in relays.values():
                proc.close()
            net.close()
