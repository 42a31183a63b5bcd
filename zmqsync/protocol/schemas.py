"""A version's schema on the wire: its canonical JSON, its layout digest, and the strict
parse a receiver runs before it allocates anything (cached by the schema's bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

from zmqsync.errors import FrameError
from zmqsync.protocol.limits import (
    DTYPE_ITEMSIZE,
    FLOAT_DTYPES,
    MAX_NDIM,
    MAX_PARTS,
    MAX_SCHEMA_BYTES,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    MAX_TEXT_CHARS,
    WIRE_DTYPES,
)
from zmqsync.protocol.messages import Box, TensorEntry, WeightsSchema
from zmqsync.protocol.wire import digest
from zmqsync.vocabulary import STRATEGIES

__all__ = ["encode_schema", "layout_digest"]

_SCHEMA_CACHE_SIZE: Final = 32
#: Schema JSON the decoder keeps parsed, in all: twice the largest schema the protocol
#: allows; parsed, a schema takes up to ~10x its JSON, so however many hostile schemas
#: arrive, the cache pins at most ~350 MB (a count alone let 32 of 16 MiB pin gigabytes).
SCHEMA_CACHE_BYTES: Final = 32 * 1024 * 1024


def encode_schema(schema: WeightsSchema) -> bytes:
    """The canonical JSON of a schema (what the first chunk of a version carries).

    A part of a version (``parts`` > 1) says which one (``"part": [part, parts]``), and
    its boxes follow each entry's wire dtype (``""`` if none); a plain version's JSON has
    neither."""
    doc: dict[str, Any] = {
        "strategy": schema.strategy,
        "tensors": [
            [list(e.key), e.dtype, list(e.shape), e.buffer, e.offset, e.nbytes]
            + ([e.wire] if e.wire or e.box else [])
            + ([[list(e.box.shape), list(e.box.offsets)]] if e.box else [])
            for e in schema.entries
        ],
    }
    if schema.parts != 1:
        doc["part"] = [schema.part, schema.parts]
    return json.dumps(doc, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=8)
def layout_digest(schema_bytes: bytes) -> bytes:
    """The layout digest of a version whose schema JSON is ``schema_bytes``."""
    # A sender passes the same schema bytes object every version: its hash is cached by
    # Python, so this lookup is cheap where hashing 2,000 entries' JSON again is not.
    return digest(schema_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    """A schema checked on its own, and what checking it against a stream takes: one
    comparison each, not one per tensor, on every version (2,000 tensors are common)."""

    schema: WeightsSchema
    digest: bytes  # of the schema's bytes: a cache hit needs no hashing again
    end: int  # where the last tensor with bytes ends in the stream


class _SchemaCache:
    """Recently decoded schemas by their exact bytes: a sender sends one layout over and
    over, and parsing 2,000 entries of JSON per version would dominate small-tensor syncs.

    Bounded by count and by bytes: schemas may be up to :data:`MAX_SCHEMA_BYTES` each.
    """

    def __init__(
        self, max_bytes: int = SCHEMA_CACHE_BYTES, max_items: int = _SCHEMA_CACHE_SIZE
    ) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.nbytes = 0  # the schema bytes held
        self._items: OrderedDict[bytes, _Layout] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> _Layout | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: bytes, layout: _Layout) -> None:
        """Keep ``layout``: only ever one that a whole message was checked against."""
        if len(key) > self.max_bytes:
            return  # it would evict everything and still not fit
        with self._lock:
            old = self._items.pop(key, None)  # two threads decoded the same new schema
            if old is not None:
                self.nbytes -= len(key)
            self._items[key] = layout
            self.nbytes += len(key)
            while len(self._items) > self.max_items or self.nbytes > self.max_bytes:
                evicted, _ = self._items.popitem(last=False)
                self.nbytes -= len(evicted)


_schema_cache = _SchemaCache()


def decode_schema(body: bytes, layout: bytes, total: int) -> WeightsSchema:
    """A first chunk's schema, checked: against its ``layout`` digest, and to lay out a
    stream of exactly ``total`` bytes (a receiver may allocate ``total``: the schema's
    tensors must account for it). Raises :class:`FrameError`, or what ``json`` raises."""
    if len(body) > MAX_SCHEMA_BYTES:
        raise FrameError(f"schema is {len(body)} bytes; the limit is {MAX_SCHEMA_BYTES}")
    parsed = _schema_cache.get(body)
    fresh = parsed is None
    if parsed is None:
        if digest(body) != layout:
            raise FrameError("layout digest does not match the schema: corrupted message")
        parsed = _parse_layout(body, layout)
    elif layout != parsed.digest:
        raise FrameError("layout digest does not match the schema: corrupted message")
    if parsed.end != total:  # empty tensors have no bytes: they may sit anywhere
        raise FrameError(f"the schema's tensors span {parsed.end} bytes; the chunks say {total}")
    if fresh:
        _schema_cache.put(body, parsed)
    return parsed.schema


def _parse_layout(body: bytes, schema_digest: bytes) -> _Layout:
    schema = _parse_schema(body)
    end = max((e.offset + e.nbytes for e in schema.entries if e.nbytes), default=0)
    _check_apart(schema.entries)
    return _Layout(schema, schema_digest, end)


def _check_apart(entries: Sequence[TensorEntry]) -> None:
    """Refuse entries that share bytes: a receiver allocates each entry on its own, so
    entries stacked on one megabyte of the wire could make it allocate hundreds. Empty
    tensors have no bytes to share. Sorted once: O(n log n) for 100k entries."""
    spans = sorted(
        (e.buffer, e.offset, e.offset + e.nbytes, i) for i, e in enumerate(entries) if e.nbytes
    )
    last_buffer, last_end, last = -1, 0, 0
    for buffer, start, end, i in spans:
        if buffer == last_buffer and start < last_end:
            raise FrameError(
                f"tensors {entries[last].dotted_key!r} and {entries[i].dotted_key!r} "
                f"overlap in buffer {buffer}"
            )
        last_buffer, last_end, last = buffer, end, i


def _parse_schema(body: bytes) -> WeightsSchema:
    doc = json.loads(body)
    if not isinstance(doc, dict) or set(doc) - {"part"} != {"strategy", "tensors"}:
        raise FrameError("schema must be an object with 'strategy', 'tensors' (and 'part')")
    strategy, tensors = doc["strategy"], doc["tensors"]
    part, parts = _parse_part(doc.get("part"))
    if strategy not in STRATEGIES:
        raise FrameError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise FrameError(f"schema 'tensors' must be a list of at most {MAX_TENSORS} entries")
    entries = []
    seen: set[tuple[str, ...]] = set()
    for raw in tensors:
        entry = _parse_entry(raw, parts > 1)
        if entry.key in seen:
            raise FrameError(f"tensor {entry.dotted_key!r} appears twice in the schema")
        seen.add(entry.key)
        entries.append(entry)
    return WeightsSchema(strategy, tuple(entries), part, parts)


def _parse_part(raw: Any) -> tuple[int, int]:
    """``(part, parts)`` from a schema's ``"part"`` (absent: a plain version, 0 of 1)."""
    if raw is None:
        return 0, 1
    if not (
        isinstance(raw, list)
        and len(raw) == 2
        and all(type(v) is int for v in raw)
        and 0 <= raw[0] < raw[1] <= MAX_PARTS
        and raw[1] > 1
    ):
        raise FrameError(
            f"schema 'part' must be [part, parts] with 0 <= part < parts, 1 < parts <= "
            f"{MAX_PARTS}: {raw!r:.80}"
        )
    return raw[0], raw[1]


def _parse_entry(raw: Any, boxed: bool = False) -> TensorEntry:
    """One entry; ``boxed``: it is in a part of a version, and may be a box."""
    if not (isinstance(raw, list) and len(raw) in ((6, 7, 8) if boxed else (6, 7))):
        raise FrameError(
            "schema entry must be [key, dtype, shape, buffer, offset, nbytes(, wire"
            f"{'(, box)' if boxed else ''})]: {raw!r:.80}"
        )
    key, dtype, shape, buffer, offset, nbytes = raw[:6]
    wire = raw[6] if len(raw) >= 7 else ""
    if not (
        isinstance(key, list)
        and 0 < len(key) <= MAX_NDIM
        and all(type(k) is str and 0 < len(k) <= MAX_TEXT_CHARS for k in key)
    ):
        raise FrameError(f"tensor key must be a non-empty list of names: {key!r:.80}")
    if dtype not in DTYPE_ITEMSIZE:
        raise FrameError(f"tensor {'.'.join(key)!r} has unknown dtype {dtype!r:.40}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM):
        raise FrameError(f"tensor {'.'.join(key)!r} has an invalid shape {shape!r:.80}")
    if type(wire) is not str or (
        wire and not (wire in WIRE_DTYPES and dtype in FLOAT_DTYPES and wire != dtype)
    ):
        raise FrameError(
            f"tensor {'.'.join(key)!r}: {dtype} cannot travel as {wire!r:.40} "
            f"(a floating dtype may travel as one of {WIRE_DTYPES})"
        )
    itemsize = DTYPE_ITEMSIZE[wire or dtype]
    expected = _shape_bytes(shape, itemsize)
    if expected is None:
        raise FrameError(
            f"tensor {'.'.join(key)!r} has an invalid shape {shape!r:.80} (negative, or "
            f"more than {MAX_TENSOR_BYTES} bytes counting empty dimensions as 1)"
        )
    # A version travels as one stream: every entry is in buffer 0.
    for name, value, bound in (("buffer", buffer, 0), ("offset", offset, MAX_TENSOR_BYTES)):
        if type(value) is not int or not 0 <= value <= bound:
            raise FrameError(f"tensor {'.'.join(key)!r} has an invalid {name} {value!r:.40}")
    if type(nbytes) is not int or nbytes != expected:
        raise FrameError(
            f"tensor {'.'.join(key)!r}: nbytes {nbytes!r:.40} does not match "
            f"shape {shape} of {wire or dtype} ({expected} bytes)"
        )
    if wire and offset % itemsize:
        raise FrameError(f"tensor {'.'.join(key)!r}: {wire} bytes at a misaligned offset")
    box = _parse_box(".".join(key), raw[7], shape, itemsize) if len(raw) == 8 else None
    return TensorEntry(tuple(key), dtype, tuple(shape), buffer, offset, nbytes, wire, box)


def _parse_box(name: str, raw: Any, shape: list[int], itemsize: int) -> Box:
    """An entry's box: ``[global shape, offsets]``, each of the entry's rank, the entry
    inside the global tensor, and the global tensor no larger than one may be."""
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(v, list) for v in raw)):
        raise FrameError(f"tensor {name!r}: a box is [global shape, offsets]: {raw!r:.80}")
    whole, offsets = raw
    if len(whole) != len(shape) or len(offsets) != len(shape):
        raise FrameError(f"tensor {name!r}: its box has another rank than its shape {shape}")
    if _shape_bytes(whole, itemsize) is None:
        raise FrameError(
            f"tensor {name!r}: its box's global shape {whole!r:.80} is invalid (negative, or "
            f"more than {MAX_TENSOR_BYTES} bytes)"
        )
    for d, o, n in zip(whole, offsets, shape, strict=True):
        if type(o) is not int or not 0 <= o <= d - n:
            raise FrameError(
                f"tensor {name!r}: a box of shape {shape} at offsets {offsets!r:.80} does not "
                f"fit in the global shape {whole}"
            )
    return Box(tuple(whole), tuple(offsets))


def _shape_bytes(shape: list[Any], itemsize: int) -> int | None:
    """The bytes a shape of ``itemsize`` elements holds, or ``None`` if it is not one the
    receiver can allocate: a dimension that is not a non-negative int, or a shape that
    spans more than :data:`MAX_TENSOR_BYTES` with empty dimensions counted as 1 (torch
    computes strides that way: ``(0, 2**40, 2**40)`` holds nothing, yet overflows them).

    Checked after each multiplication, so no product ever exceeds the limit by more than
    one dimension's factor.
    """
    span = itemsize
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_TENSOR_BYTES:
            return None
        span *= d or 1
        if span > MAX_TENSOR_BYTES:
            return None
    return 0 if 0 in shape else span
