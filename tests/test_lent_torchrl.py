"""Lent tensors under a real torchrl collector: the learner's scheme carries the choice
(``lend_tensors=True``, or the default for a policy of 4 MiB and more) into every spawned
worker, each worker lends the memory its policy's tensors live in, the learner writes
each update into it, and every frame's logits are those of the version it is tagged
with (PPO's importance ratio needs nothing less). Over pipes and ZeroMQ ``ipc://``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _lent_workers import in_lent_memory
from tensordict.nn import TensorDictModule
from test_shared_torchrl import (
    NUM_WORKERS,
    UPDATES,
    Actor,
    _collect_then_shut,
    check_tagged_logits,
    make_env,
)
from torchrl.collectors import MultiSyncCollector

import zmqsync.torchrl
from zmqsync.transport.shm.blocks import SHM_AVAILABLE
from zmqsync.transport.shm.lent import LENT_MIN_BYTES

pytestmark = pytest.mark.skipif(not SHM_AVAILABLE, reason="memfd is Linux's")


class LendingActor(Actor):
    """:class:`Actor`, saying per frame (``weights_inode``) whether the weights that
    computed it lie in the worker's lent memory (1) or elsewhere (0)."""

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(observation)
        lent = all(in_lent_memory(p) for p in self.parameters())
        return logits, torch.full((*observation.shape[:-1], 1), int(lent))


class BigLendingActor(LendingActor):
    """:class:`LendingActor` with a table of 4 MiB besides (unused by its logits, updated
    with the rest): a policy the default lends."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(LENT_MIN_BYTES // 4 + 1024))


def make_policy(big: bool = False) -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(
        BigLendingActor() if big else LendingActor(),
        in_keys=["observation"],
        out_keys=["action", "weights_inode"],
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "transport, lend", [("pipe", True), ("zmq-ipc", True), ("pipe", None)], ids=str
)
def test_multisync_writes_each_update_into_the_workers_lent_policies(
    transport: str, lend: bool | None, monkeypatch, tmp_path
) -> None:
    from zmqsync.sender import core

    # Every go must count, even from a worker slowed down by a loaded machine.
    monkeypatch.setattr(core, "LENT_GO_WAIT", 20.0)
    options: dict[str, Any] = {"timeout": 30}
    if lend:
        # The policy is 270 KB, which streams by default: lend it all the same.
        monkeypatch.setattr(core, "LENT_MIN_BYTES", 0)
        options["lend_tensors"] = True
    policy = make_policy(big=lend is None)  # the default lends from 4 MiB up
    if transport == "pipe":
        scheme: Any = zmqsync.torchrl.MultiProcessWeightSyncScheme(**options)
    else:
        scheme = zmqsync.torchrl.ZMQWeightSyncScheme(endpoint=f"ipc://{tmp_path}/trl", **options)
    collector = MultiSyncCollector(
        [make_env] * NUM_WORKERS,
        policy,
        frames_per_batch=16,
        total_frames=-1,
        cat_results="stack",
        create_env_kwargs=[{"worker": i} for i in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    writes: list[int] = []
    real_send = scheme.send

    def send(*args: Any, **kwargs: Any) -> Any:
        out = real_send(*args, **kwargs)
        writes.append(scheme.zmqsync_scheme.get_sender().status()["totals"]["lent_writes"])
        return out

    monkeypatch.setattr(scheme, "send", send)
    frames, references = _collect_then_shut(collector, scheme, policy)
    # Workers are idle while an update lands: every frame's tag is exactly its version.
    where = check_tagged_logits(frames, references, exact=True)
    # Version 0 came as a stream (the workers lend once a whole version is in); every
    # update after it was written into both workers' lent tensors, where their frames'
    # weights lay.
    for version in range(1, UPDATES + 1):
        assert where.get(version) == {1}, (version, where)
    assert writes and writes[-1] == NUM_WORKERS * UPDATES, writes
