"""``apply_mode="shared"`` under real torchrl collectors: each worker's policy is
read-only views of the learner's one copy of a version, and every frame it collects
came from the weights of the version it is tagged with (what PPO's importance ratio
needs: a frame's stored logits are those of its ``policy_version``).

Real ``MultiSyncCollector`` / ``MultiAsyncCollector`` runs with spawned workers, over
pipes and ZeroMQ ``ipc://``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import Composite, Unbounded
from torchrl.envs import EnvBase

import zmqsync.torchrl

NUM_WORKERS = 2
FRAMES_PER_BATCH = 16  # over both workers
EPISODE_STEPS = 4
HIDDEN = 256  # a 256 x 256 layer: its frames are large enough to travel in shared memory
LOGITS = 4
UPDATES = 3


class WalkEnv(EnvBase):
    """A 2-d observation that changes every step, whatever the action (so a frame's
    logits are a known function of the policy's weights alone); 4-step episodes.
    ``worker`` (not seen by the policy) tells which collector worker produced a frame."""

    def __init__(self, worker: int = 0) -> None:
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(
            observation=Unbounded(shape=(2,)),
            worker=Unbounded(shape=(1,), dtype=torch.int64),
            shape=(),
        )
        self.worker = worker
        self.action_spec = Unbounded(shape=(LOGITS,))
        self.reward_spec = Unbounded(shape=(1,))
        self._t = 0

    def _td(self, **more: torch.Tensor) -> TensorDictBase:
        done = torch.tensor([self._t >= EPISODE_STEPS])
        obs = torch.tensor([float(self._t), float(self.worker) - self._t / EPISODE_STEPS])
        return TensorDict(
            {
                "observation": obs,
                "worker": torch.tensor([self.worker]),
                "done": done,
                "terminated": done.clone(),
                **more,
            },
            batch_size=[],
        )

    def _reset(self, tensordict: TensorDictBase | None, **kwargs: Any) -> TensorDictBase:
        self._t = 0
        return self._td()

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._t += 1
        return self._td(reward=tensordict["action"].detach()[..., :1].clone())

    def _set_seed(self, seed: int | None) -> None:
        return None


def make_env(worker: int = 0) -> EnvBase:
    """Env factory (module level: spawned workers import it by name)."""
    return WalkEnv(worker)


def _mapping_of(tensor: torch.Tensor) -> tuple[int, bool]:
    """(inode, writable) of the mapping ``tensor``'s first byte lies in, in this
    process: a shared-memory block's inode is the same in every process that maps it."""
    address = tensor.data_ptr()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return int(fields[4]), "w" in fields[1]
    return 0, True


class Actor(nn.Module):
    """An MLP's logits, taken as the action as they are; also, per frame, where the
    weights that computed them live (``weights_inode``: the block's inode, 0 for private
    memory or a writable mapping)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(2, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh()
        )
        self.head = nn.Linear(HIDDEN, LOGITS)

    def logits(self, observation: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(observation))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(observation)
        inode, writable = _mapping_of(self.mlp[2].weight)
        where = torch.full((*observation.shape[:-1], 1), 0 if writable else inode)
        return logits, where


def make_policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(Actor(), in_keys=["observation"], out_keys=["action", "weights_inode"])


def _bump(policy: TensorDictModule, step: int) -> None:
    """The learner trains: every weight changes."""
    torch.manual_seed(1000 + step)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))


def _reference(policy: TensorDictModule) -> Actor:
    """A private copy of the policy's weights now: what its version computes."""
    actor = type(policy.module)()  # an Actor, or one of the tests' kinds of it
    actor.load_state_dict({k: v.clone() for k, v in policy.module.state_dict().items()})
    return actor.eval()


def make_scheme(transport: str, tmp_path: Any) -> Any:
    if transport == "pipe":
        return zmqsync.torchrl.MultiProcessWeightSyncScheme(timeout=30, apply_mode="shared")
    return zmqsync.torchrl.ZMQWeightSyncScheme(
        mode="pubsub", endpoint=f"ipc://{tmp_path}/trl", timeout=30, apply_mode="shared"
    )


def _frames(batch: TensorDictBase) -> list[TensorDictBase]:
    return list(batch.reshape(-1).unbind(0))


def check_tagged_logits(
    frames: list[TensorDictBase], references: list[Actor], *, exact: bool
) -> dict[int, set[int]]:
    """Every frame's logits are those of the version it is tagged with: ``exact``, its
    ``("next", "policy_version")``; else (workers collect while a version lands) that
    tag or the one before it (its root ``policy_version``), as torchrl documents.

    Returns, per version, the inodes of the blocks the frames' weights lay in."""
    inodes: dict[int, set[int]] = {}
    with torch.no_grad():
        for frame in frames:
            tag = int(frame["next", "policy_version"])
            tags = [tag] if exact else sorted({int(frame["policy_version"]), tag})
            produced = [
                v
                for v in tags
                if torch.allclose(
                    frame["action"], references[v].logits(frame["observation"]), atol=1e-6
                )
            ]
            assert produced, f"a frame tagged {tags} has logits of none of those versions"
            inodes.setdefault(produced[-1], set()).add(int(frame["weights_inode"]))
    return inodes


def _collect(collector: Any, policy: TensorDictModule) -> tuple[list[TensorDictBase], list[Actor]]:
    """A batch, then ``UPDATES`` updates each followed by batches until every worker has
    collected frames (root and next tag) wholly from it. Returns the frames and each
    version's reference weights."""
    references = [_reference(policy)]
    batches = iter(collector)
    frames = _frames(next(batches))
    for step in range(UPDATES):
        _bump(policy, step)
        references.append(_reference(policy))
        collector.update_policy_weights_()
        latest: set[int] = set()
        for _ in range(20):
            batch = _frames(next(batches))
            frames += batch
            # A frame whose step straddled the update is tagged with the new version but
            # may hold the old one's logits: wait for frames wholly of the new version.
            latest |= {
                int(f["worker"])
                for f in batch
                if int(f["policy_version"]) == int(f["next", "policy_version"]) == step + 1
            }
            if len(latest) == NUM_WORKERS:
                break
        assert len(latest) == NUM_WORKERS, f"not every worker took update {step + 1}"
    return frames, references


def _collect_then_shut(
    collector: Any, scheme: Any, policy: TensorDictModule
) -> tuple[list[TensorDictBase], list[Actor]]:
    """:func:`_collect`, then the collector and the scheme shut down, whatever happened."""
    try:
        return _collect(collector, policy)
    finally:
        try:
            collector.shutdown()
        finally:
            scheme.shutdown()


def _check_shared(inodes: dict[int, set[int]]) -> None:
    """After the first update (version 0 may come before a worker joined the lending),
    every frame's weights lay in a read-only shared block, one block per version for
    every worker (the same inode in each process: one copy)."""
    for version in range(1, UPDATES + 1):
        seen = inodes.get(version, set())
        assert seen and 0 not in seen, f"version {version}'s frames: weights in {seen}"
        assert len(seen) == 1, f"version {version} lay in {len(seen)} blocks: {seen}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["pipe", "zmq-ipc"])
def test_multisync_frames_have_the_logits_of_their_version_from_shared_weights(
    transport: str, tmp_path: Any
) -> None:
    policy = make_policy()
    scheme = make_scheme(transport, tmp_path)
    collector = MultiSyncCollector(
        [make_env] * NUM_WORKERS,
        policy,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=-1,
        cat_results="stack",
        create_env_kwargs=[{"worker": i} for i in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    frames, references = _collect_then_shut(collector, scheme, policy)
    # Workers are idle while an update lands: every frame's tag is exactly its version.
    _check_shared(check_tagged_logits(frames, references, exact=True))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["pipe", "zmq-ipc"])
def test_multiasync_frames_have_the_logits_of_their_version_from_shared_weights(
    transport: str, tmp_path: Any
) -> None:
    policy = make_policy()
    scheme = make_scheme(transport, tmp_path)
    collector = MultiAsyncCollector(
        [make_env] * NUM_WORKERS,
        policy,
        frames_per_batch=FRAMES_PER_BATCH // NUM_WORKERS,
        total_frames=-1,
        create_env_kwargs=[{"worker": i} for i in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    frames, references = _collect_then_shut(collector, scheme, policy)
    # Versions land while workers collect (the background thread re-points the weights
    # under the lock every forward pass holds): no frame mixes two versions.
    _check_shared(check_tagged_logits(frames, references, exact=False))


@pytest.mark.timeout(60)
def test_the_schemes_refuse_an_unknown_apply_mode_when_built() -> None:
    for scheme in (
        zmqsync.torchrl.MultiProcessWeightSyncScheme,
        zmqsync.torchrl.ZMQWeightSyncScheme,
    ):
        with pytest.raises(ValueError, match="apply_mode"):
            scheme(apply_mode="mapped")
