"""Ray actors of the transports benchmark (issue 3): each hosts the zmqsync Ray
receivers, a torchrl Ray receiver and the ray-store peer, one cell at a time.

The actor class gives each scheme what it calls on an actor:

- zmqsync's ``RayWeightSyncScheme`` calls ``zmqsync_deliver`` (from
  :class:`zmqsync.WeightSyncActorMixin`); the receiver applies each version there. Each
  zmqsync Ray variant registers under its own name (the scheme's model id, which names
  its channel), so several can share the actors.
- torchrl's ``RayWeightSyncScheme`` calls ``_connect_weights_scheme`` (join the gloo
  process group, receive the first version) and ``_receive_weights_scheme`` (receive
  one version over gloo and apply it). These are written the way torchrl's collectors
  write them (``torchrl/collectors/_base.py``): loop over the registered receiver
  schemes and call ``scheme.connect(worker_idx=...)`` / ``scheme.receive()``. The actor
  is the scheme's context, as a collector is, and has the ``worker_idx`` it reads.
- ray-store calls ``store_apply`` with the ``ObjectRef`` of the version's flat buffer,
  which Ray resolves to a zero-copy, read-only numpy view of the object in its store;
  the actor copies it into its own tensors (:class:`benchmarks._peers.FlatLayout`).

Actors are threaded (``max_concurrency=4``): zmqsync's sender polls an idle actor every
quarter second while the other variant's block runs, and such a poll must not queue
behind torchrl's receive call (nor the other way round); and a torchrl call stuck in an
actor (its gloo waits have no deadline of ours) must not starve zmqsync's calls.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks._memory import give_back_freed
from benchmarks._models import SIZES, digest, make_state_dict
from benchmarks._peers import FlatLayout
from benchmarks._transports_spec import RAY_STORE, TORCHRL_RAY
from benchmarks._transports_worker import module_state, module_view, ownership
from zmqsync import WeightSyncActorMixin


class BenchActor(WeightSyncActorMixin):
    """One worker of the Ray variants (wrap with ``ray.remote(...)``)."""

    def __init__(self, worker_idx: int, torch_threads: int | None) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.worker_idx = worker_idx  # torchrl reads it from its context
        self.policy: nn.Module | None = None
        self._receiver_schemes: dict[str, Any] = {}
        self._zmqsync: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        self._store: tuple[FlatLayout, dict[str, torch.Tensor]] | None = None
        # ray-store's buffers arrive read-only; they are only read.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def ready(self) -> int:
        return os.getpid()

    # --- zmqsync -------------------------------------------------------------------

    def open_zmqsync(self, name: str, scheme: Any, size: str, options: dict[str, Any]) -> str:
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self._zmqsync[name] = (scheme, state_dict)
        # Returns at once; the actor joins on the sender's calls.
        scheme.init_on_worker(name, model=state_dict, **options)
        return name

    # --- ray-store -----------------------------------------------------------------

    def open_store(self, size: str) -> str:
        state_dict = make_state_dict(SIZES[size], fill="zeros")
        self._store = (FlatLayout(list(state_dict.values())), state_dict)
        return RAY_STORE

    def store_apply(self, flat: np.ndarray) -> int:
        """Copy one version (Ray resolved its ObjectRef to a view into its store) into
        this actor's tensors."""
        assert self._store is not None, "no ray-store session is open"
        layout, _ = self._store
        layout.unpack(layout.split(torch.from_numpy(flat)))
        return len(flat)

    # --- torchrl (what its collectors do) ------------------------------------------

    def open_torchrl(self, scheme: Any, size: str) -> str:
        """``register_scheme_receiver({"policy": scheme}, synchronize_weights=False)``."""
        self.policy = module_view(make_state_dict(SIZES[size], fill="zeros"))
        scheme.init_on_receiver(
            model_id="policy", context=self, model=self.policy, worker_idx=self.worker_idx
        )
        self._receiver_schemes = {"policy": scheme}
        return TORCHRL_RAY

    def _connect_weights_scheme(self, model_version: int | None = None) -> None:
        for scheme in self._receiver_schemes.values():
            if not scheme.synchronized_on_receiver:
                scheme.connect(worker_idx=self.worker_idx)

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:
        for scheme in self._receiver_schemes.values():
            scheme.receive()

    # --- both ----------------------------------------------------------------------

    def digest(self, name: str) -> dict[str, Any]:
        if name == TORCHRL_RAY:
            assert self.policy is not None, "no torchrl session is open"
            tensors = module_state(self.policy)
            return {"digest": digest(tensors), "ownership": ownership(tensors)}
        if name == RAY_STORE:
            assert self._store is not None, "no ray-store session is open"
            tensors = self._store[1]
            return {"digest": digest(tensors), "ownership": ownership(tensors)}
        scheme, state_dict = self._zmqsync[name]
        with scheme.lock:
            return {
                "digest": digest(state_dict),
                "ownership": ownership(state_dict),
                "version": scheme.get_receiver().version,
            }

    def close(self) -> int:
        closed = len(self._zmqsync) + (self._store is not None)
        for scheme, _ in self._zmqsync.values():
            with contextlib.suppress(Exception):
                scheme.shutdown()
        self._zmqsync = {}
        self._store = None
        for scheme in self._receiver_schemes.values():
            with contextlib.suppress(Exception):
                scheme.shutdown()
            closed += 1
        self._receiver_schemes = {}
        self.policy = None
        give_back_freed()  # what the sessions held is free for the cell's next ones
        return closed
