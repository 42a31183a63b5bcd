"""Worker processes of the transports benchmark (issue 3): zmqsync's pipe and ZeroMQ
receivers and torchrl's multiprocess receiver, side by side in the same processes.

torchrl's ``MultiProcessWeightSyncScheme`` talks over ``multiprocessing.Queue``s, which
can only reach a process through inheritance (as arguments of ``Process``), never over a
pipe later. So a pool's processes get, when they are spawned, one *slot* per model size
it will serve: the torchrl scheme for that size (initialised on the learner, queues
inside) and the worker's end of a zmqsync pipe. A pool serves one worker count K and
every size; the control pipe (pickle; nothing on it is timed) then opens and closes the
sessions of each cell. Commands::

    ("start", ())                                        -> "ready" (imports done)
    ("open_pipe", (slot, scheme, size, timeout))         -> session name
    ("open_torchrl_mp", (slot, size, idx, timeout))      -> facts about the worker's model
    ("open_zmq", (scheme, size, idx, timeout))           -> session name
    ("digest", (name,))                                  -> digest of the session's tensors
    ("close", ())                                        -> how many sessions it closed
    ("exit", ())
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks._harness import SIZES, digest, make_state_dict

#: How often an idle worker looks whether its parent is still there.
PARENT_CHECK_SECONDS = 1.0

#: Session names, shared with the learner's side.
PIPE = "zmqsync-pipe"
TORCHRL_MP = "torchrl-mp"
ZMQ = "zmqsync-zmq"
ZMQSYNC_RAY = "zmqsync-ray"
TORCHRL_RAY = "torchrl-ray"


@dataclass
class Slot:
    """What one worker of a pool is given at spawn for one model size."""

    pipe: Any  # this worker's end of the zmqsync pipe (multiprocessing Connection)
    torchrl: Any  # torchrl.weight_update.MultiProcessWeightSyncScheme, queues inside


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
    """Whether a worker's tensors are its own: none in shared memory, none aliased."""
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    return {
        "shared": sum(bool(t.is_shared()) for t in tensors.values()),
        "distinct_storages": len(set(ptrs)) == len(ptrs),
        "tensors": len(ptrs),
    }


@dataclass
class _Sessions:
    worker: int
    slots: dict[str, Slot]
    zmqsync: dict[str, tuple[Any, dict[str, torch.Tensor]]] = field(default_factory=dict)
    torchrl: dict[str, tuple[Any, nn.Module]] = field(default_factory=dict)

    def open_pipe(self, slot: str, scheme: Any, size: str, timeout: float) -> str:
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self.zmqsync[PIPE] = (scheme, state_dict)
        scheme.init_on_worker("policy", pipe=self.slots[slot].pipe, model=state_dict)
        scheme.connect(timeout=timeout)
        scheme.start_receiver_thread()
        return PIPE

    def open_zmq(self, scheme: Any, size: str, idx: int, timeout: float) -> str:
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self.zmqsync[ZMQ] = (scheme, state_dict)
        scheme.init_on_receiver(model_id="policy", model=state_dict, worker_idx=idx)
        scheme.connect(timeout=timeout)
        scheme.start_receiver_thread()
        return ZMQ

    def open_torchrl_mp(self, slot: str, size: str, idx: int, timeout: float) -> dict[str, Any]:
        scheme = self.slots[slot].torchrl
        module = module_view(make_state_dict(SIZES[size], fill="zeros"))
        # The scheme holds the model by weak reference: the session keeps it alive.
        self.torchrl[TORCHRL_MP] = (scheme, module)
        scheme.init_on_receiver(model_id="policy", model=module, worker_idx=idx)
        # Receives the first version from its queue (torchrl's own 10 s timeout), applies
        # it, starts torchrl's background receiver thread.
        scheme.connect()
        aliased = ownership(module_state(module))
        own_parameters(module)
        owned = ownership(module_state(module))
        if owned["shared"] or not owned["distinct_storages"]:
            raise RuntimeError(f"the torchrl worker's tensors are not its own: {owned}")
        return {"after_connect": aliased, "after_copy": owned}

    def digest(self, name: str) -> dict[str, Any]:
        if name in self.torchrl:
            _, module = self.torchrl[name]
            tensors = module_state(module)
            return {"digest": digest(tensors), "ownership": ownership(tensors)}
        scheme, state_dict = self.zmqsync[name]
        receiver = scheme.get_receiver()
        with scheme.lock:
            return {
                "digest": digest(state_dict),
                "ownership": ownership(state_dict),
                "version": receiver.version,
                "stats": dict(receiver.stats),
            }

    def close(self) -> int:
        closed = len(self.zmqsync) + len(self.torchrl)
        for scheme, _ in [*self.zmqsync.values(), *self.torchrl.values()]:
            with contextlib.suppress(Exception):
                scheme.shutdown()
        self.zmqsync.clear()
        self.torchrl.clear()
        return closed


def worker_main(
    worker: int,
    conn: Any,
    parent_pid: int,
    torch_threads: int | None,
    slots: dict[str, Slot],
) -> None:
    """Entry point of a spawned worker; returns (and the process ends) on "exit", when
    the control pipe breaks, or when the parent is gone."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    # Ctrl-C goes to the whole process group: the parent cleans up, workers just follow.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torchrl.weight_update  # noqa: F401  (imported now, not during a cell)

    import zmqsync  # noqa: F401

    sessions = _Sessions(worker, slots)
    try:
        while True:
            if not conn.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != parent_pid:
                    return
                continue
            try:
                command, args = conn.recv()
            except EOFError:
                return
            if command == "exit":
                return
            try:
                if command == "start":
                    reply: Any = "ready"
                elif command == "open_pipe":
                    reply = sessions.open_pipe(*args)
                elif command == "open_zmq":
                    reply = sessions.open_zmq(*args)
                elif command == "open_torchrl_mp":
                    reply = sessions.open_torchrl_mp(*args)
                elif command == "digest":
                    reply = sessions.digest(*args)
                elif command == "close":
                    reply = sessions.close()
                else:
                    raise ValueError(f"unknown command {command!r}")
            except Exception:  # the parent reports it, with this traceback
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", reply))
    except (EOFError, BrokenPipeError, OSError):
        return
    finally:
        sessions.close()
