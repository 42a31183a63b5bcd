"""Weights as tensors: extract them, flatten them to buffers, apply buffers in place.

The only module that imports torch and tensordict.

- :func:`extract` turns ``None`` (the scheme's model), an ``nn.Module``, a ``TensorDict``
  or a ``dict`` of tensors into ``{key_path: tensor}`` for a strategy: ``"state_dict"``
  (flat dotted names, as ``module.state_dict()``) or ``"tensordict"`` (nested keys, as
  ``TensorDict.from_module``; includes non-persistent buffers).
- :class:`Flattener` lays them out as buffers without copying: large tensors are sent
  straight from their own memory; tensors under ``pack_threshold`` bytes are packed into
  one buffer (one copy of a few bytes beats thousands of frames).
- :func:`apply_weights` copies a received message into a model's tensors in place,
  all-or-nothing: every key, dtype and shape is checked before the first byte moves.
"""

from __future__ import annotations

import bisect
import collections
import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from zmqsync.errors import FrameError, SchemaMismatchError
from zmqsync.protocol import (
    DTYPE_ITEMSIZE,
    STRATEGIES,
    WIRE_DTYPES,
    Buffer,
    TensorEntry,
    Weights,
    WeightsSchema,
    encode_schema,
)

__all__ = [
    "DEFAULT_PACK_THRESHOLD",
    "ApplyPlan",
    "Flat",
    "Flattener",
    "KeyPath",
    "ModelTensors",
    "apply_weights",
    "checksum",
    "dtype_name",
    "extract",
    "materialize",
    "read_view",
    "torch_dtype",
]

KeyPath: TypeAlias = tuple[str, ...]
#: Tensors smaller than this travel packed together in one buffer. Below ~64 KiB the cost
#: of a frame (a syscall's share, a Python object, a zero-copy release callback) exceeds
#: the cost of copying the bytes once.
DEFAULT_PACK_THRESHOLD: Final = 64 * 1024
#: Each dtype group in the packed buffer starts on this boundary, so a receiver can view
#: a group as its dtype (complex128 is the widest element).
_PACK_ALIGN: Final = 16
#: Alignment of each buffer carved out of one block (a cache line).
_CARVE_ALIGN: Final = 64

_DTYPES: Final[dict[str, torch.dtype]] = {
    name: getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name)
}
_NAMES: Final[dict[torch.dtype, str]] = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol's name for a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise SchemaMismatchError(f"dtype {dtype} cannot be sent by zmqsync") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a protocol dtype name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise SchemaMismatchError(
            f"dtype {name!r} is not available in this torch ({torch.__version__})"
        ) from None


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")


def extract(weights: Any, strategy: str, *, model: Any = None) -> dict[KeyPath, torch.Tensor]:
    """``{key_path: tensor}`` of ``weights`` (or of ``model`` when ``weights`` is None).

    Tensors are detached views of the originals: nothing is copied.
    """
    _check_strategy(strategy)
    source = model if weights is None else weights
    if source is None:
        raise ValueError(
            "no weights to send: pass weights=, or give the scheme a model "
            "(init_on_sender(model_id, model=...))"
        )
    if isinstance(source, torch.nn.Module):
        if strategy == "state_dict":
            return {(k,): v.detach() for k, v in source.state_dict(keep_vars=True).items()}
        source = TensorDict.from_module(source)
    if isinstance(source, TensorDictBase):
        if strategy == "state_dict":
            source = source.flatten_keys(".")
        out: dict[KeyPath, torch.Tensor] = {}
        for key, value in source.items(include_nested=True, leaves_only=True):
            path = (key,) if isinstance(key, str) else tuple(key)
            out[path] = _as_tensor(path, value)
        return out
    if isinstance(source, Mapping):
        return {
            ((".".join(path),) if strategy == "state_dict" else path): _as_tensor(path, value)
            for path, value in _walk(source, ())
        }
    raise TypeError(
        f"cannot take weights from a {type(source).__name__}; pass an nn.Module, a TensorDict "
        "or a dict of tensors"
    )


class ModelTensors:
    """``extract(model)`` remembered between versions, for the model a side syncs.

    Walking a large module tree (``state_dict()``) costs milliseconds per version; this
    keeps the result and re-walks only when it could be stale: a module added or removed,
    a parameter or buffer replaced, or a tensor given new storage (``p.data = ...``) or
    a new shape. Checking that is a dict lookup and two compares per tensor, in C loops
    (``map``), so thousands of tensors cost no Python step each. The same holds for a
    (nested) dict of tensors.
    """

    def __init__(self, strategy: str) -> None:
        _check_strategy(strategy)
        self.strategy = strategy
        self._model: Any = None
        self._modules: list[torch.nn.Module] = []
        self._owners = _Owners([])
        self._tensors: dict[KeyPath, torch.Tensor] = {}
        self._sizes: dict[int, tuple[Any, int]] = {}

    def get(self, model: Any) -> dict[KeyPath, torch.Tensor]:
        if isinstance(model, Mapping) and not isinstance(model, TensorDictBase):
            return self._get_mapping(model)
        if not isinstance(model, torch.nn.Module):
            return extract(model, self.strategy)
        if model is not self._model or not self._still_valid(model):
            self._tensors = extract(model, self.strategy)
            self._modules = list(model.modules())
            self._owners = _Owners(
                [
                    (table, name, t)
                    for module in self._modules
                    for table in (module._parameters, module._buffers)
                    for name, t in table.items()
                    if t is not None
                ]
            )
            self._model = model
        return self._tensors

    def owners(self, model: Any) -> list[torch.Tensor] | None:
        """The tensor objects ``model`` itself holds (its parameters and buffers, or its
        dict's values), as :meth:`get` last walked them; None if not known."""
        if model is not self._model:
            return None
        return list(self._owners.tensors)

    def _get_mapping(self, model: Mapping[Any, Any]) -> dict[KeyPath, torch.Tensor]:
        """A dict of tensors (nested dicts too): the same check, per key."""
        if model is self._model and self._mapping_still_valid():
            return self._tensors
        tensors = extract(model, self.strategy)
        owners = list(_walk_owners(model))
        if any(not isinstance(value, torch.Tensor) for _, _, value in owners):
            self._model = None  # not all tensors (converted on extract): nothing to keep
            return tensors
        self._tensors = tensors
        self._modules = []
        self._owners = _Owners(owners)
        self._sizes = {id(table): (table, len(table)) for table, _, _ in owners}
        self._model = model
        return tensors

    def _mapping_still_valid(self) -> bool:
        return (
            all(len(table) == n for table, n in self._sizes.values()) and self._owners.unchanged()
        )

    def _still_valid(self, model: torch.nn.Module) -> bool:
        modules = list(model.modules())
        if len(modules) != len(self._modules) or any(
            a is not b for a, b in zip(modules, self._modules, strict=True)
        ):
            return False
        count = sum(
            t is not None
            for m in modules
            for table in (m._parameters, m._buffers)
            for t in table.values()
        )
        return count == len(self._owners.tensors) and self._owners.unchanged()


class _Owners:
    """Where each of a model's tensors is held (container and key), and its storage and
    shape when it was walked; :meth:`unchanged` compares them all in C loops."""

    __slots__ = ("keys", "ptrs", "shapes", "tables", "tensors")

    def __init__(self, owners: list[tuple[Any, Any, torch.Tensor]]) -> None:
        self.tables = [table for table, _, _ in owners]
        self.keys = [key for _, key, _ in owners]
        self.tensors = [t for _, _, t in owners]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))
        self.shapes = [t.shape for t in self.tensors]

    def unchanged(self) -> bool:
        """Whether every container still holds the same tensor, in the same storage, of
        the same shape."""
        try:
            held = map(operator.getitem, self.tables, self.keys)
            return (
                all(map(operator.is_, held, self.tensors))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs
                and list(map(_SHAPE, self.tensors)) == self.shapes
            )
        except KeyError:
            return False


_SHAPE: Final = operator.attrgetter("shape")


def _walk_owners(mapping: Mapping[Any, Any]) -> Iterable[tuple[Any, Any, Any]]:
    """``(container, key, leaf)`` for every leaf of a nested mapping."""
    for key, value in mapping.items():
        if isinstance(value, Mapping) and not isinstance(value, TensorDictBase):
            yield from _walk_owners(value)
        else:
            yield mapping, key, value


def _walk(mapping: Mapping[Any, Any], prefix: KeyPath) -> Iterable[tuple[KeyPath, Any]]:
    for key, value in mapping.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping | TensorDictBase):
            yield from _walk(value, path)
        else:
            yield path, value


def _as_tensor(path: KeyPath, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"weights entry {'.'.join(path)!r} is a {type(value).__name__}, not a tensor"
        )
    return value.detach()


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class Flat:
    """Weights laid out for the wire: a schema and buffers that view the tensors' memory.

    ``keepalive`` holds the tensors the buffers point into. Until the send that uses
    them has completed, changing those tensors changes what is sent.
    """

    schema: WeightsSchema
    schema_bytes: bytes
    #: Host memory; or, ``on_device``, uint8 tensors on an accelerator (see
    #: :meth:`Flattener.flatten`'s ``stage``).
    buffers: list[Any]
    nbytes: int
    keepalive: list[torch.Tensor] = field(repr=False)
    #: The buffers are a private copy already (weights staged from a GPU): changing
    #: the model does not change them.
    owned: bool = False
    on_device: bool = False
    #: Buffers cast for the wire as they are read (``wire_dtype``): buffer index -> the
    #: wire dtype. Such a buffer is a flat tensor of the tensor's own dtype.
    casts: dict[int, torch.dtype] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        """Each buffer's length in bytes, on the wire."""
        out = []
        for i, b in enumerate(self.buffers):
            wire = self.casts.get(i)
            if wire is not None:
                out.append(int(b.numel()) * wire.itemsize)
            elif self.on_device:
                out.append(int(b.numel()))
            else:
                out.append(len(memoryview(b)))
        return out


def _aligned(n: int) -> int:
    return -(-n // _CARVE_ALIGN) * _CARVE_ALIGN


def _synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the work queued on these accelerators (copies into or out of them)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            backend = getattr(torch, device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view if it is contiguous)."""
    return _byte_view(tensor if tensor.is_contiguous() else tensor.contiguous())


@dataclass
class _Staged:
    """How a Flattener copies accelerator tensors to host memory each version."""

    big: list[torch.Tensor]  # a frame each, in layout order
    pack: list[torch.Tensor] = field(default_factory=list)  # small ones and padding
    pack_views: list[torch.Tensor] = field(default_factory=list)  # their bytes, if contiguous
    pack_nbytes: int = 0
    devices: list[torch.device] = field(default_factory=list)  # the accelerators read
    one_device: bool = True  # all on one device: the pack is gathered there first
    pin: bool = False
    nbytes: int = 0
    #: Per piece of ``pack``: the dtype it travels as, if cast (``wire_dtype``).
    pack_wire: list[torch.dtype | None] = field(default_factory=list)


class Flattener:
    """Flattens tensors to (schema, buffers), remembering the layout between versions.

    A sender sends the same layout every version; the schema and its JSON are built once
    and reused while keys, dtypes and shapes stay the same.
    """

    def __init__(
        self,
        strategy: str,
        *,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        _check_strategy(strategy)
        if wire_dtype is not None and dtype_name(wire_dtype) not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}; got {wire_dtype}")
        #: Floating tensors of another dtype travel as this one (cast as they are read).
        self.wire_dtype = wire_dtype
        self._casts: dict[int, torch.dtype] = {}
        self._pack_casts: list[tuple[int, list[torch.Tensor], torch.dtype]] = []
        self.strategy = strategy
        self.pack_threshold = pack_threshold
        self._layout_key: tuple[Any, ...] | None = None
        self._schema: WeightsSchema | None = None
        self._schema_bytes = b""
        # The last tensors flattened, and what flattening them found: reused as is when
        # the same mapping comes again (a ModelTensors cache hands out the same one while
        # the model's tensors keep their storage).
        self._source: Mapping[KeyPath, torch.Tensor] | None = None
        self._big: list[torch.Tensor] = []
        self._big_views: list[Any] = []  # memoryviews; cast ones: tensors
        self._big_nbytes = 0
        self._pack: list[np.ndarray | None] = []  # None: a cast group, made per version
        self._staged: _Staged | None = None  # set while the tensors live on a GPU

    def flatten(self, tensors: Mapping[KeyPath, torch.Tensor], *, stage: bool = True) -> Flat:
        """``tensors`` as a Flat. Tensors on an accelerator are copied to host memory
        (``stage``), or left there: the Flat's buffers are then their bytes on the device
        (small ones gathered there into one), for a reader that copies them to the host
        a chunk at a time (:class:`zmqsync.chunking.DeviceReader`)."""
        if tensors is not self._source:
            self._prepare(tensors)
        if self._staged is not None:
            if not stage:
                return self._flatten_on_device(self._staged)
            return self._flatten_staged(self._staged)
        keepalive = list(self._big)
        buffers: list[Any] = list(self._big_views)
        nbytes = self._big_nbytes
        if self._pack:
            # A fresh buffer every version: an earlier one may still be in flight. One
            # memcpy per small tensor from views kept between versions (numpy's: torch's
            # cat would reshape each tensor again and may wake its thread pool).
            parts: list[Any] = self._pack
            if self._pack_casts:  # each cast group: one gather and one cast
                parts = list(parts)
                for at, views, wire in self._pack_casts:
                    parts[at] = torch.cat(views).to(wire).view(torch.uint8).numpy()
            packed = np.concatenate(parts)
            keepalive.append(torch.from_numpy(packed))
            buffers.append(packed.data)
            nbytes += packed.nbytes
        assert self._schema is not None
        return Flat(self._schema, self._schema_bytes, buffers, nbytes, keepalive, casts=self._casts)

    def _wire(self, t: torch.Tensor) -> torch.dtype | None:
        """The dtype ``t`` travels as, if it is cast for the wire."""
        wire = self.wire_dtype
        if wire is not None and t.is_floating_point() and t.dtype != wire:
            return wire
        return None

    def _wire_nbytes(self, t: torch.Tensor) -> int:
        wire = self._wire(t)
        return t.nbytes if wire is None else t.numel() * wire.itemsize

    def _prepare(self, tensors: Mapping[KeyPath, torch.Tensor]) -> None:
        """Sort ``tensors`` into large ones (a frame each) and small ones (packed per
        dtype), and build the schema if the layout changed."""
        if any(t.device.type != "cpu" for t in tensors.values()):
            self._prepare_staged(tensors)
            return
        self._staged = None
        big: list[tuple[KeyPath, torch.Tensor]] = []
        small: dict[Any, list[tuple[KeyPath, torch.Tensor]]] = {}
        aliases = True  # every view below reads the caller's tensors (no copy was made)
        for path, tensor in tensors.items():
            t = tensor
            if not t.is_contiguous():
                t = t.contiguous()
                aliases = False
            if t.nbytes < self.pack_threshold:
                small.setdefault((t.dtype, self._wire(t)), []).append((path, t))
            else:
                big.append((path, t))
        self._casts = {i: w for i, (_, t) in enumerate(big) if (w := self._wire(t)) is not None}
        # Cast ones are read as their own elements, and cast as each chunk is written.
        self._big = [
            t.detach().reshape(-1) if i in self._casts else _byte_view(t)
            for i, (_, t) in enumerate(big)
        ]
        # The large tensors' bytes, as the frames that carry them: the same views every
        # version while the tensors keep their storage.
        self._big_views = [
            v if i in self._casts else v.numpy().data for i, v in enumerate(self._big)
        ]
        self._big_nbytes = sum(self._wire_nbytes(t) for _, t in big)
        self._pack = []
        self._pack_casts = []
        offset = 0
        for (_, wire), group in small.items():
            pad = -offset % _PACK_ALIGN
            if pad:
                self._pack.append(np.zeros(pad, dtype=np.uint8))
                offset += pad
            if wire is not None:
                views = [t.detach().reshape(-1) for _, t in group]
                self._pack_casts.append((len(self._pack), views, wire))
                self._pack.append(None)  # filled each version
                offset += sum(v.numel() for v in views) * wire.itemsize
                continue
            for _, t in group:
                self._pack.append(_byte_view(t.detach()).numpy())
                offset += t.nbytes
        self._set_layout(big, small)
        # Copies (a non-contiguous tensor made contiguous) hold this version's values
        # only: such tensors are flattened afresh every time.
        self._source = tensors if aliases else None

    def _set_layout(
        self,
        big: list[tuple[KeyPath, torch.Tensor]],
        small: dict[Any, list[tuple[KeyPath, torch.Tensor]]],
    ) -> None:
        layout_key = (
            tuple((p, t.dtype, t.shape) for p, t in big),
            tuple((p, t.dtype, t.shape) for group in small.values() for p, t in group),
        )
        if layout_key != self._layout_key:
            self._schema = self._layout(big, small)
            self._schema_bytes = encode_schema(self._schema)
            self._layout_key = layout_key

    def _prepare_staged(self, tensors: Mapping[KeyPath, torch.Tensor]) -> None:
        """Tensors on a GPU (or another accelerator): each version is copied once into
        host memory (pinned, so the copies run at full speed and overlap), and that copy
        is the Flat: private and read-only."""
        big: list[tuple[KeyPath, torch.Tensor]] = []
        small: dict[Any, list[tuple[KeyPath, torch.Tensor]]] = {}
        for path, tensor in tensors.items():
            t = tensor.detach()
            if t.nbytes < self.pack_threshold:
                small.setdefault((t.dtype, self._wire(t)), []).append((path, t))
            else:
                big.append((path, t))
        self._set_layout(big, small)
        assert self._schema is not None
        staged = _Staged([t for _, t in big])
        self._casts = {i: w for i, (_, t) in enumerate(big) if (w := self._wire(t)) is not None}
        pieces: list[torch.Tensor] = []
        offset = 0
        for (_, wire), group in small.items():
            pad = -offset % _PACK_ALIGN
            if pad:
                pieces.append(torch.zeros(pad, dtype=torch.uint8, device=group[0][1].device))
                staged.pack_wire.append(None)
                offset += pad
            for _, t in group:
                pieces.append(t)
                staged.pack_wire.append(wire)
                offset += self._wire_nbytes(t)
        staged.pack = pieces
        staged.pack_nbytes = offset
        if all(t.is_contiguous() for t in pieces):
            # Views read the tensors' current values at each copy: made once, not per
            # version (thousands of small tensors cost milliseconds of Python each time).
            staged.pack_views = [_byte_view(t) for t in pieces]
        devices = {t.device for t in tensors.values()}
        staged.devices = [d for d in devices if d.type != "cpu"]
        staged.one_device = len(devices) == 1
        staged.pin = any(d.type == "cuda" for d in devices) and torch.cuda.is_available()
        staged.nbytes = sum(self._wire_nbytes(t) for _, t in big) + offset
        self._staged = staged
        self._source = tensors  # read afresh each version: the mapping alone is cached

    def _flatten_staged(self, staged: _Staged) -> Flat:
        if self._casts or any(staged.pack_wire):
            # Cast for the wire where the tensors live, then brought over whole.
            flat = self._flatten_on_device(staged)
            copies = [
                (b.to(flat.casts[i]).view(torch.uint8) if i in flat.casts else b).cpu()
                for i, b in enumerate(flat.buffers)
            ]
            assert self._schema is not None
            return Flat(
                self._schema,
                self._schema_bytes,
                [o.numpy().data.toreadonly() for o in copies],
                staged.nbytes,
                copies,
                owned=True,
            )
        sizes = [t.nbytes for t in staged.big]
        if staged.pack:
            sizes.append(staged.pack_nbytes)
        total = sum(_aligned(n) for n in sizes)
        # A fresh buffer each version (torch caches pinned blocks, so it is rarely new
        # memory): the last one may still be in flight, or kept as the snapshot.
        host = torch.empty(total, dtype=torch.uint8, pin_memory=staged.pin)
        outs: list[torch.Tensor] = []
        offset = 0
        with torch.no_grad():
            for t in staged.big:
                dst = host[offset : offset + t.nbytes]
                dst.copy_(_bytes_of(t), non_blocking=True)
                outs.append(dst)
                offset += _aligned(t.nbytes)
            if staged.pack:
                dst = host[offset : offset + staged.pack_nbytes]
                views = staged.pack_views or [_bytes_of(t) for t in staged.pack]
                if staged.one_device:
                    # One gather on the GPU and one transfer, not one per small tensor.
                    dst.copy_(torch.cat(views), non_blocking=True)
                else:
                    pos = 0
                    for v in views:
                        dst[pos : pos + v.numel()].copy_(v, non_blocking=True)
                        pos += v.numel()
                outs.append(dst)
            _synchronize(staged.devices)
        assert self._schema is not None
        buffers: list[Buffer] = [o.numpy().data.toreadonly() for o in outs]
        return Flat(self._schema, self._schema_bytes, buffers, staged.nbytes, outs, owned=True)

    def _flatten_on_device(self, staged: _Staged) -> Flat:
        with torch.no_grad():
            buffers = [
                t.contiguous().reshape(-1) if i in self._casts else _bytes_of(t)
                for i, t in enumerate(staged.big)
            ]
            if staged.pack:
                views = staged.pack_views or [_bytes_of(t) for t in staged.pack]
                if any(staged.pack_wire):
                    views = [
                        v if w is None else _bytes_of(t.to(w))
                        for v, t, w in zip(views, staged.pack, staged.pack_wire, strict=True)
                    ]
                device = views[0].device
                # One gather where the small tensors live: a chunk is then one copy.
                buffers.append(torch.cat([v.to(device) for v in views]))
        assert self._schema is not None
        return Flat(
            self._schema,
            self._schema_bytes,
            buffers,
            staged.nbytes,
            buffers,
            on_device=True,
            casts=self._casts,
        )

    def _layout(
        self,
        big: list[tuple[KeyPath, torch.Tensor]],
        small: dict[Any, list[tuple[KeyPath, torch.Tensor]]],
    ) -> WeightsSchema:
        def entry(p: KeyPath, t: torch.Tensor, buffer: int, offset: int) -> TensorEntry:
            wire = self._wire(t)
            return TensorEntry(
                p,
                dtype_name(t.dtype),
                tuple(t.shape),
                buffer,
                offset,
                self._wire_nbytes(t),
                "" if wire is None else dtype_name(wire),
            )

        entries = [entry(p, t, i, 0) for i, (p, t) in enumerate(big)]
        offset = 0
        for group in small.values():
            offset += -offset % _PACK_ALIGN
            for p, t in group:
                entries.append(entry(p, t, len(big), offset))
                offset += self._wire_nbytes(t)
        return WeightsSchema(self.strategy, tuple(entries))


def read_view(buf: Any) -> torch.Tensor | None:
    """A uint8 tensor viewing received bytes (None if there are none), to read from.

    Received frames may be read-only, which torch warns about; we never write to them.
    """
    if not len(buf):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def _source_views(message: Weights) -> list[torch.Tensor | None]:
    return [read_view(buf) for buf in message.buffers]


#: torch runs an element-wise copy of at most this many elements in the calling thread
#: (its parallel grain). Casts are cut into pieces this size: a parallel region leaves
#: OpenMP's threads spinning for milliseconds afterwards, taking a core from the other
#: end of the stream on a small machine.
CAST_GRAIN: Final = 32768


def serial_pieces(
    dest: torch.Tensor, source: torch.Tensor, dests: list[torch.Tensor], sources: list[torch.Tensor]
) -> None:
    """Append ``dest`` and ``source`` (flat, of equal length) to the lists, cut into
    pieces a ``_foreach_copy_`` copies without waking torch's thread pool."""
    if dest.numel() <= CAST_GRAIN:
        dests.append(dest)
        sources.append(source)
    else:
        dests.extend(torch.split(dest, CAST_GRAIN))
        sources.extend(torch.split(source, CAST_GRAIN))


def overlapping(
    entries: list[TensorEntry], starts: list[int], offset: int, length: int
) -> Iterator[tuple[int, TensorEntry, int, int]]:
    """The entries (sorted by offset; ``starts`` their offsets) that stream bytes
    ``[offset, offset + length)`` hold part of: ``(index, entry, lo, hi)``, the bytes
    ``[lo, hi)`` of the stream they share."""
    end = offset + length
    i = max(0, bisect.bisect_right(starts, offset) - 1)
    while i < len(entries) and entries[i].offset < end:
        e = entries[i]
        lo, hi = max(e.offset, offset), min(e.offset + e.nbytes, end)
        if lo < hi:
            yield i, e, lo, hi
        i += 1


#: A received chunk with at most this many cast tensors is cast straight from its bytes
#: (views made on the spot); more are cast from a buffer whose views are made once.
_FEW_CASTS: Final = 16


class CastPlan:
    """Tensors that travel cast (``wire_dtype``): copies the elements a stretch of the
    stream holds into them, cast back to each one's dtype.

    Applied to a chunk at a time (in place) or to a whole version (staged). The stretches
    seen are remembered with the views they need, so a chunk of thousands of small
    tensors is one ``_foreach_copy_``, not a Python step per tensor.
    """

    def __init__(self, entries: list[TensorEntry], target: Mapping[KeyPath, torch.Tensor]):
        self._entries = sorted((e for e in entries if e.nbytes), key=lambda e: e.offset)
        self._starts = [e.offset for e in self._entries]
        #: Where each entry's elements go: the tensor itself, flat, or (not contiguous,
        #: or on an accelerator) a contiguous CPU copy put in place by :meth:`finish`.
        self._flat: list[torch.Tensor] = []
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in self._entries:
            dest = target[e.key]
            if dest.device.type == "cpu" and dest.is_contiguous():
                self._flat.append(dest.detach().view(-1))
            else:
                tmp = torch.empty(dest.numel(), dtype=dest.dtype)
                self._flat.append(tmp)
                self._later.append((dest, tmp))
        #: Views of one source's memory (the last seen), per stretch of the stream.
        self._source = (0, 0)
        self._spans: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._scratch: torch.Tensor | None = None
        #: Per stretch of a received stream: whether it holds few cast tensors.
        self._few: dict[tuple[int, int], bool] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def apply(self, source: torch.Tensor, offset: int, *, copy: bool = False) -> None:
        """Copy what ``source`` (uint8: stream bytes ``[offset, offset + len)``) holds.

        ``copy``: the source is memory that will not come again (a received chunk). A
        stretch of a few tensors is cast straight from it; one of many (small tensors) is
        first copied into a buffer of the plan's, whose views are made once.
        """
        length = int(source.numel())
        if copy:
            few = self._few.get((offset, length))
            if few is None:
                first = max(0, bisect.bisect_right(self._starts, offset) - 1)
                few = bisect.bisect_left(self._starts, offset + length) - first <= _FEW_CASTS
                if len(self._few) < 1 << 16:  # one per chunk of the stream
                    self._few[(offset, length)] = few
            if few:
                dests, views = self._span(source, offset, length)
                if dests:
                    torch._foreach_copy_(dests, views)
                return
            if self._scratch is None or self._scratch.numel() < length:
                self._scratch = torch.empty(length, dtype=torch.uint8)
            self._scratch[:length].copy_(source)
            source = self._scratch[:length]
        where = (source.data_ptr(), int(source.untyped_storage().nbytes()))
        if where != self._source:  # views of other memory would keep it alive: let go
            self._source = where
            self._spans.clear()
        span = self._spans.get((offset, length))
        if span is None:
            span = self._span(source, offset, length)
            if len(self._spans) < 1 << 16:  # one per chunk of the stream
                self._spans[(offset, length)] = span
        dests, views = span
        if dests:
            torch._foreach_copy_(dests, views)

    def _span(
        self, source: torch.Tensor, offset: int, length: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dests: list[torch.Tensor] = []
        views: list[torch.Tensor] = []
        for i, e, lo, hi in overlapping(self._entries, self._starts, offset, length):
            wire = torch_dtype(e.wire)
            size = wire.itemsize
            if (lo - e.offset) % size or (hi - e.offset) % size or (lo - offset) % size:
                raise FrameError(f"a chunk edge splits an element of {e.dotted_key!r} ({e.wire})")
            first = (lo - e.offset) // size
            serial_pieces(
                self._flat[i][first : first + (hi - lo) // size],
                source[lo - offset : hi - offset].view(wire),
                dests,
                views,
            )
        return dests, views

    def finish(self) -> None:
        """Put the tensors copied aside in place."""
        for dest, tmp in self._later:
            dest.copy_(tmp.view(dest.shape))


def _entry_bytes(views: list[torch.Tensor | None], entry: TensorEntry) -> torch.Tensor:
    view = views[entry.buffer]
    assert view is not None
    return view[entry.offset : entry.offset + entry.nbytes]


def check_fits(
    schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
) -> None:
    """Raise :class:`SchemaMismatchError` unless ``schema`` fits ``target`` exactly."""
    if schema.strategy != strategy:
        raise SchemaMismatchError(
            f"weights were sent with strategy {schema.strategy!r} but this receiver uses "
            f"{strategy!r}; give both sides the same strategy"
        )
    sent = {e.key for e in schema.entries}
    missing = [k for k in target if k not in sent]
    if missing:
        key = ".".join(missing[0])
        raise SchemaMismatchError(
            f"weights lack {key!r} (and {len(missing) - 1} more) that the model has", key=key
        )
    for e in schema.entries:
        dest = target.get(e.key)
        if dest is None:
            raise SchemaMismatchError(
                f"weights carry {e.dotted_key!r}, which the model lacks", key=e.dotted_key
            )
        if dtype_name(dest.dtype) != e.dtype:
            raise SchemaMismatchError(
                f"{e.dotted_key!r} is {e.dtype} in the weights but {dtype_name(dest.dtype)} "
                "in the model",
                key=e.dotted_key,
            )
        if tuple(dest.shape) != e.shape:
            raise SchemaMismatchError(
                f"{e.dotted_key!r} has shape {list(e.shape)} in the weights but "
                f"{list(dest.shape)} in the model",
                key=e.dotted_key,
            )


#: Versions up to this many bytes are copied into a worker's tensors by one memcpy per
#: tensor on the receiving thread; larger ones by torch's (parallel) ``_foreach_copy_``.
SERIAL_COPY_BYTES: Final = 64 * 1024 * 1024


@dataclass
class _BufferPlan:
    sizes: list[int]  # consecutive chunk sizes covering bytes [0, total) of the buffer
    take: list[int]  # which chunks land in a tensor (the others are padding)
    dests: list[torch.Tensor]  # byte views of those tensors, in the same order
    total: int
    offsets: list[int] = field(default_factory=list)  # where each dest's bytes start
    arrays: list[np.ndarray] = field(default_factory=list)  # dests, as numpy byte arrays
    #: The source buffer (address, length) ``views`` slice, and those slices.
    source: tuple[int, int] = (0, 0)
    views: list[np.ndarray] = field(default_factory=list, repr=False)


class _DevicePlan:
    """One received buffer's tensors on one accelerator: the bytes they need cross to
    the device in one copy, and one ``_foreach_copy_`` there puts each in place."""

    def __init__(self, entries: list[TensorEntry], dests: list[torch.Tensor]) -> None:
        order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
        self.start = entries[order[0]].offset
        self.end = max(e.offset + e.nbytes for e in entries)
        self.dests = [dests[i] for i in order]
        # Consecutive chunk sizes from start to end (padding included) and which of them
        # land in a tensor: one split, whatever the number of tensors.
        self.sizes: list[int] | None = []
        self.take: list[int] = []
        pos = self.start
        for i in order:
            e = entries[i]
            if e.offset < pos:  # overlapping entries: slice each one instead
                self.sizes = None
                break
            if e.offset > pos:
                self.sizes.append(e.offset - pos)
            self.take.append(len(self.sizes))
            self.sizes.append(e.nbytes)
            pos = e.offset + e.nbytes
        self.spans = [(entries[i].offset - self.start, entries[i].nbytes) for i in order]

    def apply(self, view: torch.Tensor | None) -> None:
        assert view is not None
        if len(self.dests) == 1:
            self.dests[0].copy_(view[self.start : self.end], non_blocking=True)
            return
        staged = view[self.start : self.end].to(self.dests[0].device, non_blocking=True)
        if self.sizes is not None:
            chunks = torch.split(staged, self.sizes)
            sources = [chunks[i] for i in self.take]
        else:
            sources = [staged[o : o + n] for o, n in self.spans]
        torch._foreach_copy_(self.dests, sources)


class ApplyPlan:
    """How one schema's bytes land in one target's tensors, worked out once.

    Building it checks that the schema fits (all-or-nothing: nothing is copied when it
    does not). Applying is then one ``split`` per buffer and one ``_foreach_copy_``: a
    worker receiving 2,000 small tensors per version does no per-tensor Python work.
    """

    def __init__(
        self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor], strategy: str
    ) -> None:
        check_fits(schema, target, strategy)
        self.schema = schema
        self.target = target
        self._buffers: dict[int, _BufferPlan] = {}
        self._slow: list[tuple[TensorEntry, torch.Tensor]] = []
        # Tensors on an accelerator, per (buffer, device): the buffer's bytes cross to the
        # device once, and one _foreach_copy_ there scatters them into the tensors.
        self._device: dict[tuple[int, torch.device], list[TensorEntry]] = {}
        by_buffer: dict[int, list[TensorEntry]] = {}
        cast = [e for e in schema.entries if e.wire]
        #: Tensors that travel cast, per buffer.
        self._casts = {
            b: CastPlan([e for e in cast if e.buffer == b], target)
            for b in {e.buffer for e in cast}
        }
        for e in schema.entries:
            if e.nbytes == 0 or e.wire:
                continue
            dest = target[e.key]
            if not dest.is_contiguous():
                self._slow.append((e, dest))
            elif dest.device.type == "cpu":
                by_buffer.setdefault(e.buffer, []).append(e)
            else:
                self._device.setdefault((e.buffer, dest.device), []).append(e)
        self._devices = sorted(
            {d for _, d in self._device}
            | {dest.device for _, dest in self._slow if dest.device.type != "cpu"},
            key=str,
        )
        self._device_plans = [
            (index, _DevicePlan(entries, [_byte_view(target[e.key]) for e in entries]))
            for (index, _), entries in self._device.items()
        ]
        for index, entries in by_buffer.items():
            entries.sort(key=lambda e: e.offset)
            plan = _BufferPlan([], [], [], 0)
            for e in entries:
                if e.offset < plan.total:  # overlapping entries: copy those one by one
                    self._slow.append((e, target[e.key]))
                    continue
                if e.offset > plan.total:
                    plan.sizes.append(e.offset - plan.total)  # padding
                plan.take.append(len(plan.sizes))
                plan.sizes.append(e.nbytes)
                plan.dests.append(_byte_view(target[e.key]))
                plan.offsets.append(e.offset)
                plan.arrays.append(_byte_view(target[e.key].detach()).numpy())
                plan.total = e.offset + e.nbytes
            self._buffers[index] = plan
        self.nbytes = sum(e.nbytes for e in schema.entries)
        # Below this size a plain memcpy per tensor beats torch's parallel copy: waking
        # torch's intra-op threads costs milliseconds on a busy machine, more than the
        # whole copy (a 1 MB version: 0.1 ms serial, up to 20 ms waiting for threads).
        self.serial = self.nbytes <= SERIAL_COPY_BYTES

    def fits(self, schema: WeightsSchema, target: Mapping[KeyPath, torch.Tensor]) -> bool:
        return schema is self.schema and target is self.target

    def apply(self, message: Weights) -> None:
        # torch views of the frames, for the paths that copy with torch (making them
        # costs more than a small version's serial copies)
        views = (
            _source_views(message) if not self.serial or self._device_plans or self._slow else []
        )
        with torch.no_grad():
            if self.serial:
                for index, plan in self._buffers.items():
                    source = np.frombuffer(message.buffers[index], dtype=np.uint8)
                    # The same memory as last time (a worker's staging buffer): views
                    # made once, and one map in C, not a Python step per tensor.
                    where = (source.__array_interface__["data"][0], source.nbytes)
                    if plan.source != where:
                        plan.source = where
                        plan.views = [
                            source[o : o + a.nbytes]
                            for a, o in zip(plan.arrays, plan.offsets, strict=True)
                        ]
                    collections.deque(map(np.copyto, plan.arrays, plan.views), maxlen=0)
            else:
                dst: list[torch.Tensor] = []
                src: list[torch.Tensor] = []
                for index, plan in self._buffers.items():
                    view = views[index]
                    assert view is not None
                    chunks = torch.split(view[: plan.total], plan.sizes)
                    src.extend(chunks[i] for i in plan.take)
                    dst.extend(plan.dests)
                if dst:
                    torch._foreach_copy_(dst, src)
            for index, device_plan in self._device_plans:
                device_plan.apply(views[index])
            for index, cast_plan in self._casts.items():
                view = read_view(message.buffers[index])
                if view is not None:
                    cast_plan.apply(view, 0)
                    cast_plan.finish()
            for e, dest in self._slow:
                data = _entry_bytes(views, e)
                dest.copy_(data.clone().view(dest.dtype).reshape(dest.shape))
            # Done before the caller acks: an acked version is in the tensors, and the
            # received frames may be freed.
            _synchronize(self._devices)


def apply_weights(message: Weights, target: Mapping[KeyPath, torch.Tensor], strategy: str) -> None:
    """Copy ``message`` into ``target``'s tensors in place, all or nothing.

    Every key, dtype and shape is checked first; :class:`SchemaMismatchError` names the
    first that does not fit, and then nothing has been copied. (Receivers keep an
    :class:`ApplyPlan` instead, to check a layout once.)
    """
    ApplyPlan(message.schema, target, strategy).apply(message)


def materialize(message: Weights) -> dict[KeyPath, torch.Tensor]:
    """Fresh tensors holding a message's weights (they alias nothing)."""
    views = _source_views(message)
    out: dict[KeyPath, torch.Tensor] = {}
    for e in message.schema.entries:
        tensor = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        if e.nbytes and e.wire:
            tensor.view(-1).copy_(_entry_bytes(views, e).view(torch_dtype(e.wire)))
        elif e.nbytes:
            _byte_view(tensor).copy_(_entry_bytes(views, e))
        out[e.key] = tensor
    return out


def as_weights_object(tensors: Mapping[KeyPath, torch.Tensor], strategy: str) -> Any:
    """What ``receive()`` returns: a state_dict-like ``dict`` or a nested ``TensorDict``."""
    if strategy == "state_dict":
        return {".".join(k): v for k, v in tensors.items()}
    return TensorDict({k: v for k, v in tensors.items()}, batch_size=[])


def checksum(weights: Any, strategy: str = "state_dict") -> str:
    """A hex digest of weights' keys, dtypes, shapes and bytes (for tests and status)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for path, tensor in sorted(extract(weights, strategy).items()):
        t = tensor.detach().cpu().contiguous()
        h.update(repr((path, dtype_name(t.dtype), tuple(t.shape))).encode())
        if t.numel():
            h.update(np.ascontiguousarray(_byte_view(t).numpy()).tobytes())
    return h.hexdigest()
