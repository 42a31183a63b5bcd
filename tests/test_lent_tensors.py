"""Lent tensors end to end: real pipe workers move their tensors into memory they lend
the learner's hub, and the learner writes each version straight into them (one copy
per worker); every applied version's checksum is the learner's, versions never go back,
and a worker that does not lend is streamed to as before, in the same send."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
from _workers import bump, make_model

import zmqsync
from zmqsync import WeightSender
from zmqsync.transport.pipe import PipeHub
from zmqsync.transport.shm.blocks import SHM_AVAILABLE

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not SHM_AVAILABLE, reason="memfd is Linux's"),
]

WAIT_S = 60.0


def _ask(control: Any) -> tuple[list[tuple[int, str, Any]], dict[str, Any], bool]:
    control.send("report")
    assert control.poll(WAIT_S), "the worker did not answer"
    what, applied, stats, same = control.recv()
    assert what == "ok", applied
    return applied, stats, same


@pytest.fixture
def fleet():
    from _lent_workers import run_lending_worker

    ctx = mp.get_context("spawn")
    made: dict[str, Any] = {}

    def start(lends: list[bool]) -> tuple[WeightSender, list[Any]]:
        pipes = [ctx.Pipe() for _ in lends]
        controls = [ctx.Pipe() for _ in lends]
        model = make_model("wide", seed=1)
        sender = WeightSender(
            PipeHub([p for p, _ in pipes]),
            model=model,
            strategy="state_dict",
            num_workers=len(lends),
            timeout=30,
            lend_tensors=True,
        )
        procs = []
        for i, lend in enumerate(lends):
            proc = ctx.Process(
                target=run_lending_worker,
                args=(pipes[i][1], controls[i][1], i, lend),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        made.update(sender=sender, procs=procs, controls=[c for c, _ in controls])
        return sender, made["controls"]

    yield start
    for control in made.get("controls", []):
        try:
            control.send("stop")
        except OSError:
            pass
    for proc in made.get("procs", []):
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if "sender" in made:
        made["sender"].close()


def test_versions_are_written_into_the_workers_lent_tensors(fleet) -> None:
    sender, controls = fleet([True, True, False])
    model = sender.model
    sent: dict[int, str] = {}
    for step in range(1, 7):
        bump(model)
        sender.send(metadata={"step": step})
        sent[sender.fleet.version] = zmqsync.checksum(model, "state_dict")
    for i, control in enumerate(controls):
        applied, stats, same = _ask(control)
        versions = [v for v, _, _ in applied]
        assert versions == sorted(versions) and versions[-1] == max(sent), versions
        for version, digest, metadata in applied:
            if version in sent:  # every version it applied is the one the learner sent
                assert digest == sent[version], (i, version)
                assert metadata == {"step": version}, (i, version, metadata)
        assert same  # the model's parameters are the objects they were
        if i < 2:
            # The first version came as a stream (the tensors are laid out after it);
            # from then on, each was written into the lent tensors.
            assert stats["lent_applied"] >= 4, stats
        else:
            assert stats.get("lent_applied", 0) == 0, stats
    totals = sender.status()["totals"]  # the hub's counters among them
    assert totals["lent_peers"] == 2 and totals["lent_writes"] >= 8, totals
