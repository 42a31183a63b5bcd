"""A sender's status as records: ``as_dict()`` is ``status()`` key for key, and
``from_dict()`` reads it back from another process without trusting it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from zmqsync import FrameError, SenderStatus, WeightSender, WorkerStatus
from zmqsync.protocol import MAX_BELOW
from zmqsync.status_types import (
    MAX_ITEMS,
    STATUS_ROWS,
    UNCONNECTED_KEYS,
    RelayCounts,
    Totals,
    UpstreamStatus,
)
from zmqsync.tools.status import assess
from zmqsync.transport.zmq_pubsub import PubSubHub


def _row(worker: int = 0, **fields: Any) -> dict[str, Any]:
    """A connected worker's row, every key as a sender sends it."""
    return {
        "worker": worker,
        "connected": True,
        "live": True,
        "left": False,
        "since_left_s": None,
        "expected": True,
        "transport": "zmq",
        "host": "box",
        "pid": 42,
        "version": 3,
        "lag": 0,
        "since_last_ack_s": 0.5,
        "since_last_seen_s": 0.25,
        "last_latency_s": 0.01,
        "received_bytes": 1 << 20,
        "rejected_frames": 1,
        "rejections": ["bad checksum"],
        "torn": False,
        "repairing": False,
        "below": {"10": 3, "11": 2},
        "below_total": 2,
        **fields,
    }


def _relay_status() -> dict[str, Any]:
    """A relay's status as ``Relay.status()`` lays it out, order included."""
    return {
        "model_id": "policy",
        "version": 3,
        "epoch": 7,
        "mode": "pubsub",
        "endpoint": "tcp://127.0.0.1:5555",
        "strategy": "state_dict",
        "num_workers": 2,
        "metadata": {"step": 10, "tags": ["a", {"b": None}]},
        "wire_dtype": "bfloat16",
        "delta": {"version": 3, "bases": [{"base": 2, "workers": 1, "bytes": 64}]},
        "share_params": "on",
        "uptime_s": 12.5,
        "host": "box",
        "pid": 7,
        "workers_total": 2,
        "workers_live": 1,
        "workers_shown": 2,
        "workers": [
            _row(0),
            {
                "worker": 1,
                "connected": False,
                "live": False,
                "left": False,
                "expected": True,
                "version": 0,
                "lag": 3,
            },
        ],
        "totals": {
            **Totals().as_dict(),  # every count a sender keeps, in its order
            "versions_sent": 1,
            "timeouts": 2,
            "latency_p50_s": 0.01,
            "latency_p90_s": 0.02,
            "latency_p99_s": None,
            "latency_histogram": {"le": [0.01, 0.1], "counts": [1, 2, 0], "sum_s": 0.2},
            "rejections": ["worker 1: bad checksum"],
            "dropped_sends": 4,
            "shm_bytes": 1 << 30,
        },
        "upstream": {
            "worker": 0,
            "version": 3,
            "epoch": 7,
            "ack_owed": False,
            "received_bytes": 5,
            "last_apply_s": 0.5,
        },
        "relay": {"versions_forwarded": 3, "chunks_forwarded": 9, "aborted": 0, "refetches": 1},
    }


def test_a_senders_status_is_its_report_as_a_dict_and_reads_back_key_for_key() -> None:
    sender = WeightSender(
        PubSubHub("tcp://127.0.0.1:*", insecure=True),
        model={"w": torch.zeros(16)},
        strategy="state_dict",
        num_workers=2,
        timeout=5,
    )
    try:
        report = sender.report()
        status = sender.status()
    finally:
        sender.close()
    assert isinstance(report, SenderStatus) and report.workers[0] == WorkerStatus(0, expected=True)
    assert [list(row) for row in status["workers"]] == [list(UNCONNECTED_KEYS)] * 2
    assert "upstream" not in status and "relay" not in status
    again = SenderStatus.from_dict(json.loads(json.dumps(status)))
    assert json.dumps(again.as_dict()) == json.dumps(status)  # the same keys, in order
    assert again.totals.versions_sent == 0 and again.totals.transport  # its hub's counters


def test_a_relays_status_reads_back_key_for_key_with_its_upstream() -> None:
    doc = _relay_status()
    status = SenderStatus.from_dict(doc)
    assert json.dumps(status.as_dict()) == json.dumps(doc)
    assert status.workers[0].below == {"10": 3, "11": 2}
    assert not status.workers[1].connected and status.workers[1].lag == 3
    assert status.totals.timeouts == 2 and status.totals.versions_sent == 1
    assert status.totals.transport == {"dropped_sends": 4, "shm_bytes": 1 << 30}
    assert status.totals.latency_histogram is not None
    assert status.totals.latency_histogram.counts == [1, 2, 0]
    assert status.upstream == UpstreamStatus(
        worker=0, version=3, epoch=7, receiver={"received_bytes": 5, "last_apply_s": 0.5}
    )
    assert status.relay == RelayCounts(versions_forwarded=3, chunks_forwarded=9, refetches=1)
    assert status.metadata == {"step": 10, "tags": ["a", {"b": None}]}


def test_unknown_keys_are_ignored_and_missing_ones_take_their_defaults() -> None:
    status = SenderStatus.from_dict(
        {
            "version": 2,
            "from_the_future": {"x": [1, 2]},
            "workers": [{"worker": 4, "connected": True, "mood": "fine"}],
            "totals": {"not_a_count": "x", "ratio": 0.5},
        }
    )
    assert status.model_id == "" and status.epoch == 0 and status.upstream is None
    assert status.workers[0].version == 0 and status.workers[0].rejections == []
    assert status.totals == Totals()  # only integer counts are a transport's
    assert "from_the_future" not in status.as_dict()
    assert assess(status) == {4: "worker 4 holds version 0 of 2 (2 behind)"}
    assert assess(status.as_dict()) == assess(status)  # a dict is read as the record


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ([], "it must be an object; got list"),
        ({"version": "3"}, "version must be an integer; got str"),
        ({"version": True}, "version must be an integer; got bool"),
        ({"version": 3.0}, "version must be an integer; got float"),
        ({"uptime_s": math.nan}, "uptime_s must be a finite number"),
        ({"uptime_s": math.inf}, "uptime_s must be a finite number"),
        ({"model_id": None}, "model_id must be a string; got null"),
        ({"workers": {"0": {}}}, "workers must be a list; got dict"),
        ({"workers": [7]}, "workers[0] must be an object; got int"),
        ({"workers": [{"version": 1}]}, "workers[0] has no 'worker'"),
        ({"workers": [_row(lag="1")]}, "workers[0].lag must be an integer"),
        ({"workers": [_row(rejections="no")]}, "workers[0].rejections must be a list"),
        ({"workers": [_row(rejections=[1])]}, "workers[0].rejections[0] must be a string"),
        ({"workers": [_row(below={"x": 1})]}, "workers[0] is refused: the workers behind a relay"),
        ({"workers": [_row(below={"1": "2"})]}, "workers[0].below['1'] must be an integer"),
        ({"workers": [_row(below={1: 2})]}, "workers[0].below has a key that is not a string"),
        ({"totals": []}, "totals must be an object"),
        ({"totals": {"timeouts": -0.5}}, "totals.timeouts must be an integer"),
        (
            {"totals": {"latency_histogram": {"le": [0.1]}}},
            "totals.latency_histogram is refused: 1 buckets",
        ),
        ({"upstream": {"ack_owed": 1}}, "upstream.ack_owed must be a boolean; got int"),
        ({"metadata": ["x"]}, "metadata must be an object; got list"),
    ],
)
def test_a_malformed_status_is_refused_saying_where(doc: Any, where: str) -> None:
    with pytest.raises(FrameError) as caught:
        SenderStatus.from_dict(doc)
    assert str(caught.value).startswith(f"malformed status: {where}")


@pytest.mark.parametrize(
    "doc",
    [
        {"workers": [{"worker": w} for w in range(STATUS_ROWS + 1)]},
        {"workers": [_row(below={str(w): 1 for w in range(MAX_BELOW + 1)})]},
        {"workers": [_row(rejections=["no"] * (MAX_ITEMS + 1))]},
        {"totals": {"rejections": ["no"] * (MAX_ITEMS + 1)}},
        {"totals": {f"counter{i}": 1 for i in range(MAX_ITEMS + 1)}},
        {"upstream": {f"counter{i}": 1.5 for i in range(MAX_ITEMS + 1)}},
    ],
    ids=["rows", "below", "row-rejections", "rejections", "counters", "upstream-counters"],
)
def test_a_status_longer_than_a_sender_sends_is_refused(doc: dict[str, Any]) -> None:
    with pytest.raises(FrameError, match="items; at most"):
        SenderStatus.from_dict(doc)


def test_as_dict_copies_what_it_holds() -> None:
    status = SenderStatus.from_dict(_relay_status())
    out = status.as_dict()
    out["metadata"]["step"] = 0
    out["workers"][0]["below"]["10"] = 0
    assert status.metadata == {"step": 10, "tags": ["a", {"b": None}]}
    assert status.workers[0].below == {"10": 3, "11": 2}


@pytest.mark.timeout(30)
def test_a_ranks_status_names_its_rank_the_ranks_and_the_parts_waited_for() -> None:
    doc = {
        "version": 3,
        "rank": 1,
        "ranks": ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"],
        "waiting_ranks": {"0": [2, 5]},
    }
    status = SenderStatus.from_dict(doc)
    assert status.rank == 1 and status.ranks == doc["ranks"]
    assert status.waiting_ranks == {"0": [2, 5]}
    assert json.loads(json.dumps(status.as_dict()))["waiting_ranks"] == {"0": [2, 5]}
    plain = SenderStatus.from_dict({"version": 3}).as_dict()  # an unsharded sender's
    assert not {"rank", "ranks", "waiting_ranks"} & set(plain)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({"rank": 2, "ranks": ["tcp://a:1", "tcp://b:1"]}, "it is refused: rank 2 is not one"),
        ({"rank": -1}, "it is refused: rank -1"),
        ({"rank": "0"}, "rank must be an integer"),
        ({"ranks": "tcp://a:1"}, "ranks must be a list"),
        ({"ranks": ["tcp://a:1"] * 1025}, "ranks has 1025 items"),
        ({"ranks": [1]}, "ranks[0] must be a string"),
        ({"waiting_ranks": {"x": [1]}}, "it is refused: the ranks waited for"),
        ({"waiting_ranks": {"1": ["0"]}}, "waiting_ranks['1'][0] must be an integer"),
        ({"waiting_ranks": {"1": list(range(MAX_ITEMS + 1))}}, "waiting_ranks['1'] has"),
    ],
)
def test_a_malformed_rank_status_is_refused_saying_where(doc: Any, where: str) -> None:
    with pytest.raises(FrameError) as caught:
        SenderStatus.from_dict(doc)
    assert str(caught.value).startswith(f"malformed status: {where}"), caught.value


@pytest.mark.timeout(30)
def test_a_ranks_sender_reports_its_rank_and_refuses_ranks_that_do_not_fit() -> None:
    from zmqsync.tensors.dtensor import LocalPart
    from zmqsync.transport.memory import MemoryHub

    names = ["memory://status-rank-0", "memory://status-rank-1"]
    sender = WeightSender(
        MemoryHub(names[1]), strategy="state_dict", part=LocalPart(1, 2), ranks=names
    )
    try:
        report = sender.report()
    finally:
        sender.close()
    assert (report.rank, report.ranks, report.waiting_ranks) == (1, names, {})
    hub = MemoryHub()
    try:
        with pytest.raises(ValueError, match="part 1 of 3 needs 3 ranks' endpoints; got 2"):
            WeightSender(hub, strategy="state_dict", part=LocalPart(1, 3), ranks=names)
    finally:
        hub.close()
