"""The learner's side of lent tensors: a worker's lent memory, written from the model.

A worker on the learner's host may lend the memory its tensors live in (see
:mod:`zmqsync.receiver.lent`); the hub maps it (``map_lent``) and the learner writes each
version straight into it, from its own tensors: one copy per worker and none of its
own, with streaming stores where the C extension is built (the learner never reads
those bytes again: :mod:`zmqsync.tensors.streaming`), else on torch's thread pool.

Many small tensors (norms, biases: under :data:`SMALL_BYTES` each, as the stream packs
them) lie side by side at the end of the stream. They are gathered once per version into
one buffer laid out as that stretch (:meth:`LentPlan.gather`), and each worker then gets
the stretch in one copy: a copy of a few thousand tensors per worker would cost more than
the bytes.

Several workers that said go together are written together (:meth:`LentTarget.write_all`),
block by block: each block of the model is read from memory once and copied into every
worker while it is still in the cache, where one worker after the other read the whole
model from memory each time (with torch's copies, 128 MiB to 2, 4 and 8 targets on 2
cores: 12.5, 15.7 and 32 ms against 15.1, 20.5 and 44 ms; the streaming copies block
the same way inside each call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import numpy as np
import torch

from zmqsync.protocol import WeightsSchema
from zmqsync.tensors import streaming
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.flatten import DEFAULT_PACK_THRESHOLD
from zmqsync.tensors.streaming import fan_out
from zmqsync.tensors.views import torch_dtype
from zmqsync.transport.base import Lends, PeerId

__all__ = [
    "FAN_OUT_BLOCK",
    "LENT_NOTE_SECONDS",
    "PIECEWISE_BYTES",
    "SMALL_BYTES",
    "Gathered",
    "LentPlan",
    "LentTarget",
    "StillWriting",
]

#: Tensors smaller than this are gathered once per version, then copied as one stretch.
SMALL_BYTES: Final = DEFAULT_PACK_THRESHOLD
#: A tensor larger than this is written into several workers at once in blocks of this
#: many bytes, each read once and copied to every worker while cached (the last-level
#: cache of a server holds a few; measured on 2 cores: 4 and 8 MiB alike, 1 MiB slower).
FAN_OUT_BLOCK: Final = 4 * 1024 * 1024
#: A version of this many bytes or more is written piece by piece (pieces of this size
#: into one worker), the sender told between pieces (:meth:`LentTarget.write_all`); a
#: smaller one goes into one worker in one call.
PIECEWISE_BYTES: Final = 64 * 1024 * 1024
#: While workers hold their locks for a version being written into their lent tensors,
#: the sender asks them again this often (seconds): the version is still going in, so a
#: write that takes longer than a worker's ``chunk_timeout`` (a large model, many
#: workers) is not taken for a learner gone quiet, from which the worker would take its
#: tensors back.
LENT_NOTE_SECONDS: Final = 0.1
#: What :meth:`LentPlan.gather` returns: the large tensors, and the small ones' stretch.
Gathered = tuple[list[torch.Tensor], torch.Tensor]


def _nothing() -> None:
    pass


def _view(
    flat: torch.Tensor, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    return flat[offset : offset + nbytes].view(torch_dtype(dtype)).view(shape)


class LentPlan:
    """How a version of ``schema`` is written into lent memory: its large tensors one by
    one, its small ones as one stretch ``[lo, hi)`` of the stream, gathered here first."""

    def __init__(self, schema: WeightsSchema) -> None:
        for e in schema.entries:
            if e.wire or e.buffer != 0:
                raise ValueError(f"{e.dotted_key} is not written as it is, in one stream")
        self.schema = schema
        self.total = max((e.offset + e.nbytes for e in schema.entries), default=0)
        small = [e for e in schema.entries if e.nbytes < SMALL_BYTES]
        large = [e for e in schema.entries if e.nbytes >= SMALL_BYTES]
        lo = min((e.offset for e in small), default=0)
        hi = max((e.offset + e.nbytes for e in small), default=0)
        if len(small) < 2 or any(e.offset < hi and e.offset + e.nbytes > lo for e in large):
            large, small, lo, hi = list(schema.entries), [], 0, 0  # no stretch of their own
        self.large = [(e.key, e.offset, e.nbytes, e.dtype, _shape(e.shape)) for e in large]
        #: The bytes of the tensors copied one by one (the stretch's are gathered first).
        self.large_bytes = sum(e.nbytes for e in large)
        self.lo, self.hi = lo, hi
        self._small = small
        self._small_keys = [e.key for e in small]
        #: The small tensors' stretch, and views of it; made at the first gather (a plan
        #: the sender never writes with costs no memory).
        self._stretch = torch.empty(0, dtype=torch.uint8)
        self._small_views: list[torch.Tensor] = []

    def gather(
        self, tensors: Mapping[KeyPath, torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The large tensors, in order, and the small ones' stretch (gathered now)."""
        if self._small_keys:
            if not self._small_views:
                self._stretch = torch.empty(self.hi - self.lo, dtype=torch.uint8)
                self._small_views = [
                    _view(self._stretch, e.offset - self.lo, e.nbytes, e.dtype, _shape(e.shape))
                    for e in self._small
                ]
            with torch.no_grad():
                torch._foreach_copy_(self._small_views, [tensors[k] for k in self._small_keys])
        return [tensors[k] for k, _, _, _, _ in self.large], self._stretch


class LentTarget:
    """A worker's lent memory (``mapped``, exactly a version's bytes) as the tensors and
    the stretch of ``plan``."""

    def __init__(self, mapped: np.ndarray, plan: LentPlan) -> None:
        if mapped.dtype != np.uint8 or mapped.nbytes != plan.total or not mapped.flags.writeable:
            raise ValueError(
                f"lent memory of {mapped.nbytes} bytes for a {plan.total}-byte version"
            )
        flat = torch.from_numpy(mapped)
        self.plan = plan
        self.schema = plan.schema
        #: The memory written into (the hub's mapping of what the worker lent).
        self.memory = mapped
        #: The large tensors' places in the memory, in the plan's order.
        self.views = [_view(flat, off, n, dtype, shape) for _, off, n, dtype, shape in plan.large]
        #: The small tensors' stretch in the memory.
        self.stretch = flat[plan.lo : plan.hi]

    def write(self, gathered: Gathered, still_writing: Callable[[], object] = _nothing) -> None:
        """Copy a version in: what :meth:`LentPlan.gather` returned for it;
        ``still_writing()`` is called between pieces of a large version (see
        :meth:`write_all`)."""
        large, stretch = gathered
        with torch.no_grad():
            if self.plan.total < PIECEWISE_BYTES:
                still_writing = _nothing  # one piece, written in one call
            _copy_in_blocks([[v] for v in self.views], large, still_writing, PIECEWISE_BYTES)
            if len(stretch):
                fan_out([[self.stretch]], [stretch])

    @staticmethod
    def write_all(
        targets: Sequence[LentTarget],
        gathered: Gathered,
        still_writing: Callable[[], object] = _nothing,
    ) -> None:
        """Copy a version into every one of ``targets`` (all of one plan), block by block:
        a block of the model is read once and written to each target in turn.

        ``still_writing()`` is called between blocks of a version of
        :data:`PIECEWISE_BYTES` or more (the sender tells the workers, who hold their
        locks, that it is alive and writing: a write that takes longer than a worker's
        ``chunk_timeout`` is not taken for a learner gone quiet)."""
        if len(targets) == 1:
            targets[0].write(gathered, still_writing)
            return
        large, stretch = gathered
        with torch.no_grad():
            into = [[t.views[i] for t in targets] for i in range(len(large))]
            if targets[0].plan.total < PIECEWISE_BYTES:
                still_writing = _nothing
            # Streaming copies keep each block in the cache themselves (see
            # zmqsync.tensors.streaming): the pieces need only be as small as the calls
            # to still_writing() need them.
            block = PIECEWISE_BYTES if streaming.AVAILABLE else FAN_OUT_BLOCK
            _copy_in_blocks(into, large, still_writing, block)
            if len(stretch):
                fan_out([[t.stretch for t in targets]], [stretch])


class StillWriting:
    """Tells the workers in ``holding`` (those that said go for ``version`` and hold
    their locks) that it is still going in, by asking them again, at most every
    :data:`LENT_NOTE_SECONDS`: called between the pieces of a write, and while the
    first to say go waits for the others."""

    def __init__(
        self,
        hub: Lends,
        holding: Mapping[PeerId, object],
        version: int,
        epoch: int,
        layout: bytes,
    ) -> None:
        self._hub = hub
        self._holding = holding
        self._ask = (version, epoch, layout)
        self._due = time.monotonic() + LENT_NOTE_SECONDS

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._due or not self._holding:
            return
        self._due = now + LENT_NOTE_SECONDS
        for peer in self._holding:
            self._hub.ask_lent(peer, *self._ask)


def _copy_in_blocks(
    dests: Sequence[Sequence[torch.Tensor]],
    sources: Sequence[torch.Tensor],
    between: Callable[[], object],
    block: int,
) -> None:
    """Copy each of ``sources`` into each of its ``dests`` (same shapes) in pieces of
    about ``block`` bytes: tensors smaller than that grouped into one call, a larger
    contiguous one cut into blocks (each read once and written to every destination
    while cached); ``between()`` is called after each piece."""
    group_dests: list[Sequence[torch.Tensor]] = []
    group_sources: list[torch.Tensor] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if group_sources:
            fan_out(group_dests, group_sources)
            group_dests.clear()
            group_sources.clear()
            held = 0
            between()

    for into, src in zip(dests, sources, strict=True):
        if src.nbytes <= block or not src.is_contiguous():
            group_dests.append(into)
            group_sources.append(src)
            held += src.nbytes
            if held >= block:
                flush()
            continue
        flush()
        flat, flats = src.view(-1), [d.view(-1) for d in into]
        step = block // src.element_size()
        for lo in range(0, flat.numel(), step):
            fan_out([[d[lo : lo + step] for d in flats]], [flat[lo : lo + step]])
            between()
    flush()


def _shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(n) for n in shape)
