"""The transports benchmark's variants, each one scheme set up for one cell: zmqsync's
(one class per transport; :data:`ZMQSYNC` gives each its options) and the peers
(torchrl's schemes, Ray's object store, a gloo broadcast, memcpy).

Each opens the learner's end here and one session per worker (in the pool's processes
or the Ray actors), sends on its own :class:`CallRunner` (timed there, with a deadline),
and reads back every worker's digest.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from benchmarks._deadline import CLEANUP_SECONDS, DEADLINE_MARGIN, CallRunner, bounded
from benchmarks._models import SIZES, digest, make_state_dict
from benchmarks._peers import FlatLayout, GlooLearner
from benchmarks._pool import OPEN_MARGIN_SECONDS
from benchmarks._transports_fleet import LearnerModel, PoolSlot, RayFleet, TransportPool
from benchmarks._transports_spec import (
    GLOO,
    MEMCPY,
    RAY_STORE,
    TORCHRL_MP,
    TORCHRL_RAY,
    TORCHRL_SHM,
    ZMQSYNC,
)
from benchmarks._transports_worker import ownership

log = logging.getLogger("benchmarks.transports")


@dataclass
class CellEnv:
    """What a variant needs to open for one cell."""

    size: str
    workers: int
    model: LearnerModel
    pool: TransportPool | None  # None when no variant runs in worker processes
    slot: PoolSlot | None
    fleet: RayFleet | None  # None when no variant runs in Ray actors
    timeout: float
    workdir: str
    tag: str
    zmqsync_options: dict[str, Any]  # every zmqsync scheme's (--no-retain)


class Variant:
    """One scheme set up for one cell; :meth:`send` returns the timed duration."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.runner = CallRunner(name)

    def open(self, env: CellEnv) -> dict[str, Any]:
        raise NotImplementedError

    def _send(self) -> None:
        raise NotImplementedError

    def send(self, timeout: float, before: Callable[[], Any] | None = None) -> float:
        """The duration of one send; ``before()`` runs first on the sending thread,
        untimed (the version's change, as a training step makes it)."""
        return self.runner.call(self._send, timeout + DEADLINE_MARGIN, "send()", before)[1]

    def _close(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            bounded(self._close, CLEANUP_SECONDS, f"{self.name} shutdown")
        except Exception as exc:
            log.warning("%s: closing failed: %s", self.name, exc)
        self.runner.close()

    def digests(self, env: CellEnv) -> list[dict[str, Any]]:
        raise NotImplementedError

    def held_bytes(self) -> dict[str, int]:
        """Memory the learner's side holds for its sends that the meter misses, charged
        to its extra memory: ``"shm"``, shared memory it maps (not malloc'd), and
        ``"buffers"``, buffers allocated once when it opened (before the meter ran)."""
        return {}

    @property
    def broke_workers(self) -> bool:
        """Whether this variant's workers are of no use to later cells (a call hung
        there and never returned: torchrl's waits have no deadline)."""
        return False


def _pool(env: CellEnv) -> tuple[TransportPool, PoolSlot]:
    if env.pool is None or env.slot is None:
        raise RuntimeError("the process variants need the worker pool: it was not started")
    return env.pool, env.slot


def _fleet(env: CellEnv) -> RayFleet:
    if env.fleet is None:
        raise RuntimeError("the Ray variants need Ray: it was not started")
    return env.fleet


class _ProcessVariant(Variant):
    def digests(self, env: CellEnv) -> list[dict[str, Any]]:
        pool, _ = _pool(env)
        return pool.call(range(env.workers), "digest", (self.name,), env.timeout)


class _RayVariant(Variant):
    def digests(self, env: CellEnv) -> list[dict[str, Any]]:
        actors = _fleet(env).actors[: env.workers]
        return _fleet(env).get([a.digest.remote(self.name) for a in actors], "digest")


# --- zmqsync's variants (one class per transport; ZMQSYNC gives each its options) ------


class _ZmqsyncVariant(Variant):
    """A zmqsync scheme: blocking sends, and the blocks it maps. The scheme's model id is
    the variant's name, so two variants never share a channel."""

    scheme: Any

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.spec = ZMQSYNC[name]

    def _scheme_kwargs(self, env: CellEnv) -> dict[str, Any]:
        return {"timeout": env.timeout, **env.zmqsync_options, **self.spec.scheme}

    def _send(self) -> None:
        self.scheme.send()

    def held_bytes(self) -> dict[str, int]:
        shm = int(self.scheme.get_sender().transport.counters().get("shm_bytes", 0))
        return {"shm": shm} if shm else {}

    def _close(self) -> None:
        self.scheme.shutdown()


class PipeVariant(_ZmqsyncVariant, _ProcessVariant):
    def open(self, env: CellEnv) -> dict[str, Any]:
        from zmqsync import MultiProcessWeightSyncScheme

        pool, slot = _pool(env)
        self.scheme = MultiProcessWeightSyncScheme("state_dict", **self._scheme_kwargs(env))
        self.scheme.init_on_sender(
            self.name,
            pipes=slot.pipes[self.name],
            model=env.model.state_dict,
            num_workers=env.workers,
            **self.spec.sender,
        )
        # The scheme pickles into the workers without its pipes; each has its own end.
        options = dict(self.spec.receiver)
        pool.call(
            range(env.workers),
            "open_pipe",
            (slot.name, self.name, self.scheme, env.size, options, env.timeout),
            env.timeout + OPEN_MARGIN_SECONDS,
        )
        self.runner.call(
            lambda: self.scheme.connect(timeout=env.timeout),
            env.timeout + DEADLINE_MARGIN,
            "connect",
        )
        return {}


class ZmqVariant(_ZmqsyncVariant, _ProcessVariant):
    def open(self, env: CellEnv) -> dict[str, Any]:
        from zmqsync import ZMQWeightSyncScheme

        pool, _ = _pool(env)
        self.scheme = ZMQWeightSyncScheme(
            "state_dict",
            mode="pubsub",
            endpoint=f"ipc://{env.workdir}/{env.tag}-{self.name}",
            **self._scheme_kwargs(env),
        )
        self.scheme.init_on_sender(
            self.name, model=env.model.state_dict, num_workers=env.workers, **self.spec.sender
        )
        options = dict(self.spec.receiver)
        pool.call(
            range(env.workers),
            "open_zmq",
            {
                i: (self.name, self.scheme, env.size, i, options, env.timeout)
                for i in range(env.workers)
            },
            env.timeout + OPEN_MARGIN_SECONDS,
        )
        return {}


class ZmqsyncRayVariant(_ZmqsyncVariant, _RayVariant):
    def open(self, env: CellEnv) -> dict[str, Any]:
        from zmqsync import RayWeightSyncScheme

        fleet = _fleet(env)
        actors = fleet.actors[: env.workers]
        self.scheme = RayWeightSyncScheme("state_dict", **self._scheme_kwargs(env))
        options = dict(self.spec.receiver)
        fleet.get(
            [a.open_zmqsync.remote(self.name, self.scheme, env.size, options) for a in actors],
            "open",
        )
        self.scheme.init_on_sender(
            self.name, remote_collectors=actors, model=env.model.state_dict, **self.spec.sender
        )
        self.runner.call(
            lambda: self.scheme.connect(timeout=env.timeout),
            env.timeout + DEADLINE_MARGIN,
            "connect",
        )
        return {}


ZMQSYNC_CLASSES: Final[dict[str, type[_ZmqsyncVariant]]] = {
    "pipe": PipeVariant,
    "zmq": ZmqVariant,
    "ray": ZmqsyncRayVariant,
}


# --- the peers ------------------------------------------------------------------------------


class _TorchrlSends:
    """A torchrl scheme's send and close, given its prebuilt TensorDict each send; a
    hung torchrl call leaves its workers unusable."""

    scheme: Any
    weights: Any
    runner: CallRunner

    def _send(self) -> None:
        self.scheme.send(weights=self.weights)

    def _close(self) -> None:
        self.scheme.shutdown()

    @property
    def broke_workers(self) -> bool:
        return self.runner.hung is not None


class TorchrlProcessVariant(_TorchrlSends, _ProcessVariant):
    """torchrl-mp or torchrl-shm: the cell's scheme was given to the workers at spawn."""

    def open(self, env: CellEnv) -> dict[str, Any]:
        pool, slot = _pool(env)
        self.scheme = slot.torchrl[self.name]
        self.weights = env.model.weights
        # Sender first: it puts the first version (torchrl-mp) or the shared buffers
        # (torchrl-shm) in every worker's queue, moving the learner's tensors to shared
        # memory on the way; each worker then takes it.
        self.runner.call(self.scheme.connect, env.timeout + DEADLINE_MARGIN, "connect")
        facts = pool.call(
            range(env.workers),
            "open_torchrl",
            {i: (slot.name, self.name, env.size, i) for i in range(env.workers)},
            env.timeout + OPEN_MARGIN_SECONDS,
        )
        return {"workers": facts}


class TorchrlRayVariant(_TorchrlSends, _RayVariant):
    def open(self, env: CellEnv) -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchrl.weight_update import RayWeightSyncScheme

        actors = _fleet(env).actors[: env.workers]
        self.weights = env.model.weights
        self.scheme = RayWeightSyncScheme()  # gloo, strategy "tensordict" (its defaults)
        self.scheme.init_on_sender(
            model_id="policy",
            remote_collectors=actors,
            num_workers=env.workers,
            model=env.model.view,
        )
        # As torchrl's RayCollector: register the receivers without synchronizing, then
        # the sender's connect() and the actors' _connect_weights_scheme() meet in the
        # gloo rendezvous, and the first version travels.
        _fleet(env).get([a.open_torchrl.remote(self.scheme, env.size) for a in actors], "open")
        joining = [a._connect_weights_scheme.remote() for a in actors]
        self.runner.call(self.scheme.connect, env.timeout + DEADLINE_MARGIN, "connect")
        _fleet(env).get(joining, "_connect_weights_scheme")
        return {}


class RayStoreVariant(_RayVariant):
    """One ``ray.put`` of the packed model per send, one actor call per worker with its
    ObjectRef; the send ends when every call has returned (the actor has copied)."""

    def open(self, env: CellEnv) -> dict[str, Any]:
        import ray

        self._ray = ray
        self.fleet = _fleet(env)
        self.actors = self.fleet.actors[: env.workers]
        self.layout = FlatLayout(list(env.model.state_dict.values()))
        # A flat buffer: one put of one buffer beat a put of the dict of numpy arrays
        # (see benchmarks/README.md).
        self.flat = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        self.views = self.layout.split(self.flat)
        self.array = self.flat.numpy()
        self.fleet.get([a.open_store.remote(env.size) for a in self.actors], "open")
        return {"put": "flat uint8 buffer"}

    def _send(self) -> None:
        self.layout.pack(self.views)
        ref = self._ray.put(self.array)
        self.fleet.get([a.store_apply.remote(ref) for a in self.actors], "store_apply")

    def _close(self) -> None:
        pass  # the actors drop their session when the cell closes

    def held_bytes(self) -> dict[str, int]:
        return {"buffers": self.layout.nbytes}


class GlooVariant(_ProcessVariant):
    """A gloo group of the learner and the cell's workers (see :mod:`._peers`)."""

    def open(self, env: CellEnv) -> dict[str, Any]:
        pool, _ = _pool(env)
        self.peer = GlooLearner(list(env.model.state_dict.values()), env.workers, env.timeout)
        ranks = range(env.workers)
        args = {
            i: (self.name, env.size, self.peer.port, i + 1, env.workers + 1, env.timeout)
            for i in ranks
        }
        pool.post(ranks, "open_gloo", args)
        try:
            # Every rank joins at once: the workers' replies come once the learner joined.
            self.runner.call(self.peer.join, env.timeout + DEADLINE_MARGIN, "join")
        finally:
            pool.collect(ranks, "open_gloo", env.timeout + OPEN_MARGIN_SECONDS)
        return {"port": self.peer.port}

    def _send(self) -> None:
        self.peer.send()

    def _close(self) -> None:
        self.peer.close()

    def held_bytes(self) -> dict[str, int]:
        return {"buffers": self.peer.flat.numel()}


class MemcpyVariant(Variant):
    """K serial copies of the learner's tensors into K sets of tensors it preallocated:
    ``torch._foreach_copy_`` per set (no slower than copying into one flat buffer, and
    faster than a loop of ``copy_`` over many small tensors)."""

    def open(self, env: CellEnv) -> dict[str, Any]:
        self.source = list(env.model.state_dict.values())
        self.copies = [make_state_dict(SIZES[env.size], fill="zeros") for _ in range(env.workers)]
        self.targets = [list(c.values()) for c in self.copies]
        return {}

    def _send(self) -> None:
        for target in self.targets:
            torch._foreach_copy_(target, self.source)

    def _close(self) -> None:
        self.copies = []
        self.targets = []

    def digests(self, env: CellEnv) -> list[dict[str, Any]]:
        return [{"digest": digest(c), "ownership": ownership(c)} for c in self.copies]


PEER_CLASSES: Final[dict[str, type[Variant]]] = {
    TORCHRL_MP: TorchrlProcessVariant,
    TORCHRL_SHM: TorchrlProcessVariant,
    TORCHRL_RAY: TorchrlRayVariant,
    RAY_STORE: RayStoreVariant,
    GLOO: GlooVariant,
    MEMCPY: MemcpyVariant,
}


def make_variant(name: str) -> Variant:
    if name in ZMQSYNC:
        return ZMQSYNC_CLASSES[ZMQSYNC[name].transport](name)
    return PEER_CLASSES[name](name)
