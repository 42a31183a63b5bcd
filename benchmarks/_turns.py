"""Learners taking turns version by version, each version checked on every worker (the
shape of the wire and tree benchmarks).

Each variant has a learner of its own; the variants send in turn (A B ..., then ... B A),
and after every version each worker process says whether its receiver of that learner
holds exactly what was sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch

from benchmarks._models import MIB
from benchmarks._pool import WorkerPool

#: Every learner's and receiver's ``timeout=``: how long one waits on the other.
PEER_SECONDS: Final = 120
#: How long a check of one version on every worker may take.
CHECK_SECONDS: Final = 120
#: Elements of each small tensor of a :func:`float_model`.
BIAS_ELEMENTS: Final = 256


def float_model(
    mib: int, value: float, *, weights: int, biases: int = 0
) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in ``weights`` equal tensors (and ``biases`` small ones, as a
    real model has), every element ``value``."""
    n = mib * MIB // 4 // weights
    out = {f"layer{i}.weight": torch.full((n,), value) for i in range(weights)}
    out.update({f"layer{i}.bias": torch.full((BIAS_ELEMENTS,), value) for i in range(biases)})
    return out


def take_turns(names: Sequence[str], repeats: int) -> Iterator[tuple[int, str]]:
    """``(round, name)``: every name once a round, in order, then reversed the next round
    (A B B A ...); round 0 warms up, then ``repeats`` rounds count."""
    for rep in range(repeats + 1):
        for name in names if rep % 2 == 0 else names[::-1]:
            yield rep, name


class Receivers:
    """A worker process's receivers, one per learner (PUB/SUB), each into a model of its
    own; answers ``("check", (name, value, digest))``."""

    def __init__(
        self,
        index: int,
        endpoints: Mapping[str, str],
        model: Callable[[], dict[str, torch.Tensor]],
        identity: str,
    ) -> None:
        from zmqsync import WeightReceiver
        from zmqsync.transport.zmq_pubsub import PubSubSpoke

        self.models = {name: model() for name in endpoints}
        self.receivers = {
            name: WeightReceiver(
                PubSubSpoke(endpoint, identity=identity.format(name=name, index=index)),
                model=self.models[name],
                strategy="state_dict",
                worker_idx=index,
                timeout=PEER_SECONDS,
            )
            for name, endpoint in endpoints.items()
        }
        try:
            for r in self.receivers.values():
                r.connect(timeout=PEER_SECONDS)
                r.start()
        except BaseException:
            self.close()
            raise

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {"check": self.check}

    def check(self, name: str, value: float, digest: str = "") -> bool:
        """Whether the receiver of ``name`` holds its learner's version: the model whose
        checksum is ``digest``, or (without one) ``value`` in every element."""
        from zmqsync import checksum

        with self.receivers[name].lock:
            if digest:
                return bool(checksum(self.models[name]) == digest)
            return all(bool((t == value).all()) for t in self.models[name].values())

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()


def check_workers(pool: WorkerPool, name: str, value: float, digest: str = "") -> None:
    """Every worker holds ``name``'s version (see :meth:`Receivers.check`), or this raises."""
    if not all(pool.call(range(pool.size), "check", (name, value, digest), CHECK_SECONDS)):
        raise RuntimeError(f"{name}: a worker does not hold version {value}")
