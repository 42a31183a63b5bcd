"""Worker processes of the transports benchmark (issue 3): zmqsync's pipe and ZeroMQ
receivers, torchrl's multiprocess and shared-memory receivers and the gloo-flat peer,
side by side in the same processes.

torchrl's ``MultiProcessWeightSyncScheme`` and ``SharedMemWeightSyncScheme`` talk over
``multiprocessing.Queue``s, which can only reach a process through inheritance (as
arguments of ``Process``), never over a pipe later; so do zmqsync's pipes. So a pool's
processes get, when they are spawned, one *slot* per cell they will serve: that cell's
torchrl schemes (initialised on the learner, queues inside) and the worker's end of one
pipe per zmqsync pipe variant, each by variant name. A pool serves one worker count K
and every size; the control pipe (pickle; nothing on it is timed) then opens and closes
the sessions of each cell. Commands::

    ("start", ())                                               -> "ready" (imports done)
    ("open_pipe", (slot, name, scheme, size, options, timeout)) -> session name
    ("open_torchrl", (slot, name, size, idx))                   -> facts about its model
    ("open_zmq", (name, scheme, size, idx, options, timeout))   -> session name
    ("open_gloo", (name, size, port, rank, world, timeout))     -> session name
    ("digest", (name,))                                         -> digest of its tensors
    ("close", ())                                               -> sessions it closed
    ("exit", ())

``options`` are the zmqsync variant's keyword arguments for ``init_on_worker``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks._memory import give_back_freed
from benchmarks._models import SIZES, digest, make_state_dict
from benchmarks._peers import GlooWorker
from benchmarks._sessions import ZmqsyncSessions


@dataclass
class Slot:
    """What one worker of a pool is given at spawn for one cell, by variant name."""

    #: This worker's end of each zmqsync pipe variant's pipe (multiprocessing Connection).
    pipes: dict[str, Any] = field(default_factory=dict)
    #: torchrl's schemes (``MultiProcessWeightSyncScheme``, ``SharedMemWeightSyncScheme``),
    #: queues inside.
    torchrl: dict[str, Any] = field(default_factory=dict)


def module_view(state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """An ``nn.Module`` whose parameters ARE ``state_dict``'s tensors (same storage).

    torchrl's schemes want modules (its multiprocess receiver cannot apply its first
    version to a dict, its Ray receiver applies to modules only). Keys ``"a.b"`` become a
    submodule ``a`` with a parameter ``b``, so ``view.state_dict()`` has the same keys, in
    the same order, as ``state_dict``.
    """
    root = nn.Module()
    for key, tensor in state_dict.items():
        parent, _, name = key.rpartition(".")
        owner = root
        for part in parent.split(".") if parent else ():
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    return root


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s tensors by key, as the learner's state_dict names them."""
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}


def own_parameters(module: nn.Module) -> None:
    """Give every parameter of ``module`` memory of its own (a private copy).

    torchrl's multiprocess receiver applies its first version out of place: afterwards
    the worker's parameters ARE the tensors it received, which live in shared memory
    that the learner writes (torch moves a tensor to shared memory when it is pickled
    into a queue). Later versions are then copied into that shared memory, from the
    same shared memory. Copying each parameter out once, here, makes every later
    version a real copy into the worker's own tensors, as zmqsync's receivers do.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=False)


def ownership(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Whether a worker's tensors are its own: none in shared memory (torch's), none
    overlapping another (several may lie apart in one storage: a worker that lent its
    tensors to the learner keeps them in one memfd of its own, which no other worker
    maps)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors.values()
        if t.numel()
    )
    apart = all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    return {
        "shared": sum(bool(t.is_shared()) for t in tensors.values()),
        "distinct_storages": apart,
        "storages": len(set(ptrs)),
        "tensors": len(ptrs),
    }


@dataclass
class Sessions:
    """A worker's sessions, by variant name (served by :func:`benchmarks._pool.worker_main`)."""

    slots: dict[str, Slot]
    zmqsync: ZmqsyncSessions = field(default_factory=ZmqsyncSessions)
    torchrl: dict[str, tuple[Any, nn.Module]] = field(default_factory=dict)
    gloo: dict[str, GlooWorker] = field(default_factory=dict)

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {
            "open_pipe": self.open_pipe,
            "open_zmq": self.open_zmq,
            "open_torchrl": self.open_torchrl,
            "open_gloo": self.open_gloo,
            "digest": self.digest,
            "close": self.close,
        }

    def open_pipe(
        self,
        slot: str,
        name: str,
        scheme: Any,
        size: str,
        options: dict[str, Any],
        timeout: float,
    ) -> str:
        pipe = self.slots[slot].pipes[name]
        return self.zmqsync.open(
            name,
            scheme,
            size,
            lambda state_dict: scheme.init_on_worker(name, pipe=pipe, model=state_dict, **options),
            timeout,
        )

    def open_zmq(
        self,
        name: str,
        scheme: Any,
        size: str,
        idx: int,
        options: dict[str, Any],
        timeout: float,
    ) -> str:
        return self.zmqsync.open(
            name,
            scheme,
            size,
            lambda state_dict: scheme.init_on_receiver(
                model_id=name, model=state_dict, worker_idx=idx, **options
            ),
            timeout,
        )

    def open_torchrl(self, slot: str, name: str, size: str, idx: int) -> dict[str, Any]:
        """torchrl's multiprocess or shared-memory receiver, as its collectors' workers
        set it up, then given tensors of its own (see :func:`own_parameters`)."""
        scheme = self.slots[slot].torchrl[name]
        module = module_view(make_state_dict(SIZES[size], fill="zeros"))
        # The scheme holds the model by weak reference: the session keeps it alive.
        self.torchrl[name] = (scheme, module)
        scheme.init_on_receiver(model_id="policy", model=module, worker_idx=idx)
        # Receives the first version from its queue (torchrl's own 10 s timeout), applies
        # it, starts torchrl's background receiver thread.
        scheme.connect()
        aliased = ownership(module_state(module))
        own_parameters(module)
        owned = ownership(module_state(module))
        if owned["shared"] or not owned["distinct_storages"]:
            raise RuntimeError(f"the {name} worker's tensors are not its own: {owned}")
        return {"after_connect": aliased, "after_copy": owned}

    def open_gloo(
        self, name: str, size: str, port: int, rank: int, world: int, timeout: float
    ) -> str:
        """Join the learner's gloo group (it joins at the same time) and receive."""
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self.gloo[name] = GlooWorker(state_dict, port, rank, world, timeout)
        return name

    def digest(self, name: str) -> dict[str, Any]:
        if name in self.torchrl:
            _, module = self.torchrl[name]
            tensors = module_state(module)
            return {"digest": digest(tensors), "ownership": ownership(tensors)}
        if name in self.gloo:
            peer = self.gloo[name]
            with peer.lock:
                return {
                    "digest": digest(peer.tensors),
                    "ownership": ownership(peer.tensors),
                    "applied": peer.applied,
                    "error": peer.error,
                }
        return {**self.zmqsync.digest(name), "ownership": ownership(self.zmqsync.tensors(name))}

    def close(self) -> int:
        closed = self.zmqsync.close() + len(self.torchrl) + len(self.gloo)
        for scheme, _ in self.torchrl.values():
            with contextlib.suppress(Exception):
                scheme.shutdown()
        for peer in self.gloo.values():
            peer.close()
        self.torchrl.clear()
        self.gloo.clear()
        give_back_freed()  # what the sessions held is free for the cell's next ones
        return closed


def open_worker(slots: dict[str, Slot]) -> Sessions:
    """A pool worker's set-up: the libraries every cell uses, imported now (not during a
    cell), and no session yet."""
    import torchrl.weight_update  # noqa: F401

    import zmqsync  # noqa: F401

    return Sessions(slots)
