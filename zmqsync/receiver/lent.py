"""A worker's tensors in memory it lends the learner's hub (one copy per worker).

The model's tensors move, once, into one :class:`~zmqsync.transport.shm.lent.LentMemory`
laid out as the version's stream (each tensor at its entry's offset), the way
``apply_mode="shared"`` re-points them at a hub's block: every tensor stays the object
it was (``tensor.set_``), keeps its values, and stays this worker's own, writable and
private (no other worker maps it). The hub then writes each version straight into it,
while this worker holds its lock.

A worker that stops trusting the hub to be done with the memory (the hub went quiet in
the middle of a write) moves its tensors away again (:meth:`LentTensors.take_back`: one
copy into private memory), so nothing the hub writes later reaches them.

The memfd's descriptor stays open only until the hub has written a version in: it has
the memory mapped then, and a mapping outlives the descriptor. Closed, the memory can
no longer be opened through ``/proc/PID/fd`` by anyone (another process of the worker's
user, or a peer naming it as its own): only ``/proc/PID/mem`` (the rights to trace the
worker) and ``/proc/PID/map_files`` (``CAP_SYS_ADMIN``) reach it. A hub that must map
it again (it forgot the worker: the learner restarted, or dropped it and took it back)
cannot: it answers the worker's go with a
:class:`~zmqsync.transport.shm.records.Written` saying the memory is unusable, and
after the version that then comes streamed the tensors move into a fresh memfd (one
copy, ``lent_renewed``), which the hub is told of. A hub that still maps the memory (it
only streamed a version to a worker that missed its go) is told the same memory again,
and nothing moves.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch

from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import WeightsSchema
from zmqsync.receiver.shared import Placements, check_shareable, owned_tensors
from zmqsync.tensors.extract import KeyPath
from zmqsync.transport.shm.lent import LentMemory, Where

__all__ = ["LentTensors", "LentVersions", "stream_bytes"]

log = logging.getLogger("zmqsync.receiver")

#: After a streamed version, a worker says again where its lent tensors lie (a hub that
#: forgot it learns it back) at most this often, unless the hub's ask was refused since.
RETELL_SECONDS: Final = 1.0
_DATA_PTR: Final = operator.methodcaller("data_ptr")
_SHAPE: Final = operator.attrgetter("shape")
_STRIDE: Final = operator.methodcaller("stride")


def stream_bytes(schema: WeightsSchema) -> int:
    """The bytes of a version of ``schema``: where its last tensor ends."""
    return max((e.offset + e.nbytes for e in schema.entries), default=0)


class LentTensors:
    """``model``'s tensors (and ``target``'s, its walk) moved into memory lent to the hub,
    each where a version of ``schema`` puts its bytes.

    Raises :class:`~zmqsync.errors.SchemaMismatchError` when a tensor cannot lie there
    (the conditions of ``apply_mode="shared"``: CPU, the model's own dtypes on the wire,
    aligned, not an inference tensor)."""

    def __init__(
        self, schema: WeightsSchema, model: Any, target: Mapping[KeyPath, torch.Tensor]
    ) -> None:
        check_shareable(schema, target, schema.strategy)
        nbytes = stream_bytes(schema)
        if nbytes <= 0:
            raise ValueError("a version with no bytes has nothing to lend")
        self.schema = schema
        self._placed = Placements(schema, owned_tensors(model, target))
        self.memory: LentMemory | None = LentMemory(nbytes)
        self._where = self.memory.where()
        self._move_onto(self.memory.array)
        #: Where each tensor moved: what :meth:`intact` checks.
        self._moved = [t for t, _, _, _ in self._placed.moves]
        self._ptrs = list(map(_DATA_PTR, self._moved))
        self._shapes = list(map(_SHAPE, self._moved))
        self._strides = list(map(_STRIDE, self._moved))

    def where(self) -> Where:
        """What the hub is told of the memory (it maps it with ``map_lent``): the same
        once its descriptor is closed (a hub that mapped it knows it by that)."""
        if self.memory is None:
            raise ValueError("the tensors were taken back: nothing is lent")
        return self._where

    @property
    def lent(self) -> bool:
        return self.memory is not None

    @property
    def can_be_opened(self) -> bool:
        """Whether a hub may still open the memory (its descriptor is open)."""
        return self.memory is not None and self.memory.fd >= 0

    def mapped(self) -> None:
        """The hub has the memory mapped (it wrote a version in): close the descriptor,
        so that nobody else opens it through ``/proc``. The tensors stay where they are,
        and the hub keeps writing into them."""
        if self.memory is not None:
            self.memory.close()

    def intact(self) -> bool:
        """Whether every tensor still lies where it was moved (nobody gave one other
        storage, ``p.data = ...``, or another shape since): only then may the hub write."""
        if self.memory is None:
            return False
        # C loops (map), not a Python step per tensor: thousands of tensors are common,
        # and this runs at every version.
        tensors = self._moved
        return (
            list(map(_DATA_PTR, tensors)) == self._ptrs
            and list(map(_SHAPE, tensors)) == self._shapes
            and list(map(_STRIDE, tensors)) == self._strides
        )

    def tensors(self) -> list[torch.Tensor]:
        """Each tensor lent, once."""
        return self._placed.tensors

    def take_back(self) -> None:
        """Move every tensor into private memory (their values copied once) and lend
        nothing more: what the hub may still write lands where no tensor reads."""
        memory, self.memory = self.memory, None
        if memory is None:
            return
        memory.close()
        self._move_onto(memory.array.copy())

    def _move_onto(self, array: np.ndarray) -> None:
        """Copy each tensor's values to its place in ``array``, then re-point it there."""
        storage = torch.from_numpy(array).untyped_storage()
        with torch.no_grad():
            for tensor, offset, shape, strides in self._placed.moves:
                view = torch.empty(0, dtype=tensor.dtype).set_(storage, offset, shape, strides)
                if view.data_ptr() != tensor.data_ptr():
                    view.copy_(tensor)
            for tensor, offset, shape, strides in self._placed.moves:
                tensor.set_(storage, offset, shape, strides)


class LentVersions:
    """One worker's lent tensors, as its applier uses them: lent once a version of a
    layout is held whole, the hub's ask answered (the lock held from the go until the
    hub says written, or until :attr:`gap` runs out), taken back when it must.

    Counts, in the receiver's stats: ``lent_applied`` (versions the hub wrote in),
    ``lent_refused`` (asks answered no: the tensors moved, a version in progress, an
    old version), ``lent_taken_back`` (the hub went quiet mid-write, or the model's
    tensors moved under it), ``lent_renewed`` (moved into fresh lent memory: the hub
    could not use the old memory, whose descriptor was closed once it mapped it),
    ``lent_still_writing`` (the hub asked again for a version it was writing in: a long
    write, the wait for its end started anew)."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats
        for key in (
            "lent_applied",
            "lent_refused",
            "lent_taken_back",
            "lent_renewed",
            "lent_still_writing",
        ):
            stats.setdefault(key, 0)
        self.tensors: LentTensors | None = None
        #: The layout digest the tensors are laid out for.
        self.layout = b""
        #: ``(version, epoch, deadline)`` from a go until the hub's written.
        self.pending: tuple[int, int, float] | None = None
        #: When the hub was last told where the tensors lie (lend), if since then it
        #: asked for nothing they refused.
        self._said_at = float("-inf")
        #: The hub could not use the memory, whose descriptor is closed: lend other.
        self._renew = False

    def said_lately(self, layout: bytes, now: float) -> bool:
        """Whether the hub was told where the tensors of ``layout`` lie less than
        :data:`RETELL_SECONDS` ago, and nothing was refused since: no need to check them
        and say it again after a streamed version (the check walks every tensor: for
        thousands of small ones, which the hub streams, it cost as much as the copy)."""
        return (
            self.tensors is not None
            and self.layout == layout
            and now - self._said_at < RETELL_SECONDS
        )

    def lend(
        self, schema: WeightsSchema, layout: bytes, model: Any, target: Mapping[KeyPath, Any]
    ) -> tuple[Where, bool] | None:
        """Move the tensors into lent memory for versions of ``layout`` (call under the
        worker's lock), unless they lie there already; where they are and whether they
        moved now, or None if they cannot be lent."""
        self._said_at = time.monotonic()
        held = self.tensors
        if held is not None and self.layout == layout and held.intact():
            if not self._renew:
                return held.where(), False  # lent already, for this layout
            # The hub forgot this memory, and cannot open it again (its descriptor was
            # closed once mapped): fresh memory, moved into straight from the old one.
            self._renew = False
            self._stats["lent_renewed"] += 1
        else:
            self.take_back(count=False)
        try:
            self.tensors = LentTensors(schema, model, target)
        except (SchemaMismatchError, ValueError, OSError) as exc:
            log.debug("the model's tensors cannot be lent: %s", exc)
            return None
        self.layout = layout
        return self.tensors.where(), True

    def unusable(self) -> None:
        """The hub could not use the memory lent (it answered a go so): if its descriptor
        is closed (a hub mapped it, and this one cannot open it), lend fresh memory after
        the next whole version. One still open was refused for what it is, and fresh
        memory would be refused alike: the hub streams to this worker from then on."""
        if self.tensors is not None and not self.tensors.can_be_opened:
            self._renew = True
            self._said_at = float("-inf")

    def may_write(self, layout: bytes) -> bool:
        """Whether the hub may write a version of ``layout`` into the tensors now."""
        ok = (
            self.pending is None
            and self.tensors is not None
            and self.layout == layout
            and self.tensors.intact()
        )
        if not ok:
            self._stats["lent_refused"] += 1
            self._said_at = float("-inf")  # the next whole version says it anew
        return ok

    def take_back(self, *, count: bool = True) -> bool:
        """Move the tensors out of the lent memory (one copy); True if they were lent."""
        tensors, self.tensors, self.pending = self.tensors, None, None
        self._renew = False
        if tensors is None:
            return False
        tensors.take_back()
        if count:
            self._stats["lent_taken_back"] += 1
        return True

    def still_writing(self, version: int, epoch: int, until: float) -> bool:
        """The hub asked again for ``version``, which it was told go for: it is alive and
        still writing it in (a large model, many workers), so the lock is held until
        ``until`` now. False if that is not the version it holds its lock for."""
        if self.pending is None or self.pending[:2] != (version, epoch):
            return False
        self.pending = (version, epoch, until)
        self._stats["lent_still_writing"] += 1
        return True

    def written(self) -> None:
        self.pending = None
        self._stats["lent_applied"] += 1
        if self.tensors is not None:
            self.tensors.mapped()  # the hub wrote it: it has it mapped
            # The hub's write bumped no tensor's version counter: a backward pass through
            # a graph saved before it must raise, as it would after a copy_.
            bump = getattr(torch.autograd.graph, "increment_version", None)
            if bump is not None:
                bump(self.tensors.tensors())
