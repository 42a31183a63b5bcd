"""zmqsync's transports against torchrl's schemes and other peers (issue 3).

For each cell (model size x K workers), the wall time of ``send()``, from its start to
its return, when every targeted worker has copied the new version into tensors of its
own, for these variants run side by side:

- zmqsync's, one per entry of :data:`ZMQSYNC` (name -> transport and scheme options):
  ``zmqsync-pipe``: ``zmqsync.MultiProcessWeightSyncScheme("state_dict")``, one
  ``multiprocessing.Pipe()`` per worker process; ``zmqsync-ray``:
  ``zmqsync.RayWeightSyncScheme("state_dict")`` with Ray actors; ``zmqsync-zmq``:
  ``zmqsync.ZMQWeightSyncScheme("state_dict")``, PUB/SUB over ipc, in the worker
  processes (zmqsync's ZeroMQ transport, for reference);
- ``torchrl-mp``: ``torchrl.weight_update.MultiProcessWeightSyncScheme``, driven as its
  collectors drive it, in the same worker processes (``mp.Queue``s; torch moves the
  learner's tensors to shared memory; each worker copies them into its own tensors);
- ``torchrl-shm``: ``torchrl.weight_update.SharedMemWeightSyncScheme`` (the default of
  torchrl's multiprocess collectors), the same way: the learner updates the shared
  buffers, each worker's torchrl thread copies them into its own tensors and acks;
- ``torchrl-ray``: ``torchrl.weight_update.RayWeightSyncScheme`` (Ray calls to signal,
  torch.distributed gloo for the tensors), in the same actors;
- ``ray-store``: one ``ray.put`` of a flat buffer per version, one call per actor with
  its ObjectRef; each actor copies the zero-copy view into its own tensors;
- ``gloo-flat``: a ``torch.distributed`` gloo broadcast of one flat buffer to the worker
  processes, each copying it into its own tensors and telling the learner
  (:mod:`._peers`);
- ``memcpy``: the physical bound, K serial copies of the model in the learner.

A cell runs the variants A B C ..., then ... C B A, half the repeats each, so drift on a
shared machine hits them alike. Every send, torchrl's included, runs on a helper thread
with a deadline (torchrl's own waits have none), so a scheme that hangs is recorded as a
failure and the run goes on.

Run ``python -m benchmarks.transports --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import queue
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from benchmarks._harness import (
    SIZES,
    WORKER_START_SECONDS,
    PeakMemoryMeter,
    WorkerPool,
    digest,
    machine_info,
    make_state_dict,
)
from benchmarks._peers import FlatLayout, GlooLearner
from benchmarks._transports_worker import (
    GLOO,
    MEMCPY,
    PIPE,
    RAY_STORE,
    TORCHRL_MP,
    TORCHRL_RAY,
    TORCHRL_SHM,
    ZMQ,
    ZMQSYNC_RAY,
    Slot,
    module_view,
    ownership,
    worker_main,
)
from benchmarks.sync_latency import _csv, _raise_exit, _workdir


@dataclass(frozen=True)
class ZmqsyncSpec:
    """One zmqsync variant: its transport and the options its scheme is set up with.

    ``scheme`` goes to the scheme's constructor (``MultiProcessWeightSyncScheme(
    "state_dict", timeout=..., **scheme)``; ``--no-retain`` adds
    ``retain_snapshot=False``), ``sender`` to the learner's ``init_on_sender``,
    ``receiver`` to each worker's ``init_on_worker``/``init_on_receiver``. ``replaces``
    names the torchrl scheme it is compared with pairwise (a column of its own).
    """

    transport: Literal["pipe", "ray", "zmq"]
    replaces: str | None = None
    scheme: Mapping[str, Any] = field(default_factory=dict)
    sender: Mapping[str, Any] = field(default_factory=dict)
    receiver: Mapping[str, Any] = field(default_factory=dict)


#: ``zmqsync-pipe`` with ``share_params=True``: workers copy from the learner's tensors.
PIPE_SHARE: Final = "zmqsync-pipe-share"
#: zmqsync's variants, in the order a cell runs them. Another is one entry, e.g.
#: ``"zmqsync-pipe-share": ZmqsyncSpec("pipe", TORCHRL_MP, scheme={"share_params": True})``.
ZMQSYNC: Final[dict[str, ZmqsyncSpec]] = {
    PIPE: ZmqsyncSpec("pipe", replaces=TORCHRL_MP),
    PIPE_SHARE: ZmqsyncSpec("pipe", replaces=TORCHRL_MP, scheme={"share_params": True}),
    ZMQSYNC_RAY: ZmqsyncSpec("ray", replaces=TORCHRL_RAY),
    ZMQ: ZmqsyncSpec("zmq"),
}
#: The other variants, in the order a cell runs them after zmqsync's.
PEERS: Final = (TORCHRL_MP, TORCHRL_SHM, TORCHRL_RAY, RAY_STORE, GLOO, MEMCPY)
#: Every variant, in the order a cell runs them (then the reverse).
VARIANTS: Final = (*ZMQSYNC, *PEERS)
#: Variants that move the learner's tensors (``share_params``): the peers alias those
#: tensors (torchrl's schemes read them through a module and a TensorDict over the same
#: storage), so these run only without peers, in a run of their own.
MOVES_TENSORS: Final = frozenset({PIPE_SHARE})
#: What runs by default: every variant but those.
DEFAULT_VARIANTS: Final = tuple(v for v in VARIANTS if v not in MOVES_TENSORS)
#: The peers a zmqsync variant must beat: the fastest of these in a cell is its "best
#: peer" (memcpy is the bound, not a peer).
BEST_PEER_FROM: Final = (TORCHRL_MP, TORCHRL_SHM, TORCHRL_RAY, RAY_STORE, GLOO)
#: Each zmqsync variant and the torchrl scheme it replaces.
PAIRS: Final = tuple((name, spec.replaces) for name, spec in ZMQSYNC.items() if spec.replaces)
#: Where each variant's workers live: "pool" (the worker processes), "ray" (the actors),
#: or "learner" (none: memcpy).
WHERE: Final[dict[str, str]] = {
    **{name: "ray" if spec.transport == "ray" else "pool" for name, spec in ZMQSYNC.items()},
    TORCHRL_MP: "pool",
    TORCHRL_SHM: "pool",
    GLOO: "pool",
    TORCHRL_RAY: "ray",
    RAY_STORE: "ray",
    MEMCPY: "learner",
}
#: The issue's targets: zmqsync at or below torchrl everywhere (ratio <= 1)...
RATIO_TARGET: Final = 1.0
#: ...and at least this many times faster on the model of many small tensors...
SPEEDUP_TARGET: Final = 10.0
SMALL_TENSORS: Final = "2000x4KB"
#: ...at or below this fraction of the best peer's time in every cell...
BEST_PEER_TARGET: Final = 0.9
#: ...and at most this many times memcpy's time in this cell (size, K).
MEMCPY_TARGET: Final = 1.3
MEMCPY_CELL: Final = ("128MB", 1)
#: Timed sends per variant and cell, by size (``--repeats`` sets them all; 128MB and
#: 2000x4KB then get a fifth, at least 2: torchrl takes seconds per send there).
DEFAULT_REPEATS: Final[dict[str, int]] = {"1MB": 30, "16MB": 16, "128MB": 6, "2000x4KB": 6}
DEFAULT_WARMUP: Final = 1
QUICK_SIZES: Final = ("1MB", "2000x4KB")
QUICK_WORKERS: Final = (1, 2)
QUICK_REPEATS: Final = 2
#: Logical CPUs Ray is told about (the machine has 2 cores; actors ask for none).
RAY_CPUS: Final = 2
#: Longest wait for a hung call's cleanup (a scheme's shutdown, an actor's close).
CLEANUP_SECONDS: Final = 10.0
#: A call is given up on this long after ``--timeout``: zmqsync's own timeout errors
#: (which name the missing workers) then arrive first.
DEADLINE_MARGIN: Final = 5.0

log = logging.getLogger("benchmarks.transports")


# --- calls with a deadline --------------------------------------------------------------


class Hung(TimeoutError):
    """A call did not return within its deadline (it is left running on its thread)."""


class CallRunner:
    """Runs calls one at a time on a thread of its own; the caller waits with a deadline.

    torchrl's schemes wait without deadlines (``queue.get()``, ``ray.get()``), so the only
    way to give their ``send()`` one is to wait for it from another thread. zmqsync's
    sends go through the same runner, so both pay the same (untimed) handoff; the time
    recorded is taken on the runner's thread, around the call itself.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.hung: str | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"bench-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done, box = job
            start = time.perf_counter()
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            box["elapsed"] = time.perf_counter() - start
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float, what: str) -> tuple[Any, float]:
        """``fn()``'s value and its duration; raises what it raised, or :class:`Hung`."""
        if self.hung is not None:
            raise Hung(f"{self.name}: an earlier call never returned ({self.hung})")
        done = threading.Event()
        box: dict[str, Any] = {}
        self._jobs.put((fn, done, box))
        if not done.wait(timeout):
            self.hung = f"{what} did not return within {timeout:g}s"
            raise Hung(f"{self.name}: {self.hung}")
        if "error" in box:
            raise box["error"]
        return box.get("value"), box["elapsed"]

    def close(self) -> None:
        if self.hung is None:
            self._jobs.put(None)


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """``fn()`` on a throwaway thread, waited for at most ``timeout`` seconds."""
    runner = CallRunner(what)
    try:
        return runner.call(fn, timeout, what)[0]
    finally:
        runner.close()


# --- the learner's side ---------------------------------------------------------------------


@dataclass
class LearnerModel:
    """The learner's weights for one size, in the forms each scheme takes.

    ``state_dict`` is what zmqsync's schemes are given; ``view`` is an ``nn.Module`` over
    the same tensors (torchrl's schemes want modules); ``weights`` is torchrl's
    TensorDict of them, built once and passed to every torchrl ``send(weights=...)``,
    so torchrl pays for no extraction per send (zmqsync does its own, from the dict).
    """

    size: str
    state_dict: dict[str, torch.Tensor]
    view: nn.Module
    weights: TensorDict

    @classmethod
    def make(cls, size: str) -> LearnerModel:
        state_dict = make_state_dict(SIZES[size], fill="random")
        view = module_view(state_dict)
        return cls(size, state_dict, view, TensorDict.from_module(view))

    def bump(self, step: int) -> None:
        """Make the next send a new version: in place, one tensor, no allocation."""
        tensors = list(self.state_dict.values())
        tensors[step % len(tensors)].add_(1)


class TorchrlContext:
    """What torchrl's multiprocess scheme reads from its collector: the policy and
    each worker's device."""

    def __init__(self, policy: nn.Module, workers: int) -> None:
        self.policy = policy
        self.policy_device = [torch.device("cpu")] * workers


@dataclass
class PoolSlot:
    """The learner's half of a pool slot: one cell's pipes and torchrl schemes."""

    name: str
    size: str
    pipes: dict[str, list[Any]]  # by zmqsync pipe variant: the learner's end per worker
    torchrl: dict[str, Any]  # by torchrl variant: its scheme
    context: TorchrlContext  # torchrl holds its context by weak reference


def _torchrl_scheme(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchrl.weight_update import (
            MultiProcessWeightSyncScheme,
            SharedMemWeightSyncScheme,
        )

    # Their defaults: strategy "tensordict", sync=True (send() waits for every ack).
    return MultiProcessWeightSyncScheme() if name == TORCHRL_MP else SharedMemWeightSyncScheme()


class TransportPool(WorkerPool):
    """K spawned workers serving every cell of one K (see :mod:`._transports_worker`).

    Each worker is given, at spawn, one slot per cell it will serve: the cell's torchrl
    schemes (their queues can only be inherited) and its end of the cell's pipe of each
    zmqsync pipe variant, for the ``variants`` that run.
    """

    def __init__(
        self,
        size: int,
        torch_threads: int | None,
        models: dict[str, LearnerModel],
        cells: Sequence[tuple[str, str]],
        variants: Sequence[str],
    ) -> None:
        super().__init__(size, torch_threads)
        self.slots: dict[str, PoolSlot] = {}
        self._children: list[dict[str, Slot]] = [{} for _ in range(size)]
        piped = [v for v in variants if v in ZMQSYNC and ZMQSYNC[v].transport == "pipe"]
        torchrl = [v for v in variants if v in (TORCHRL_MP, TORCHRL_SHM)]
        for slot_name, model_size in cells:
            context = TorchrlContext(models[model_size].view, size)
            slot = PoolSlot(slot_name, model_size, {}, {}, context)
            children = [Slot() for _ in range(size)]
            for name in piped:
                ends = [self._ctx.Pipe(duplex=True) for _ in range(size)]
                slot.pipes[name] = [parent for parent, _ in ends]
                for child, (_, end) in zip(children, ends, strict=True):
                    child.pipes[name] = end
            for name in torchrl:
                scheme = _torchrl_scheme(name)
                # As torchrl's collectors: the collector is the context (policy and
                # policy_device), the spawn context makes the queues.
                scheme.init_on_sender(model_id="policy", context=context, ctx=self._ctx)
                slot.torchrl[name] = scheme
                for child in children:
                    child.torchrl[name] = scheme
            self.slots[slot_name] = slot
            for i, child in enumerate(children):
                self._children[i][slot_name] = child

    def start(self, timeout: float = WORKER_START_SECONDS) -> None:
        for idx in range(self.size):
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=worker_main,
                args=(idx, child, os.getpid(), self.torch_threads, self._children[idx]),
                name=f"bench-transports-{idx}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        # The workers hold their pipe ends now; closing ours lets a dead worker be seen.
        for children in self._children:
            for slot in children.values():
                for end in slot.pipes.values():
                    end.close()
        self._children = []
        self.call(range(self.size), "start", (), timeout)

    def post(self, workers: Sequence[int], command: str, args: dict[int, Any]) -> None:
        """Send ``command`` without waiting: :meth:`collect` the replies later (always:
        an uncollected reply would answer the next command)."""
        for i in workers:
            self._conns[i].send((command, tuple(args[i])))

    def close(self, timeout: float = 5.0) -> None:
        super().close(timeout)
        for slot in self.slots.values():
            for pipes in slot.pipes.values():
                for pipe in pipes:
                    with contextlib.suppress(OSError):
                        pipe.close()
            for name, scheme in slot.torchrl.items():
                # Bounded: closing a queue joins its feeder thread, which could be stuck.
                with contextlib.suppress(Exception):
                    bounded(scheme.shutdown, CLEANUP_SECONDS, f"{name} shutdown")


class RayFleet:
    """The Ray actors, started once and reused by every cell (restarted if one hangs)."""

    def __init__(self, size: int, torch_threads: int | None, timeout: float) -> None:
        import ray

        from benchmarks._transports_ray import BenchActor

        self._ray = ray
        # Threaded, so that one variant's call stuck in an actor (torchrl's gloo waits
        # have no deadline) does not starve the other's; see _transports_ray.
        self._cls = ray.remote(BenchActor).options(num_cpus=0, max_concurrency=4)
        self.size = size
        self.torch_threads = torch_threads
        self.timeout = timeout
        self.actors: list[Any] = []

    def start(self) -> None:
        self.actors = [self._cls.remote(i, self.torch_threads) for i in range(self.size)]
        self._ray.get([a.ready.remote() for a in self.actors], timeout=WORKER_START_SECONDS)

    def get(self, refs: Any, what: str, timeout: float | None = None) -> Any:
        try:
            return self._ray.get(refs, timeout=self.timeout if timeout is None else timeout)
        except self._ray.exceptions.GetTimeoutError:
            raise Hung(f"Ray actors did not answer {what!r} in time") from None

    def restart(self) -> None:
        self.kill()
        self.start()

    def kill(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
        self.actors = []


# --- variants ---------------------------------------------------------------------------------


@dataclass
class VariantResult:
    """One variant's figures in one cell."""

    times: list[float] = field(default_factory=list)
    extra_bytes: dict[str, int] = field(default_factory=dict)
    retained_bytes: dict[str, int] = field(default_factory=dict)
    failure: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def median_ms(self) -> float:
        return float(np.median(self.times)) * 1e3 if self.times and not self.failure else math.nan

    def p90_ms(self) -> float:
        return (
            float(np.percentile(self.times, 90)) * 1e3
            if self.times and not self.failure
            else math.nan
        )


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

    def send(self, timeout: float) -> float:
        return self.runner.call(self._send, timeout + DEADLINE_MARGIN, "send()")[1]

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
            env.timeout + 10,
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
            env.timeout + 10,
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
            env.timeout + 10,
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
            pool.collect(ranks, "open_gloo", env.timeout + 10)
        return {"port": self.peer.port}

    def _send(self) -> None:
        self.peer.send()

    def _close(self) -> None:
        self.peer.close()

    def held_bytes(self) -> dict[str, int]:
        return {"buffers": self.peer.flat.numel()}


class MemcpyVariant(Variant):
    """K serial copies of the learner's tensors into K sets of tensors it preallocated:
    ``torch._foreach_copy_`` per set (as fast as copying into one flat buffer here, and
    twice as fast as a loop of ``copy_`` for 2000 tensors)."""

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


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:300]


# --- one cell ---------------------------------------------------------------------------------


@dataclass
class Cell:
    """One row of the table: a size and K workers."""

    size: str
    workers: int
    results: dict[str, VariantResult] = field(default_factory=dict)
    #: Where workers hung in this cell ("pool", "ray"): the pool or actors are replaced.
    broke: set[str] = field(default_factory=set)

    def median(self, variant: str) -> float:
        r = self.results.get(variant)
        return math.nan if r is None else r.median_ms()

    def ratio(self, numerator: str, denominator: str) -> float:
        return self.median(numerator) / self.median(denominator)

    def best_peer(self) -> tuple[str, float] | None:
        """The fastest of :data:`BEST_PEER_FROM` that ran here without failing."""
        times = [(self.median(v), v) for v in BEST_PEER_FROM if not math.isnan(self.median(v))]
        if not times:
            return None
        ms, name = min(times)
        return name, ms

    def to_best_peer(self, variant: str) -> float:
        best = self.best_peer()
        return math.nan if best is None else self.median(variant) / best[1]

    def extra_pct(self, variant: str) -> float | None:
        measured = self.results[variant].extra_bytes
        extra = measured.get("heap", measured.get("rss_anon"))
        if extra is None:
            return None
        held = measured.get("shm", 0) + measured.get("buffers", 0)
        return 100.0 * (extra + held) / SIZES[self.size].nbytes

    def ratios(self) -> dict[str, float]:
        """Every ratio the table shows, by column name."""
        out = {f"{z}/{t}": self.ratio(z, t) for z, t in PAIRS if z in self.results}
        for z in ZMQSYNC:
            if z in self.results:
                out[f"{z}/best peer"] = self.to_best_peer(z)
                out[f"{z}/{MEMCPY}"] = self.ratio(z, MEMCPY)
        return out

    def to_json(self) -> dict[str, Any]:
        best = self.best_peer()
        return {
            "size": self.size,
            "model_bytes": SIZES[self.size].nbytes,
            "workers": self.workers,
            "best_peer": None if best is None else {"name": best[0], "median_ms": best[1]},
            "ratios": self.ratios(),
            "variants": {
                name: {
                    "median_ms": r.median_ms(),
                    "p90_ms": r.p90_ms(),
                    "times_ms": [t * 1e3 for t in r.times],
                    "failure": r.failure,
                    "extra_bytes": r.extra_bytes,
                    "extra_pct": self.extra_pct(name),
                    "retained_bytes": r.retained_bytes,
                    "notes": r.notes,
                }
                for name, r in self.results.items()
            },
        }


def run_cell(env: CellEnv, variants: Sequence[str], *, repeats: int, warmup: int) -> Cell:
    """Open every variant for the cell, time them (A..Z, Z..A), check every worker."""
    cell = Cell(env.size, env.workers)
    opened: list[Variant] = []
    live: list[Variant] = []
    step = 0
    interrupted = False
    try:
        for name in variants:
            v = make_variant(name)
            result = cell.results[name] = VariantResult()
            opened.append(v)
            try:
                result.notes = v.open(env)
                live.append(v)
            except Exception as exc:
                result.failure = f"set-up failed: {_why(exc)}"
                log.warning("%s %s K=%d: %s", name, env.size, env.workers, result.failure)
        halves = (math.ceil(repeats / 2), repeats // 2)
        for round_no, order in enumerate((live, live[::-1])):
            for v in order:
                result = cell.results[v.name]
                if halves[round_no] == 0 or result.failure:
                    continue
                meter = PeakMemoryMeter() if round_no == 0 else None
                try:
                    with meter if meter is not None else contextlib.nullcontext():
                        for i in range(warmup + halves[round_no]):
                            env.model.bump(step)
                            step += 1
                            elapsed = v.send(env.timeout)
                            if i >= warmup:
                                result.times.append(elapsed)
                except Exception as exc:
                    result.failure = f"send failed: {_why(exc)}"
                    log.warning("%s %s K=%d: %s", v.name, env.size, env.workers, result.failure)
                    continue
                if meter is not None:
                    result.extra_bytes, result.retained_bytes = meter.extra, meter.retained
                    result.extra_bytes = {**result.extra_bytes, **v.held_bytes()}
        # Every variant sends the model as it is now; every worker's copy must match it
        # and be its own memory (nothing shared with, or aliased to, the learner's).
        survivors = [v for v in live if not cell.results[v.name].failure]
        for v in survivors:
            try:
                v.send(env.timeout)
            except Exception as exc:
                cell.results[v.name].failure = f"final send failed: {_why(exc)}"
        expected = digest(env.model.state_dict)
        for v in survivors:
            result = cell.results[v.name]
            if result.failure:
                continue
            try:
                replies = v.digests(env)
            except Exception as exc:
                result.failure = f"reading the workers failed: {_why(exc)}"
                continue
            wrong = [i for i, r in enumerate(replies) if r["digest"] != expected]
            not_own = [
                i
                for i, r in enumerate(replies)
                if r["ownership"]["shared"] or not r["ownership"]["distinct_storages"]
            ]
            result.notes["ownership"] = [r["ownership"] for r in replies]
            if wrong:
                result.failure = f"workers {wrong} do not hold the learner's weights"
            elif not_own:
                result.failure = f"workers {not_own} do not hold the weights in memory of their own"
    except (KeyboardInterrupt, SystemExit):
        interrupted = True  # no polite teardown: main() kills the workers and actors
        raise
    finally:
        if not interrupted:
            with _quiet("zmqsync.transport.pipe"):  # a pipe's far end closing is expected
                _close_cell(env, opened)
    cell.broke = {WHERE[v.name] for v in opened if v.broke_workers}
    return cell


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    target = logging.getLogger(logger)
    level = target.level
    target.setLevel(logging.ERROR)
    try:
        yield
    finally:
        target.setLevel(level)


def _close_cell(env: CellEnv, opened: Sequence[Variant]) -> None:
    """Close the cell's sessions in the workers, then the learner's schemes."""
    # Workers first, as a collector's would stop before the learner.
    if env.pool is not None:
        with contextlib.suppress(Exception):
            env.pool.call(range(env.workers), "close", (), env.timeout)
    if env.fleet is not None:
        with contextlib.suppress(Exception):
            env.fleet.get([a.close.remote() for a in env.fleet.actors[: env.workers]], "close")
    for v in opened:
        v.close()


# --- output -----------------------------------------------------------------------------------


def _ms(r: VariantResult) -> str:
    if r.failure:
        return f"failed: {r.failure[:80]}"
    return f"{r.median_ms():.2f} / {r.p90_ms():.2f}"


def _num(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def _ratio(cell: Cell, zmqsync: str, torchrl: str) -> str:
    x = cell.ratio(zmqsync, torchrl)
    if math.isnan(x):
        return "n/a"
    text = _num(x)
    if x > RATIO_TARGET:
        text = f"**{text}**"
    if cell.size == SMALL_TENSORS:
        met = x <= 1.0 / SPEEDUP_TARGET
        text += f" ({1 / x:.0f}x faster: {'met' if met else 'missed'})" if x < 1 else " (missed)"
    return text


def _best_peer_ratio(cell: Cell, zmqsync: str) -> str:
    x = cell.to_best_peer(zmqsync)
    if math.isnan(x):
        return "n/a"
    return f"**{_num(x)}**" if x > BEST_PEER_TARGET else _num(x)


def _memcpy_ratio(cell: Cell, zmqsync: str) -> str:
    x = cell.ratio(zmqsync, MEMCPY)
    if math.isnan(x):
        return "n/a"
    if (cell.size, cell.workers) != MEMCPY_CELL:
        return _num(x)
    return f"**{_num(x)}**" if x > MEMCPY_TARGET else _num(x)


def _best_peer(cell: Cell) -> str:
    best = cell.best_peer()
    return "n/a" if best is None else f"{best[0]} {best[1]:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.0f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---", "---:", *(["---:"] * (len(header) - 2))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _summary(cells: Sequence[Cell], variants: Sequence[str]) -> list[str]:
    """One line per target: how many of ``cells`` (in table order) meet it."""
    lines = []
    for z, t in PAIRS:
        if z not in variants or t not in variants:
            continue
        measured = [c for c in cells if not math.isnan(c.ratio(z, t))]
        within = sum(c.ratio(z, t) <= RATIO_TARGET for c in measured)
        small = [c for c in measured if c.size == SMALL_TENSORS]
        fast = sum(c.ratio(z, t) <= 1 / SPEEDUP_TARGET for c in small)
        failed = [
            f"{c.size} K={c.workers}" for c in cells if c.results[z].failure or c.results[t].failure
        ]
        line = f"- {z} vs {t}: at or below torchrl in {within}/{len(measured)} cells"
        if small:
            line += f"; {SPEEDUP_TARGET:.0f}x faster for {SMALL_TENSORS} in {fast}/{len(small)}"
        if failed:
            line += f"; failed (either side): {', '.join(failed)}"
        lines.append(line)
    peers = [p for p in BEST_PEER_FROM if p in variants]
    for z in (v for v in variants if v in ZMQSYNC):
        if not peers:
            break
        measured = [c for c in cells if not math.isnan(c.to_best_peer(z))]
        above = [c for c in measured if c.to_best_peer(z) > BEST_PEER_TARGET]
        line = (
            f"- {z} vs best peer: at or below {BEST_PEER_TARGET}x in "
            f"{len(measured) - len(above)}/{len(measured)} cells"
        )
        if above:
            line += "; above in " + ", ".join(
                f"{c.size} K={c.workers} ({_num(c.to_best_peer(z))} of {_best_peer(c)} ms)"
                for c in above
            )
        failed = [f"{c.size} K={c.workers}" for c in cells if c.results[z].failure]
        if failed:
            line += f"; failed: {', '.join(failed)}"
        lines.append(line)
    if MEMCPY in variants:
        size, workers = MEMCPY_CELL
        for c in cells:
            if (c.size, c.workers) != MEMCPY_CELL:
                continue
            for z in (v for v in variants if v in ZMQSYNC):
                x = c.ratio(z, MEMCPY)
                if not math.isnan(x):
                    met = "met" if x <= MEMCPY_TARGET else "missed"
                    lines.append(
                        f"- {z} vs memcpy at {size} K={workers}: {_num(x)}x "
                        f"(target at or below {MEMCPY_TARGET}: {met})"
                    )
    return lines


def markdown(
    cells: Sequence[Cell],
    variants: Sequence[str],
    machine: dict[str, Any],
    command: str,
    seconds: float,
) -> str:
    """The README's tables (times; ratios and memory), then a summary and the machine."""
    ordered = sorted(cells, key=lambda c: (list(SIZES).index(c.size), c.workers))
    zmqsync = [v for v in variants if v in ZMQSYNC]
    has_peers = any(p in variants for p in BEST_PEER_FROM)
    pairs = [(z, t) for z, t in PAIRS if z in variants and t in variants]
    times = _table(
        ["size", "K", *(f"{v} ms (median / p90)" for v in variants)],
        [[c.size, str(c.workers), *(_ms(c.results[v]) for v in variants)] for c in ordered],
    )
    header = ["size", "K"]
    if has_peers:
        header += ["best peer (ms)", *(f"{z} / best peer" for z in zmqsync)]
    if MEMCPY in variants:
        header += [f"{z} / {MEMCPY}" for z in zmqsync]
    header += [f"{z} / {t}" for z, t in pairs]
    header.append("extra mem: " + " / ".join(variants))
    rows = []
    for c in ordered:
        row = [c.size, str(c.workers)]
        if has_peers:
            row += [_best_peer(c), *(_best_peer_ratio(c, z) for z in zmqsync)]
        if MEMCPY in variants:
            row += [_memcpy_ratio(c, z) for z in zmqsync]
        row += [_ratio(c, z, t) for z, t in pairs]
        row.append(" / ".join(_pct(c.extra_pct(v)) for v in variants))
        rows.append(row)
    lines = [
        *times,
        "",
        *_table(header, rows),
        "",
        f"Best peer = the fastest of {', '.join(BEST_PEER_FROM)} in the cell (its median); "
        f"zmqsync / best peer: target at or below {BEST_PEER_TARGET} everywhere "
        "(**bold** = above).",
        f"zmqsync / {MEMCPY}: the physical bound, K serial copies in the learner; target at "
        f"or below {MEMCPY_TARGET} at {MEMCPY_CELL[0]} K={MEMCPY_CELL[1]} (**bold** = above).",
        "zmqsync / torchrl = zmqsync median / torchrl median; **bold** = zmqsync slower than "
        f"torchrl (target: at or below 1 everywhere, and {SPEEDUP_TARGET:.0f}x faster for "
        f"{SMALL_TENSORS}).",
        "Extra mem = peak extra bytes the learner holds from malloc during a variant's first "
        "block of sends, % of the model, plus the shared-memory blocks zmqsync-pipe and "
        "zmqsync-ray map and the flat buffers ray-store and gloo-flat allocate once "
        "(Ray's object store and torch's shared memory are not malloc'd by the learner, so "
        "they do not show here; memcpy's destinations stand for the workers' tensors and are "
        "not counted).",
        "",
        *_summary(ordered, variants),
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min)",
        "",
        "Machine: "
        + ", ".join(
            f"{k} {v if not isinstance(v, tuple | list) else ' '.join(f'{x:.2f}' for x in v)}"
            for k, v in machine.items()
        ),
        "",
        "Models: "
        + "; ".join(
            f"{name} = {SIZES[name].describe()}"
            for name in sorted({c.size for c in cells}, key=list(SIZES).index)
        ),
    ]
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.transports",
        description="zmqsync's transports against torchrl's weight-sync schemes, Ray's "
        "object store, a gloo broadcast, and memcpy.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: sizes {','.join(QUICK_SIZES)}, workers "
        f"{','.join(map(str, QUICK_WORKERS))}, {QUICK_REPEATS} repeats (~2 min)",
    )
    p.add_argument(
        "--sizes", type=_csv(str, list(SIZES)), help=f"from {','.join(SIZES)} (default: all)"
    )
    p.add_argument("--workers", type=_csv(int), help="worker counts K (default: 1,2,4)")
    p.add_argument(
        "--variants",
        type=_csv(str, list(VARIANTS)),
        default=list(DEFAULT_VARIANTS),
        help=f"from {','.join(VARIANTS)} (default: all but {','.join(sorted(MOVES_TENSORS))}, "
        "which runs only without the peers)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="timed sends per variant and cell (default by size: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_REPEATS.items())
        + "); 128MB and 2000x4KB get a fifth of it, at least 2",
    )
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed sends per block")
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any one send, set-up or worker reply may take",
    )
    p.add_argument(
        "--no-retain",
        action="store_true",
        help="zmqsync schemes with retain_snapshot=False (default: the schemes' defaults)",
    )
    p.add_argument(
        "--torch-threads", type=int, help="torch intra-op threads everywhere (default: torch's)"
    )
    p.add_argument("--json", metavar="PATH", help="write every figure (and raw times) here")
    p.add_argument("--markdown", metavar="PATH", help="write the tables here")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES) if args.quick else list(SIZES)
    if args.workers is None:
        args.workers = list(QUICK_WORKERS) if args.quick else [1, 2, 4]
    if any(k < 1 for k in args.workers):
        p.error("--workers must be positive")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.torch_threads is not None and args.torch_threads < 1:
        p.error("--torch-threads must be at least 1")
    if args.quick and args.repeats is None:
        args.repeats = QUICK_REPEATS
    args.variants = [v for v in VARIANTS if v in args.variants]  # the canonical order
    if MOVES_TENSORS & set(args.variants) and set(PEERS[:-1]) & set(args.variants):
        p.error(
            f"{', '.join(sorted(MOVES_TENSORS & set(args.variants)))} moves the learner's "
            "tensors, which the peers alias: run it without them (memcpy may stay)"
        )
    return args


def repeats_for(size: str, repeats: int | None) -> int:
    if repeats is None:
        return DEFAULT_REPEATS[size]
    return max(2, repeats // 5) if size in ("128MB", SMALL_TENSORS) else repeats


def _start_ray(torch_threads: int | None) -> None:
    import ray

    # Ray's workers import the benchmark's modules: from the repository root.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=RAY_CPUS,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


def run_worker_count(
    workers: int,
    plan: Sequence[tuple[str, str]],
    *,
    args: argparse.Namespace,
    models: dict[str, LearnerModel],
    fleet: RayFleet | None,
    workdir: str,
    zmqsync_options: dict[str, Any],
) -> Iterator[Cell]:
    """Run ``plan``'s cells (``(slot, size)``; a slot ending in ``-warm`` is thrown
    away) with K = ``workers``; yield each measured cell.

    One pool of worker processes serves them all, unless torchrl hangs in one: its
    workers are then stuck, and a new pool serves the cells left.
    """
    needs_pool = any(WHERE[v] == "pool" for v in args.variants)
    left = list(plan)
    while left:
        pool = (
            TransportPool(workers, args.torch_threads, models, left, args.variants)
            if needs_pool
            else None
        )
        try:
            if pool is not None:
                pool.start()
            while left:
                slot_name, size = left.pop(0)
                warm = slot_name.endswith("-warm")
                env = CellEnv(
                    size=size,
                    workers=workers,
                    model=models[size],
                    pool=pool,
                    slot=pool.slots[slot_name] if pool is not None else None,
                    fleet=fleet,
                    timeout=args.timeout,
                    workdir=workdir,
                    tag=f"k{workers}-{slot_name}",
                    zmqsync_options=zmqsync_options,
                )
                cell = run_cell(
                    env,
                    args.variants,
                    repeats=1 if warm else repeats_for(size, args.repeats),
                    warmup=1 if warm else args.warmup,
                )
                if "ray" in cell.broke and fleet is not None:
                    fleet.restart()
                if not warm:
                    yield cell
                if "pool" in cell.broke:
                    break
        finally:
            if pool is not None:
                pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    given = list(argv) if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.transports", shlex.join(given)]).strip()
    signal.signal(signal.SIGTERM, _raise_exit)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # torchrl warns on its own imports and on every scheme; none of it is news here.
    warnings.filterwarnings("ignore", module=r"torchrl\..*")
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    machine = machine_info()
    import ray
    import torchrl

    machine["torchrl"] = torchrl.__version__
    machine["ray"] = ray.__version__
    started = time.monotonic()
    print(
        f"# {command}\n# {machine['cpu']}, {machine['cpus_usable']} cpus, torch "
        f"{machine['torch']}, torchrl {machine['torchrl']}, ray {machine['ray']}",
        file=sys.stderr,
    )
    zmqsync_options = {"retain_snapshot": False} if args.no_retain else {}
    models = {size: LearnerModel.make(size) for size in args.sizes}
    cells: list[Cell] = []
    failed_zmqsync = False
    fleet: RayFleet | None = None
    needs_ray = any(WHERE[v] == "ray" for v in args.variants)
    with _workdir() as workdir:
        try:
            if needs_ray:
                _start_ray(args.torch_threads)
                # Ray's core worker installs a SIGTERM handler that ends the process at
                # once; ours runs the cleanup below instead.
                signal.signal(signal.SIGTERM, _raise_exit)
                fleet = RayFleet(max(args.workers), args.torch_threads, args.timeout)
                fleet.start()
            for k_no, workers in enumerate(args.workers):
                # The first K also runs a throwaway cell per size: one-time costs in the
                # learner (lazily loaded code, pyzmq's and Ray's threads, torch moving
                # the weights to shared memory) are not charged to a measured cell.
                plan = [
                    *((f"{s}-warm", s) for s in args.sizes if k_no == 0),
                    *((s, s) for s in args.sizes),
                ]
                plan.sort(key=lambda item: args.sizes.index(item[1]))
                for cell in run_worker_count(
                    workers,
                    plan,
                    args=args,
                    models=models,
                    fleet=fleet,
                    workdir=workdir,
                    zmqsync_options=zmqsync_options,
                ):
                    cells.append(cell)
                    _progress(cell, args.variants)
                    failed_zmqsync |= any(
                        cell.results[v].failure for v in args.variants if v in ZMQSYNC
                    )
        finally:
            if fleet is not None:
                fleet.kill()
            if needs_ray:
                ray.shutdown()
    seconds = time.monotonic() - started
    machine["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    table = markdown(cells, args.variants, machine, command, seconds)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command,
                    "machine": machine,
                    "seconds": seconds,
                    "ratio_target": RATIO_TARGET,
                    "best_peer_target": BEST_PEER_TARGET,
                    "best_peer_from": list(BEST_PEER_FROM),
                    "memcpy_target": {
                        "ratio": MEMCPY_TARGET,
                        "size": MEMCPY_CELL[0],
                        "workers": MEMCPY_CELL[1],
                    },
                    "zmqsync_variants": {
                        name: {
                            "transport": spec.transport,
                            "replaces": spec.replaces,
                            "scheme": dict(spec.scheme),
                            "sender": dict(spec.sender),
                            "receiver": dict(spec.receiver),
                        }
                        for name, spec in ZMQSYNC.items()
                        if name in args.variants
                    },
                    "speedup_target": SPEEDUP_TARGET,
                    "zmqsync_options": zmqsync_options,
                    "models": {
                        s: {"bytes": SIZES[s].nbytes, "layout": SIZES[s].describe()}
                        for s in args.sizes
                    },
                    "cells": [c.to_json() for c in cells],
                },
                f,
                indent=1,
            )
    if failed_zmqsync:
        print("error: a zmqsync variant failed (see the table)", file=sys.stderr)
        return 1
    return 0


def _progress(cell: Cell, variants: Sequence[str]) -> None:
    parts = []
    for name in variants:
        r = cell.results[name]
        parts.append(f"{name} {'FAILED' if r.failure else f'{r.median_ms():8.2f} ms'}")
    ratios = [
        f"{z}/{t} {cell.ratio(z, t):.3f}" for z, t in PAIRS if z in variants and t in variants
    ]
    best = cell.best_peer()
    if best is not None:
        ratios.append(f"best peer {best[0]} {best[1]:.2f} ms")
        ratios += [f"{z}/best {cell.to_best_peer(z):.3f}" for z in variants if z in ZMQSYNC]
    print(
        f"{cell.size:>9} K={cell.workers}  " + "  ".join(parts) + "  |  " + "  ".join(ratios),
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
