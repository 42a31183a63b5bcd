"""Weights laid out as buffers for the wire, copying as little as it can.

:class:`Flattener` sends large tensors straight from their own memory and packs the small
ones (under ``pack_threshold`` bytes) into one buffer: one copy of a few bytes beats
thousands of frames. Tensors on an accelerator are copied to the host, or left there.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from zmqsync.chunking.layout import Sources, StreamLayout
from zmqsync.protocol import WIRE_DTYPES, Box, Buffer, TensorEntry, WeightsSchema, encode_schema
from zmqsync.tensors.casts import WireCast
from zmqsync.tensors.device_reader import DeviceReader
from zmqsync.tensors.extract import KeyPath, check_strategy
from zmqsync.tensors.views import byte_view, bytes_of, dtype_name, synchronize

__all__ = ["DEFAULT_PACK_THRESHOLD", "Flat", "Flattener"]

#: Tensors smaller than this travel packed together in one buffer. Below ~64 KiB the cost
#: of a frame (a syscall's share, a Python object, a zero-copy release callback) exceeds
#: the cost of copying the bytes once.
DEFAULT_PACK_THRESHOLD: Final = 64 * 1024
#: Each dtype group in the packed buffer starts on this boundary, so a receiver can view
#: a group as its dtype (complex128 is the widest element).
_PACK_ALIGN: Final = 16
#: Alignment of each buffer carved out of one block (a cache line).
_CARVE_ALIGN: Final = 64


@dataclass
class Flat:
    """Weights laid out for the wire: a schema and buffers that view the tensors' memory.

    ``keepalive`` holds the tensors the buffers point into. Until the send that uses
    them has completed, changing those tensors changes what is sent.
    """

    schema: WeightsSchema
    schema_bytes: bytes
    #: Host memory; or, ``on_device``, uint8 tensors on an accelerator (see
    #: :meth:`Flattener.flatten`'s ``stage``); or, for the small tensors, a
    #: :class:`PackReader` of them (``pack=False``).
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
            elif isinstance(b, PackReader):
                out.append(b.nbytes)
            else:
                out.append(len(memoryview(b)))
        return out

    def sources(self, layout: StreamLayout) -> Sources:
        """What ``layout`` writes its chunks from: the buffers as numpy byte arrays (those
        cast for the wire, read through a :class:`WireCast`), or a :class:`DeviceReader`
        of them if they are on an accelerator."""
        if self.on_device:
            return DeviceReader(layout, self.buffers, self.casts)
        return [
            WireCast(b, self.casts[i])
            if i in self.casts
            else b
            if isinstance(b, PackReader)
            else np.frombuffer(b, dtype=np.uint8)
            for i, b in enumerate(self.buffers)
        ]


class PackReader:
    """The small tensors' bytes (and the padding between dtype groups) read where they
    lie as the stream is written: the packed buffer without its copy.

    Like a large tensor's bytes, they are read while the send lasts.
    """

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts  # uint8, one per small tensor or padding
        self.starts = list(itertools.accumulate((p.nbytes for p in parts), initial=0))
        self.nbytes = self.starts[-1]

    def write(self, start: int, stop: int, out: np.ndarray) -> None:
        """Bytes ``[start, stop)`` of the pack into ``out``: the parts that lie whole in
        that stretch in one ``concatenate``, the parts cut at its ends copied apart."""
        parts, starts = self.parts, self.starts
        first = bisect.bisect_right(starts, start) - 1
        if start > starts[first]:  # the stretch begins inside a part
            end = min(stop, starts[first + 1])
            np.copyto(out[: end - start], parts[first][start - starts[first] : end - starts[first]])
            first += 1
        last = bisect.bisect_right(starts, stop) - 1  # parts [first, last) end by stop
        if last > first:
            np.concatenate(parts[first:last], out=out[starts[first] - start : starts[last] - start])
        if first <= last < len(parts) and starts[last] < stop:  # it ends inside a part
            np.copyto(out[starts[last] - start :], parts[last][: stop - starts[last]])

    def bytes_in(self, start: int, stop: int) -> list[Buffer]:
        """Bytes ``[start, stop)`` of the pack as they lie, part by part (what a delta's
        digests read)."""
        parts, starts = self.parts, self.starts
        out: list[Buffer] = []
        i = bisect.bisect_right(starts, start) - 1
        while i < len(parts) and starts[i] < stop:
            lo, hi = max(start, starts[i]) - starts[i], min(stop, starts[i + 1]) - starts[i]
            if hi > lo:
                out.append(parts[i][lo:hi].data)
            i += 1
        return out


def _aligned(n: int) -> int:
    return -(-n // _CARVE_ALIGN) * _CARVE_ALIGN


@dataclass
class _StagePlan:
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
        check_strategy(strategy)
        if wire_dtype is not None and dtype_name(wire_dtype) not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}; got {wire_dtype}")
        #: Floating tensors of another dtype travel as this one (cast as they are read).
        self.wire_dtype = wire_dtype
        self._casts: dict[int, torch.dtype] = {}
        self._pack_casts: list[tuple[int, list[torch.Tensor], torch.dtype]] = []
        self.strategy = strategy
        self.pack_threshold = pack_threshold
        #: A sharded learner's rank: the part it sends, of how many, and the box of the
        #: global tensor that each of its tensors is (none: the whole tensor).
        self.part = (0, 1)
        self.boxes: Mapping[KeyPath, Box] = {}
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
        self._pack_reader: PackReader | None = None  # ``_pack`` read in place, once made
        self._staged: _StagePlan | None = None  # set while the tensors live on a GPU

    def flatten(
        self, tensors: Mapping[KeyPath, torch.Tensor], *, stage: bool = True, pack: bool = True
    ) -> Flat:
        """``tensors`` as a Flat. Tensors on an accelerator are copied to host memory
        (``stage``), or left there: the Flat's buffers are then their bytes on the device
        (small ones gathered there into one), for a reader that copies them to the host
        a chunk at a time (:class:`~zmqsync.tensors.device_reader.DeviceReader`).

        ``pack=False``: the small host tensors are not copied into one buffer but read
        where they lie (a :class:`PackReader`), for a caller that writes the stream with
        :meth:`~zmqsync.chunking.layout.StreamLayout.write` while the send lasts."""
        if tensors is not self._source:
            self._prepare(tensors)
        if self._staged is not None:
            if not stage:
                return self._flatten_on_device(self._staged)
            return self._flatten_staged(self._staged)
        keepalive = list(self._big)
        buffers: list[Any] = list(self._big_views)
        nbytes = self._big_nbytes
        if self._pack and not pack and not self._pack_casts:
            if self._pack_reader is None:
                self._pack_reader = PackReader(self._pack)  # type: ignore[arg-type]  # no None
            buffers.append(self._pack_reader)
            nbytes += self._pack_reader.nbytes
        elif self._pack:
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
            t.detach().reshape(-1) if i in self._casts else byte_view(t)
            for i, (_, t) in enumerate(big)
        ]
        # The large tensors' bytes, as the frames that carry them: the same views every
        # version while the tensors keep their storage.
        self._big_views = [
            v if i in self._casts else v.numpy().data for i, v in enumerate(self._big)
        ]
        self._big_nbytes = sum(self._wire_nbytes(t) for _, t in big)
        self._pack = []
        self._pack_reader = None
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
                self._pack.append(byte_view(t.detach()).numpy())
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
            self.part,
            self.boxes,
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
        staged = _StagePlan([t for _, t in big])
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
            staged.pack_views = [byte_view(t) for t in pieces]
        devices = {t.device for t in tensors.values()}
        staged.devices = [d for d in devices if d.type != "cpu"]
        staged.one_device = len(devices) == 1
        staged.pin = any(d.type == "cuda" for d in devices) and torch.cuda.is_available()
        staged.nbytes = sum(self._wire_nbytes(t) for _, t in big) + offset
        self._staged = staged
        self._source = tensors  # read afresh each version: the mapping alone is cached

    def _flatten_staged(self, staged: _StagePlan) -> Flat:
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
                dst.copy_(bytes_of(t), non_blocking=True)
                outs.append(dst)
                offset += _aligned(t.nbytes)
            if staged.pack:
                dst = host[offset : offset + staged.pack_nbytes]
                views = staged.pack_views or [bytes_of(t) for t in staged.pack]
                if staged.one_device:
                    # One gather on the GPU and one transfer, not one per small tensor.
                    dst.copy_(torch.cat(views), non_blocking=True)
                else:
                    pos = 0
                    for v in views:
                        dst[pos : pos + v.numel()].copy_(v, non_blocking=True)
                        pos += v.numel()
                outs.append(dst)
            synchronize(staged.devices)
        assert self._schema is not None
        buffers: list[Buffer] = [o.numpy().data.toreadonly() for o in outs]
        return Flat(self._schema, self._schema_bytes, buffers, staged.nbytes, outs, owned=True)

    def _flatten_on_device(self, staged: _StagePlan) -> Flat:
        with torch.no_grad():
            buffers = [
                t.contiguous().reshape(-1) if i in self._casts else bytes_of(t)
                for i, t in enumerate(staged.big)
            ]
            if staged.pack:
                views = staged.pack_views or [bytes_of(t) for t in staged.pack]
                if any(staged.pack_wire):
                    views = [
                        v if w is None else bytes_of(t.to(w))
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
                self.boxes.get(p),
            )

        entries = [entry(p, t, i, 0) for i, (p, t) in enumerate(big)]
        offset = 0
        for group in small.values():
            offset += -offset % _PACK_ALIGN
            for p, t in group:
                entries.append(entry(p, t, len(big), offset))
                offset += self._wire_nbytes(t)
        return WeightsSchema(self.strategy, tuple(entries), *self.part)
