"""A rank's sliced workers (tensor-parallel workers that hold one box of each tensor):
the slices each declared in its Hello, and each version cut for them.

Owned by the sender, used from its pumps and its sending thread (under its own lock).
A worker's declaration is kept by its peer on its hub; a cut is made once per version
and declaration (workers holding the same slices share it) and kept while it is the
latest, to serve repairs and late joiners as the snapshot serves the others.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import numpy as np

from zmqsync.chunking.layout import StreamLayout
from zmqsync.chunking.slices import cut
from zmqsync.protocol import Slice, WeightsSchema
from zmqsync.sender.transfers import Copy
from zmqsync.transport.base import PeerId
from zmqsync.vocabulary import Metadata

__all__ = ["MAX_DECLARATIONS", "MAX_SLICED_WORKERS", "SlicedWorkers"]

#: Sliced workers one rank serves (the table of their declarations is bounded).
MAX_SLICED_WORKERS: Final = 256
#: Distinct declarations one rank cuts for: each costs it a cut of every version, kept
#: (up to its part's bytes), so hostile Hellos declaring ever other slices are refused
#: here. Workers holding the same slices share a cut: a fleet of tensor-parallel
#: replicas of degree T needs T.
MAX_DECLARATIONS: Final = 16

Where = tuple[int, PeerId]  # a hub's index and a peer on it
#: What makes a copy of a cut stream: (version, layout, bytes, metadata) -> Copy.
MakeCopy = Callable[[int, StreamLayout, np.ndarray, Metadata | None], Copy]


class SlicedWorkers:
    """The slices declared by each sliced worker's peer, and the latest cut per
    declaration. ``chunk_bytes``: the chunks a cut streams in."""

    def __init__(self, chunk_bytes: int, make_copy: MakeCopy) -> None:
        self._chunk_bytes = chunk_bytes
        self._make_copy = make_copy
        self._declared: OrderedDict[Where, tuple[Slice, ...]] = OrderedDict()
        #: Per declaration: the copy it was cut from, and the cut.
        self._cuts: dict[tuple[Slice, ...], tuple[Copy, Copy]] = {}
        self._lock = threading.Lock()
        #: Declarations refused (malformed for this model, or too many workers).
        self.refused = 0

    def __len__(self) -> int:
        return len(self._declared)

    def declare(
        self, hub: int, peer: PeerId, slices: Sequence[Slice], schema: WeightsSchema | None
    ) -> str | None:
        """Record what the worker at ``peer`` said it holds (nothing: the whole model);
        the reason it is refused, if it is. ``schema``: this rank's latest part, against
        which the slices are checked (each of a tensor's global shape)."""
        where = (hub, peer)
        with self._lock:
            if not slices:
                self._forget(where)
                return None
            declared = tuple(slices)
            reason = _mismatch(slices, schema) or self._full(where, declared)
            if reason is not None:
                self.refused += 1
                return reason
            if self._declared.get(where) != declared:
                self._forget(where)  # what it declared before, and its cut
            self._declared[where] = declared
            return None

    def _full(self, where: Where, declared: tuple[Slice, ...]) -> str | None:
        """Why one more declaration is not taken (holding the lock), or None."""
        if where not in self._declared and len(self._declared) >= MAX_SLICED_WORKERS:
            return f"this rank serves at most {MAX_SLICED_WORKERS} sliced workers"
        others = {d for w, d in self._declared.items() if w != where}
        if declared not in others and len(others) >= MAX_DECLARATIONS:
            return f"this rank cuts its part for at most {MAX_DECLARATIONS} distinct slicings"
        return None

    def forget(self, hub: int, peer: PeerId) -> None:
        """The peer left: it holds no slices any more."""
        with self._lock:
            self._forget((hub, peer))

    def _forget(self, where: Where) -> None:
        declared = self._declared.pop(where, None)
        if declared is not None and declared not in self._declared.values():
            self._cuts.pop(declared, None)

    def sliced(self, hub: int, peers: Iterable[PeerId]) -> list[PeerId]:
        """Those of ``peers`` (on hub ``hub``) that hold slices."""
        with self._lock:
            return [p for p in peers if (hub, p) in self._declared]

    def peers(self, hub: int) -> list[PeerId]:
        """Every sliced worker's peer on hub ``hub``."""
        with self._lock:
            return [p for h, p in self._declared if h == hub]

    def cut_for(self, hub: int, peer: PeerId, copy: Copy) -> Copy | None:
        """``copy`` (a whole one) cut for the worker at ``peer``, or None if it holds no
        slices, or ``copy``'s bytes can no longer be read whole."""
        with self._lock:
            declared = self._declared.get((hub, peer))
            if declared is None:
                return None
            made = self._cuts.get(declared)
            if made is not None and made[0] is copy:
                return made[1]
        if copy.data is None or not copy.readable:
            return None
        copy.write_through(copy.count - 1)
        made_cut = cut(copy.layout.schema, copy.data, {s.key: s for s in declared})
        layout = StreamLayout.received(made_cut.schema, self._chunk_bytes)
        sliced = self._make_copy(copy.version, layout, made_cut.data, copy.metadata)
        with self._lock:
            if declared in self._declared.values():
                self._cuts[declared] = (copy, sliced)
        return sliced


def _mismatch(slices: Sequence[Slice], schema: WeightsSchema | None) -> str | None:
    """Why ``slices`` do not fit this rank's tensors, or None. A tensor this rank does
    not send (another rank's replica) cannot be checked here; its sender checks it."""
    if schema is None:
        return None
    shapes = {e.key: e.box.shape if e.box is not None else e.shape for e in schema.entries}
    for s in slices:
        shape = shapes.get(s.key)
        if shape is not None and shape != s.shape:
            return (
                f"a slice of tensor {s.dotted_key!r} of shape {s.shape}, which is of shape "
                f"{shape} at the learner"
            )
    return None
