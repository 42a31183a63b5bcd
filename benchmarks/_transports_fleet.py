"""The learner's side of the transports benchmark: its model in the forms every scheme
takes, and the workers it drives (a pool of processes per worker count K, the Ray
actors).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from tensordict import TensorDict
from torch import nn

from benchmarks._deadline import CLEANUP_SECONDS, Hung, bounded
from benchmarks._models import SIZES, make_state_dict
from benchmarks._pool import EXIT_SECONDS, SPAWN, WORKER_START_SECONDS, WorkerPool
from benchmarks._transports_spec import TORCHRL_MP, TORCHRL_SHM, ZMQSYNC
from benchmarks._transports_worker import Slot, module_view, open_worker

#: Calls an actor runs at once (see :mod:`._transports_ray`).
ACTOR_CONCURRENCY: Final = 4


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
        self.slots: dict[str, PoolSlot] = {}
        self._children: list[dict[str, Slot]] = [{} for _ in range(size)]
        piped = [v for v in variants if v in ZMQSYNC and ZMQSYNC[v].transport == "pipe"]
        torchrl = [v for v in variants if v in (TORCHRL_MP, TORCHRL_SHM)]
        for slot_name, model_size in cells:
            context = TorchrlContext(models[model_size].view, size)
            slot = PoolSlot(slot_name, model_size, {}, {}, context)
            children = [Slot() for _ in range(size)]
            for name in piped:
                ends = [SPAWN.Pipe(duplex=True) for _ in range(size)]
                slot.pipes[name] = [parent for parent, _ in ends]
                for child, (_, end) in zip(children, ends, strict=True):
                    child.pipes[name] = end
            for name in torchrl:
                scheme = _torchrl_scheme(name)
                # As torchrl's collectors: the collector is the context (policy and
                # policy_device), the spawn context makes the queues.
                scheme.init_on_sender(model_id="policy", context=context, ctx=SPAWN)
                slot.torchrl[name] = scheme
                for child in children:
                    child.torchrl[name] = scheme
            self.slots[slot_name] = slot
            for i, child in enumerate(children):
                self._children[i][slot_name] = child
        super().__init__(
            open_worker,
            [(slots,) for slots in self._children],
            torch_threads=torch_threads,
            name="bench-transports",
        )

    def spawn(self) -> None:
        super().spawn()
        # The workers hold their pipe ends now; closing ours lets a dead worker be seen.
        for children in self._children:
            for slot in children.values():
                for end in slot.pipes.values():
                    end.close()
        self._children = []

    def close(self, timeout: float = EXIT_SECONDS) -> None:
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
        self._cls = ray.remote(BenchActor).options(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)
        self.size = size
        self.torch_threads = torch_threads
        self.timeout = timeout
        self.actors: list[Any] = []
        #: The actors' process ids, in worker order (their memory is read from /proc).
        self.pids: list[int] = []

    def start(self) -> None:
        self.actors = [self._cls.remote(i, self.torch_threads) for i in range(self.size)]
        # Ray starts a few worker processes at a time (as many as it has CPUs), each
        # importing torch: the more actors, the longer they take to be ready.
        timeout = WORKER_START_SECONDS * max(1, self.size // 2)
        pids = self._ray.get([a.ready.remote() for a in self.actors], timeout=timeout)
        self.pids = [int(pid) for pid in pids]

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
        self.pids = []
