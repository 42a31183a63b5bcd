"""Workers that share one read-only copy of each version (``apply_mode="shared"``).

On the learner's host a version already lies whole in one shared-memory block the hub
lends (the sender's snapshot), and every worker maps that block read-only. A worker in
this mode copies nothing: once the last chunk is in, the model's tensors are moved onto
their bytes in the block, under the worker's lock. The first version moves each tensor
(``tensor.set_(storage, offset, shape, strides)``), onto one storage; later versions move
that storage onto the new block in one step, and every tensor (and view of one) on it
follows. The tensors stay the objects they were; their memory is the learner's one copy.

The block stays leased while any view of it lives: the views made here hold the frames
the transport lent (and the transport tells the hub a block is free only once every such
frame is garbage), so the hub never rewrites a version a worker still holds, even one a
tensor left off the storage that moves still reads. Moving on to the next version lets go
of the last.

A version that did not come whole in one block (sent inline: the hub had no block free,
or dropped this worker) is copied once into private memory that is then made read-only,
so the model behaves alike either way: a write into its tensors is a fault of this
worker (``SIGSEGV``), never a change to another worker's weights.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch
from tensordict import TensorDictBase

from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import Buffer, WeightsSchema
from zmqsync.tensors.extract import KeyPath
from zmqsync.tensors.fit import check_fits
from zmqsync.tensors.views import address, read_only_storage, torch_dtype

__all__ = ["SHARED_MODE", "Placements", "SharedVersion", "check_shareable", "owned_tensors"]

#: The ``apply_mode`` that turns this on.
SHARED_MODE: Final = "shared"
_PROT_READ: Final = 0x1


def _can_swap() -> bool:
    """Whether this torch can move a storage onto other bytes in place (every tensor on
    it follows) and count that as an in-place change of many tensors in one call; older
    releases get each tensor moved on its own."""
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return False
    try:
        torch.autograd.graph.increment_version([torch.empty(0)])
    except (AttributeError, TypeError):
        return False
    return True


_SWAP: Final = _can_swap()


def check_shareable(
    schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
) -> None:
    """Raise :class:`SchemaMismatchError` unless every tensor of ``target`` can become a
    view of the version's bytes: the schema fits, nothing was cast on the wire (the
    bytes are not the tensor's), every tensor is on the CPU, one buffer holds them, each
    at an offset aligned for its dtype, and torch lets its storage change (not an
    inference tensor)."""
    check_fits(schema, target, strategy)
    for e in schema.entries:
        if e.wire:
            raise SchemaMismatchError(
                f"apply_mode='shared' maps the learner's bytes as they are; {e.dotted_key} "
                f"travels as {e.wire} (a wire_dtype): send the model's own dtypes"
            )
        if e.buffer != 0:
            raise SchemaMismatchError("apply_mode='shared' needs the version in one stream")
        tensor = target[e.key]
        if tensor.device.type != "cpu":
            raise SchemaMismatchError(
                f"apply_mode='shared' maps host memory; {e.dotted_key} is on {tensor.device}"
            )
        if e.offset % tensor.element_size():
            raise SchemaMismatchError(
                f"{e.dotted_key} lies at byte {e.offset} of the version, not aligned for "
                f"{e.dtype}: it cannot be viewed where it lies"
            )
        if tensor.is_inference():
            raise SchemaMismatchError(
                f"apply_mode='shared' gives each tensor new storage, and {e.dotted_key} is an "
                "inference tensor (made under torch.inference_mode), whose storage torch does "
                "not let change: build the model outside inference_mode"
            )


def owned_tensors(
    model: Any, target: Mapping[KeyPath, torch.Tensor]
) -> dict[str, list[torch.Tensor]]:
    """Every tensor to re-point per dotted name: ``target``'s (a strategy's extraction
    hands out detached aliases, kept between versions: left on the old memory they would
    pin its block) and the model's own tensor of that name, a module's parameter or
    buffer, a dict's or a TensorDict's leaf (re-pointing an alias alone would leave the
    model's own tensor where it was: the user's dict would keep its old weights)."""
    owned: dict[str, list[torch.Tensor]] = {".".join(k): [t] for k, t in target.items()}
    if isinstance(model, torch.nn.Module):
        for name, param in model.named_parameters(remove_duplicate=False):
            _add(owned, name, param)
        for name, buf in model.named_buffers(remove_duplicate=False):
            if buf is not None:
                _add(owned, name, buf)
    elif isinstance(model, TensorDictBase):
        for key, leaf in model.items(include_nested=True, leaves_only=True):
            if isinstance(leaf, torch.Tensor):
                _add(owned, key if isinstance(key, str) else ".".join(key), leaf)
    elif isinstance(model, Mapping):
        _add_leaves(owned, model, ())
    return owned


def _add_leaves(
    owned: dict[str, list[torch.Tensor]], mapping: Mapping[Any, Any], prefix: tuple[str, ...]
) -> None:
    """A (nested) dict's own tensors, by dotted name, as the extraction names them."""
    for key, value in mapping.items():
        path = (*prefix, str(key))
        if isinstance(value, torch.Tensor):
            _add(owned, ".".join(path), value)
        elif isinstance(value, Mapping):
            _add_leaves(owned, value, path)


def _add(owned: dict[str, list[torch.Tensor]], name: str, tensor: torch.Tensor) -> None:
    tensors = owned.setdefault(name, [])
    if all(t is not tensor for t in tensors):
        tensors.append(tensor)


def _read_only_copy(pieces: list[tuple[int, np.ndarray]], total: int) -> np.ndarray:
    """``pieces`` (offset, bytes) gathered into fresh private memory that is then made
    read-only (a write into it faults, as one into a shared block would)."""
    mapped = mmap.mmap(-1, max(total, 1))
    out = np.frombuffer(mapped, dtype=np.uint8)[:total]
    for offset, payload in pieces:
        np.copyto(out[offset : offset + len(payload)], payload)
    at = ctypes.c_void_p(address(out))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(at, ctypes.c_size_t(max(total, 1)), _PROT_READ) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of a private copy failed")
    out.flags.writeable = False
    return out


def _in_one_block(pieces: list[tuple[int, np.ndarray]], total: int) -> np.ndarray | None:
    """The ``total`` bytes of a version whose ``pieces`` (offset, bytes) all lie in one
    read-only mapping (a hub's block, not a transport's private buffer) where the stream
    puts them, as one fresh array over the mapping; None if they do not."""
    if not pieces:
        return None
    first_offset, first = pieces[0]
    start = address(first) - first_offset
    owner = first.base
    if not isinstance(owner, np.ndarray) or owner.flags.writeable:
        return None
    if not all(p.base is owner and address(p) == start + off for off, p in pieces):
        return None
    begin = start - address(owner)
    if begin < 0 or begin + total > owner.nbytes:
        return None
    # Its base is a memoryview, so views of it keep it (not the mapping alone) alive.
    return np.frombuffer(memoryview(owner[begin : begin + total].data), np.uint8)


def _may_hold_whole(piece: np.ndarray, offset: int, total: int) -> bool:
    """Whether the read-only mapping ``piece`` (the bytes at ``offset`` of a version of
    ``total`` bytes) lies in is large enough to hold the whole version where the stream
    puts it: a snapshot written once, that the sender never writes again (kept until
    the next version). A smaller block is one chunk's buffer, reused by the sender."""
    owner = piece.base
    if not isinstance(owner, np.ndarray) or owner.flags.writeable:
        return False
    begin = address(piece) - offset - address(owner)
    return begin >= 0 and begin + total <= owner.nbytes


class SharedVersion:
    """The version in progress (its chunks' frames, kept) and the version held (what
    pins its memory). Owned by one :class:`~zmqsync.receiver.applying.Applier`; fed on
    its thread; :meth:`install` runs under the worker's lock."""

    def __init__(self, borrowed: Callable[[Buffer], bool], stats: dict[str, Any]) -> None:
        self._borrowed = borrowed
        self._stats = stats
        stats.setdefault("shared_mapped", 0)
        stats.setdefault("shared_copied", 0)
        self._total = 0
        #: (stream offset, bytes) of each chunk of the version in progress: lent frames
        #: as they came (they keep their block leased), others copied at once (a
        #: transport may reuse its own receive buffers).
        self._pieces: list[tuple[int, np.ndarray]] = []
        self._all_lent = True
        #: The lent frames of the version in progress, as the transport handed them.
        self._frames: list[Buffer] = []
        #: What keeps the held version's memory (its frames, or the private copy).
        self._held: np.ndarray | None = None
        #: The schema and model walk last found shareable, and the tensors to re-point
        #: for that walk (both the same objects from version to version while the model
        #: and the layout stay as they are: checked and gathered once, not per version).
        self._checked: tuple[WeightsSchema, Mapping[KeyPath, torch.Tensor]] | None = None
        self._owned: tuple[Mapping[KeyPath, torch.Tensor], dict[str, list[torch.Tensor]]] | None
        self._owned = None
        #: Where each tensor goes in a version's bytes, for one schema and one set of
        #: tensors to re-point: worked out once, not at every version.
        self._placed: (
            tuple[WeightsSchema, Mapping[str, Sequence[torch.Tensor]], Placements] | None
        ) = None
        #: The storage every tensor of ``_placed`` lies in, since the install that moved
        #: them all onto it (None until then): later versions move it, not each tensor.
        self._storage: torch.UntypedStorage | None = None

    def check(
        self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
    ) -> None:
        """:func:`check_shareable`, unless this schema and this walk of the model passed
        it already."""
        checked = self._checked
        if checked is None or checked[0] is not schema or checked[1] is not target:
            check_shareable(schema, target, strategy)
            self._checked = (schema, target)

    def start(self, total: int) -> None:
        """A version of ``total`` bytes begins."""
        self._total = total
        self._pieces = []
        self._frames = []
        self._all_lent = True

    def piece(self, offset: int, payload: Buffer) -> None:
        """Keep one chunk's bytes (a view, if the transport lent them)."""
        if not len(payload):
            return
        view = np.frombuffer(payload, dtype=np.uint8)
        if self._borrowed(payload) and _may_hold_whole(view, offset, self._total):
            self._pieces.append((offset, view))
            # The frame object itself: the transport releases its block once that
            # object is garbage (a numpy view of it would name the mapping instead).
            self._frames.append(payload)
        else:
            # Copied at once, its frame let go of: a transport may reuse its buffers, and
            # a block too small for the whole version is a sender's chunk buffer, which
            # it writes again once this worker has seen the chunk.
            self._all_lent = False
            self._pieces.append((offset, view.copy()))

    def abandon(self) -> None:
        """The version in progress will not complete: let its frames go."""
        self._pieces = []
        self._frames = []

    def _whole(self) -> np.ndarray:
        """The version's bytes in one array: the lent block itself when every chunk lies
        in it where the stream puts it, else a read-only private copy."""
        pieces, frames, total = self._pieces, self._frames, self._total
        self._pieces, self._frames = [], []
        if self._all_lent:
            whole = _in_one_block(pieces, total)
            if whole is not None:
                # The lent frames live as long as the array (and every view of it): the
                # transport tells the hub their block is free only once they are gone.
                weakref.finalize(whole, _let_go, frames)
                self._stats["shared_mapped"] += 1
                return whole
        self._stats["shared_copied"] += 1
        return _read_only_copy(pieces, total)

    def install(
        self, schema: WeightsSchema, model: Any, target: Mapping[KeyPath, torch.Tensor]
    ) -> None:
        """Re-point every tensor of ``model`` and of ``target``, its walk (see
        :func:`owned_tensors`), at its bytes of the version just completed (call under
        the worker's lock). The tensors stay the same objects."""
        owned = self._owned
        if owned is None or owned[0] is not target:
            owned = self._owned = (target, owned_tensors(model, target))
        self._repoint(schema, owned[1])

    def _repoint(self, schema: WeightsSchema, target: Mapping[str, Sequence[torch.Tensor]]) -> None:
        placed = self._placed
        if placed is None or placed[0] is not schema or placed[1] is not target:
            placed = self._placed = (schema, target, Placements(schema, target))
            self._storage = None  # these tensors do not all lie in one storage of ours yet
        whole = self._whole()  # the schema spans it exactly (checked when decoded)
        storage = read_only_storage(whole)  # read-only on purpose: a write faults
        current = self._storage
        if current is not None and _SWAP and current.nbytes() == storage.nbytes():
            # Every tensor lies in ``current`` where the last install put it (the model's
            # tensors were checked unchanged since: same objects, same addresses, else
            # this is a new walk and ``_storage`` was reset). Moving that one storage onto
            # the new bytes moves them all, and any view of them, in one step; ``storage``
            # leaves with the old bytes, which are let go of with it. Torch counts it as
            # an in-place change of each tensor, as set_ is counted: a backward pass
            # through a graph that saved one before the move raises.
            current._swap_data_ptr_(storage)  # type: ignore[attr-defined]
            torch.autograd.graph.increment_version(placed[2].tensors)
        else:
            with torch.no_grad():
                for tensor, offset, shape, strides in placed[2].moves:
                    tensor.set_(storage, offset, shape, strides)
            self._storage = storage
        self._held = whole  # the previous version's memory is let go of here

    def close(self) -> None:
        self.abandon()
        self._held = None
        self._checked = self._owned = self._placed = None
        self._storage = None


class Placements:
    """Where each tensor to re-point (per dotted name, ``target``) lies in a version of
    ``schema`` (which :func:`check_shareable` passed: dtypes and shapes fit, offsets
    aligned): ``moves``, per tensor its offset in its own elements, its shape and its
    contiguous strides."""

    __slots__ = ("moves", "tensors")

    def __init__(self, schema: WeightsSchema, target: Mapping[str, Sequence[torch.Tensor]]) -> None:
        self.moves: list[tuple[torch.Tensor, int, tuple[int, ...], tuple[int, ...]]] = []
        for e in schema.entries:
            shape = tuple(int(n) for n in e.shape)
            strides = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                strides[i] = strides[i + 1] * max(shape[i + 1], 1)
            offset = e.offset // torch_dtype(e.dtype).itemsize
            self.moves.extend((t, offset, shape, tuple(strides)) for t in target[e.dotted_key])
        #: Each tensor once (a tied weight has two names).
        self.tensors = list({id(t): t for t, _, _, _ in self.moves}.values())


def _let_go(frames: list[Buffer]) -> None:
    """Nothing to do: ``frames`` die with this call's last reference (and the transport
    then tells the hub their block is free)."""
    del frames
