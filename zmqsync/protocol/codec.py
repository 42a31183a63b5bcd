"""Encode messages to lists of buffers and decode them back. Pure functions, no I/O.

A message is ``[header, body, buffer, buffer, ...]``:

- ``header``: a fixed binary struct (:data:`HEADER`) followed by the UTF-8 model_id.
- ``body``: for a chunk of weights, a fixed binary struct (:data:`CHUNK_BODY`), then
  (first chunk only) the JSON schema of the version's tensors; for an ack, a fixed
  binary struct (:data:`ACK_BODY`) and its three texts; for every other kind, a small
  JSON object with that kind's fields.
- ``buffer``: a chunk's payload, raw bytes never copied by the codec.

:func:`decode` either returns a message or raises :class:`~zmqsync.errors.FrameError`,
whatever it is given; the fuzz tests hold it to that.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any, Final

from zmqsync.errors import FrameError
from zmqsync.protocol.messages import (
    DTYPE_ITEMSIZE,
    FLOAT_DTYPES,
    MAGIC,
    MAX_BODY_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_METADATA_BYTES,
    MAX_MODEL_ID_BYTES,
    MAX_NDIM,
    MAX_SCHEMA_BYTES,
    MAX_TARGETS,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    MAX_TEXT_CHARS,
    MAX_VERSION_BYTES,
    PROTOCOL_VERSION,
    SESSION_CHARS,
    WIRE_DTYPES,
    Ack,
    Buffer,
    Chunk,
    ErrorMessage,
    Goodbye,
    Hello,
    Kind,
    Message,
    Probe,
    ProbeRequest,
    SnapshotRequest,
    StatusReply,
    StatusRequest,
    TensorEntry,
    UpToDate,
    WeightsSchema,
    Welcome,
)
from zmqsync.vocabulary import STRATEGIES

__all__ = [
    "ACK_BODY",
    "CHUNK_BODY",
    "HEADER",
    "SCHEMA_CACHE_BYTES",
    "checksum",
    "decode",
    "encode",
    "encode_metadata",
    "encode_schema",
    "layout_digest",
    "peek_kind",
]

#: magic, protocol version, kind, flags, version, epoch, buffer count,
#: model_id length, layout digest (a chunk's: blake2b-128 of its version's schema JSON;
#: zeros for other kinds).
HEADER: Final = struct.Struct("!4sBBHQQIH16s")
#: A chunk's body: index, count, offset and total (bytes of the version's stream), and
#: checksum (the payload's CRC-32 plus one; 0: none). The first chunk's schema follows,
#: then (FLAG_METADATA) the version's metadata JSON and its length (:data:`META_LEN`).
CHUNK_BODY: Final = struct.Struct("!IIQQQ")
META_LEN: Final = struct.Struct("!I")
#: After the body struct of every chunk of a delta (FLAG_DELTA): the version the delta
#: is against (see :class:`~zmqsync.protocol.messages.Chunk`).
DELTA_BASE: Final = struct.Struct("!Q")
#: Header flags of a chunk: the first and the last of its version, whether it carries a
#: checksum, (first chunk only) metadata and targets, and whether the version is a delta.
FLAG_FIRST: Final = 1
FLAG_LAST: Final = 2
FLAG_CHECKSUM: Final = 4
FLAG_METADATA: Final = 8
FLAG_DELTA: Final = 16
FLAG_TARGETS: Final = 32
_CHUNK_FLAGS: Final = (
    FLAG_FIRST | FLAG_LAST | FLAG_CHECKSUM | FLAG_METADATA | FLAG_DELTA | FLAG_TARGETS
)
_U64_MAX: Final = (1 << 64) - 1
_NO_DIGEST: Final = bytes(16)
_SCHEMA_CACHE_SIZE: Final = 32
#: Schema JSON the decoder keeps parsed, in all: twice the largest schema the protocol
#: allows; parsed, a schema takes up to ~10x its JSON, so however many hostile schemas
#: arrive, the cache pins at most ~350 MB (a count alone let 32 of 16 MiB pin gigabytes).
SCHEMA_CACHE_BYTES: Final = 32 * 1024 * 1024
_KINDS: Final[dict[int, Kind]] = {k.value: k for k in Kind}
#: Control-message bodies: compact JSON (one encoder, not one per message).
_JSON: Final = json.JSONEncoder(separators=(",", ":"))
_JSON_DECODER: Final = json.JSONDecoder()

_JSON_KINDS: Final[dict[Kind, type]] = {
    Kind.HELLO: Hello,
    Kind.WELCOME: Welcome,
    Kind.SNAPSHOT_REQUEST: SnapshotRequest,
    Kind.UP_TO_DATE: UpToDate,
    Kind.PROBE_REQUEST: ProbeRequest,
    Kind.PROBE: Probe,
    Kind.STATUS_REQUEST: StatusRequest,
    Kind.STATUS_REPLY: StatusReply,
    Kind.ERROR: ErrorMessage,
    Kind.GOODBYE: Goodbye,
}
#: Header fields, which travel in the struct rather than in the JSON body.
_HEADER_FIELDS: Final = frozenset({"model_id", "version", "epoch"})
#: An ack's body: worker, received_bytes, rejected_frames, pid, apply_seconds, applied,
#: and the UTF-8 lengths of reason, host and session, which follow it in that order.
#: Binary rather than JSON: the sender decodes one per worker per version, on the path
#: every ``send()`` waits on (a quarter of the JSON decode's cost).
ACK_BODY: Final = struct.Struct("!QQQQdBHHH")


def digest(body: Buffer) -> bytes:
    """The 16-byte schema digest carried in a weights header."""
    return hashlib.blake2b(body, digest_size=16).digest()


@functools.lru_cache(maxsize=8)
def _schema_digest(body: bytes) -> bytes:
    # A sender passes the same schema bytes object every version: its hash is cached by
    # Python, so this lookup is cheap where hashing 2,000 entries' JSON again is not.
    return digest(body)


# --- encode -------------------------------------------------------------------------


def encode_schema(schema: WeightsSchema) -> bytes:
    """The canonical JSON of a schema (what :func:`encode` puts in the body frame)."""
    doc = {
        "strategy": schema.strategy,
        "tensors": [
            [list(e.key), e.dtype, list(e.shape), e.buffer, e.offset, e.nbytes]
            + ([e.wire] if e.wire else [])
            for e in schema.entries
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def checksum(payload: Buffer) -> int:
    """What a chunk's ``checksum`` field holds for ``payload`` (CRC-32 plus one)."""
    return zlib.crc32(payload) + 1


def layout_digest(schema_bytes: bytes) -> bytes:
    """The layout digest of a version whose schema JSON is ``schema_bytes``."""
    return _schema_digest(schema_bytes)


def _header(
    kind: Kind,
    model_id: str,
    version: int,
    epoch: int,
    nbufs: int,
    schema_digest: bytes,
    flags: int = 0,
) -> bytes:
    mid = model_id.encode()
    if len(mid) > MAX_MODEL_ID_BYTES:
        raise ValueError(f"model_id is {len(mid)} bytes; the limit is {MAX_MODEL_ID_BYTES}")
    if not (0 <= version <= _U64_MAX and 0 <= epoch <= _U64_MAX):
        raise ValueError(f"version and epoch must fit in 64 unsigned bits: {version}, {epoch}")
    return (
        HEADER.pack(
            MAGIC, PROTOCOL_VERSION, kind, flags, version, epoch, nbufs, len(mid), schema_digest
        )
        + mid
    )


def encode(message: Message, *, schema_bytes: bytes | None = None) -> list[Buffer]:
    """Turn a message into ``[header, body, *buffers]``.

    ``schema_bytes``: for a first :class:`Chunk`, the schema JSON a sender encoded once
    (:func:`encode_schema`), instead of encoding ``message.schema`` again. A chunk's
    payload is passed through untouched (zero-copy).
    """
    if isinstance(message, Chunk):
        return _encode_chunk(message, schema_bytes)
    if isinstance(message, Ack):
        body = _encode_ack(message)
    else:
        names = _body_fields(type(message))  # type: ignore[arg-type]
        fields = {name: getattr(message, name) for name, _, _ in names}
        body = _JSON.encode(fields).encode()
    head = _header(message.kind, message.model_id, message.version, message.epoch, 0, _NO_DIGEST)
    return [head, body]


def _encode_chunk(chunk: Chunk, schema_bytes: bytes | None) -> list[Buffer]:
    if not 0 <= chunk.index < chunk.count <= MAX_CHUNKS:
        raise ValueError(f"chunk {chunk.index} of {chunk.count}: out of range")
    if len(chunk.layout) != 16:
        raise ValueError("a chunk's layout digest is 16 bytes")
    schema = b""
    if chunk.index == 0:
        if schema_bytes is None:
            if chunk.schema is None:
                raise ValueError("the first chunk of a version carries its schema")
            schema_bytes = encode_schema(chunk.schema)
        schema = schema_bytes
        if chunk.metadata is not None:
            meta = encode_metadata(chunk.metadata)
            schema = schema + meta + META_LEN.pack(len(meta))
        if chunk.targets is not None:
            if len(chunk.targets) > MAX_TARGETS or not all(
                type(w) is int and 0 <= w <= _U64_MAX for w in chunk.targets
            ):
                raise ValueError(f"targets must be at most {MAX_TARGETS} worker ids")
            named = _JSON.encode(list(chunk.targets)).encode()
            schema = schema + named + META_LEN.pack(len(named))
    elif chunk.metadata is not None or chunk.targets is not None:
        raise ValueError("only the first chunk of a version carries metadata and targets")
    flags = (
        (FLAG_FIRST if chunk.index == 0 else 0)
        | (FLAG_LAST if chunk.index == chunk.count - 1 else 0)
        | (FLAG_CHECKSUM if chunk.checksum else 0)
        | (FLAG_METADATA if chunk.metadata is not None else 0)
        | (FLAG_DELTA if chunk.base is not None else 0)
        | (FLAG_TARGETS if chunk.targets is not None else 0)
    )
    body = CHUNK_BODY.pack(chunk.index, chunk.count, chunk.offset, chunk.total, chunk.checksum)
    if chunk.base is not None:
        if not 0 <= chunk.base < chunk.version:
            raise ValueError(f"a delta of version {chunk.version} against {chunk.base}")
        body += DELTA_BASE.pack(chunk.base)
    head = _header(Kind.WEIGHTS, chunk.model_id, chunk.version, chunk.epoch, 1, chunk.layout, flags)
    return [head, body + schema if schema else body, chunk.payload]


def encode_metadata(metadata: Any) -> bytes:
    """A version's metadata as the JSON a first chunk carries.

    Raises ``TypeError`` unless it is a dict with string keys that JSON can hold, and
    ``ValueError`` if it is larger than :data:`MAX_METADATA_BYTES` or holds NaN or infinity.
    """
    if not isinstance(metadata, dict) or not all(type(k) is str for k in metadata):
        raise TypeError(f"metadata must be a dict with str keys; got {type(metadata).__name__}")
    try:
        raw = json.dumps(metadata, separators=(",", ":"), allow_nan=False).encode()
    except TypeError as exc:
        raise TypeError(f"metadata must be JSON-able: {exc}") from None
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(raw)} bytes as JSON; the limit is {MAX_METADATA_BYTES}")
    return raw


def _encode_ack(ack: Ack) -> bytes:
    reason, host, session = ack.reason.encode(), ack.host.encode(), ack.session.encode()
    try:
        fixed = ACK_BODY.pack(
            ack.worker,
            ack.received_bytes,
            ack.rejected_frames,
            ack.pid,
            ack.apply_seconds,
            ack.applied,
            len(reason),
            len(host),
            len(session),
        )
    except struct.error as exc:
        raise ValueError(f"an Ack field is out of range: {exc}: {ack!r:.200}") from exc
    return fixed + reason + host + session


# --- decode -------------------------------------------------------------------------


def peek_kind(header: Buffer) -> Kind | None:
    """The kind of a message from its first frame, or ``None`` if it is not ours.

    O(1) and never raises, whatever it is given (no validation beyond magic and kind):
    a sender uses it to drop kinds it never accepts unparsed.
    """
    try:
        if len(header) < HEADER.size or bytes(header[:4]) != MAGIC:
            return None
        return _KINDS.get(header[5])
    # What a non-bytes "frame" raises: a str, a multi-dimensional memoryview, None.
    except (TypeError, ValueError, IndexError, NotImplementedError):
        return None


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


def decode(frames: Sequence[Buffer], *, accept: Collection[Kind] | None = None) -> Message:
    """Decode ``[header, body, *buffers]`` into a message.

    Raises :class:`FrameError` for anything that is not a valid message, and nothing else.
    ``accept``: the kinds the caller handles; any other is refused before its body is
    parsed (a hub that never takes weights need not parse a 16 MiB schema to drop it).
    """
    try:
        return _decode(frames, accept)
    except FrameError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as exc:
        # json and struct raise these on hostile input the checks above did not catch.
        raise FrameError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def _decode(frames: Sequence[Buffer], accept: Collection[Kind] | None) -> Message:
    if len(frames) < 2:
        raise FrameError(f"a message has at least 2 frames (header, body); got {len(frames)}")
    head = frames[0]
    if len(head) < HEADER.size:
        raise FrameError(f"header is {len(head)} bytes; at least {HEADER.size} expected")
    magic, proto, kind_byte, flags, version, epoch, nbufs, mid_len, schema_digest = (
        HEADER.unpack_from(head)
    )
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not a zmqsync message")
    if proto != PROTOCOL_VERSION:
        raise FrameError(
            f"protocol version {proto} is not supported (this build speaks {PROTOCOL_VERSION}); "
            "upgrade the older side"
        )
    kind = _KINDS.get(kind_byte)
    if kind is None:
        raise FrameError(f"unknown message kind {kind_byte}")
    if accept is not None and kind not in accept:
        expected = ", ".join(sorted(k.name for k in accept))
        raise FrameError(f"unexpected kind {kind.name}; this end accepts {expected or 'none'}")
    if mid_len > MAX_MODEL_ID_BYTES or len(head) != HEADER.size + mid_len:
        raise FrameError(f"header length {len(head)} does not match model_id length {mid_len}")
    model_id = bytes(head[HEADER.size :]).decode("utf-8")
    body = frames[1]
    if kind is Kind.WEIGHTS:
        return _decode_chunk(frames, model_id, version, epoch, flags, nbufs, schema_digest)
    if len(frames) != 2 or nbufs != 0 or flags != 0:
        raise FrameError(f"a {kind.name} message has exactly 2 frames; got {len(frames)}")
    if len(body) > MAX_BODY_BYTES:
        raise FrameError(f"{kind.name} body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    if kind is Kind.ACK:
        return _decode_ack(bytes(body), model_id, version, epoch)
    doc = _JSON_DECODER.decode(bytes(body).decode("utf-8"))
    if not isinstance(doc, dict):
        raise FrameError(f"{kind.name} body must be a JSON object")
    return _from_fields(_JSON_KINDS[kind], doc, model_id=model_id, version=version, epoch=epoch)


def _decode_ack(body: bytes, model_id: str, version: int, epoch: int) -> Ack:
    if len(body) < ACK_BODY.size:
        raise FrameError(f"ACK body is {len(body)} bytes; at least {ACK_BODY.size} expected")
    worker, received, rejected, pid, seconds, applied, n_reason, n_host, n_session = (
        ACK_BODY.unpack_from(body)
    )
    expected = ACK_BODY.size + n_reason + n_host + n_session
    if len(body) != expected:
        raise FrameError(f"ACK body is {len(body)} bytes; its texts say {expected}")
    if applied > 1:
        raise FrameError(f"Ack.applied must be 0 or 1; got {applied}")
    if not math.isfinite(seconds):
        raise FrameError(f"Ack.apply_seconds must be a finite float; got {seconds!r}")
    start = ACK_BODY.size
    reason = body[start : start + n_reason].decode("utf-8")
    host = body[start + n_reason : start + n_reason + n_host].decode("utf-8")
    session = body[start + n_reason + n_host :].decode("utf-8")
    if len(reason) > MAX_TEXT_CHARS or len(host) > MAX_TEXT_CHARS:
        raise FrameError(f"Ack texts are limited to {MAX_TEXT_CHARS} characters")
    if len(session) > SESSION_CHARS:
        raise FrameError(f"Ack.session is at most {SESSION_CHARS} characters")
    return Ack(
        model_id,
        version,
        epoch,
        worker,
        applied == 1,
        reason,
        received,
        seconds,
        rejected,
        pid,
        host,
        session,
    )


@functools.cache
def _body_fields(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """A message class's JSON body fields: (name, type name, required), once per class."""
    return tuple(
        (
            f.name,
            str(f.type),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
        if f.name not in _HEADER_FIELDS
    )


def _from_fields(cls: type, doc: dict[str, Any], **header: Any) -> Message:
    kwargs: dict[str, Any] = dict(header)
    for name, expected, required in _body_fields(cls):
        if name not in doc:
            if required:
                raise FrameError(f"{cls.__name__} lacks field {name!r}")
            continue
        kwargs[name] = _check_field(cls, name, expected, doc[name])
    return cls(**kwargs)


def _check_field(cls: type, name: str, expected: str, value: Any) -> Any:
    if expected == "int":
        ok = type(value) is int and 0 <= value <= _U64_MAX
    elif expected == "float":
        ok = type(value) in (int, float) and math.isfinite(value)
        value = float(value) if ok else value
    elif expected == "bool":
        ok = type(value) is bool
    elif expected == "str":
        ok = type(value) is str and len(value) <= MAX_TEXT_CHARS
    else:  # dict[str, Any]: the status document
        ok = type(value) is dict
    if not ok:
        raise FrameError(f"{cls.__name__}.{name} must be {expected}; got {value!r:.80}")
    return value


def _decode_chunk(
    frames: Sequence[Buffer],
    model_id: str,
    version: int,
    epoch: int,
    flags: int,
    nbufs: int,
    layout: bytes,
) -> Chunk:
    if nbufs != 1 or len(frames) != 3:
        raise FrameError(f"a chunk has 3 frames and announces 1 buffer; got {len(frames)}, {nbufs}")
    body, payload = frames[1], frames[2]
    if len(body) < CHUNK_BODY.size:
        raise FrameError(f"chunk body is {len(body)} bytes; at least {CHUNK_BODY.size} expected")
    index, count, offset, total, crc = CHUNK_BODY.unpack_from(body)
    size = len(payload)
    if not 0 < count <= MAX_CHUNKS or index >= count:
        raise FrameError(f"chunk {index} of {count}: out of range (at most {MAX_CHUNKS})")
    if total > MAX_VERSION_BYTES or size > MAX_CHUNK_BYTES or offset + size > total:
        raise FrameError(
            f"chunk {index} spans bytes {offset}..{offset + size} of a version of {total}; "
            f"limits: {MAX_CHUNK_BYTES} per chunk, {MAX_VERSION_BYTES} per version"
        )
    delta = bool(flags & FLAG_DELTA)
    expected = (
        (FLAG_FIRST if index == 0 else 0)
        | (FLAG_LAST if index == count - 1 else 0)
        | (flags & FLAG_CHECKSUM)
        | (flags & FLAG_METADATA if index == 0 else 0)
        | (flags & FLAG_DELTA)
        | (flags & FLAG_TARGETS if index == 0 else 0)
    )
    if flags != expected or flags & ~_CHUNK_FLAGS:
        raise FrameError(f"chunk {index} of {count} has flags {flags:#x}; expected {expected:#x}")
    base: int | None = None
    fixed = CHUNK_BODY.size
    if delta:
        # A delta carries only the stretches that changed: its chunks may start and end
        # anywhere in the stream (in order, which the receiver's ChunkStream checks).
        if len(body) < fixed + DELTA_BASE.size:
            raise FrameError("a delta chunk carries no base version")
        (base,) = DELTA_BASE.unpack_from(body, fixed)
        if base >= version:
            raise FrameError(f"a delta of version {version} against version {base}")
        fixed += DELTA_BASE.size
    elif index == count - 1 and offset + size != total:
        raise FrameError(f"the last chunk ends at {offset + size}, not at the total {total}")
    if flags & FLAG_CHECKSUM and checksum(payload) != crc:
        raise FrameError(f"chunk {index} of version {version}: checksum mismatch (corrupted)")
    if not flags & FLAG_CHECKSUM and crc:
        raise FrameError(f"chunk {index} carries a checksum its flags do not announce")
    schema: WeightsSchema | None = None
    metadata: dict[str, Any] | None = None
    targets: tuple[int, ...] | None = None
    if index == 0:
        if offset != 0 and not delta:
            raise FrameError(f"the first chunk starts at {offset}, not 0")
        rest = bytes(body[fixed:])
        if flags & FLAG_TARGETS:
            rest, named = _split_trailer(rest, MAX_TARGETS * 21, "targets")
            if not isinstance(named, list) or not all(
                type(w) is int and 0 <= w <= _U64_MAX for w in named
            ):
                raise FrameError("targets must be a JSON list of worker ids")
            targets = tuple(named)
        if flags & FLAG_METADATA:
            rest, metadata = _split_trailer(rest, MAX_METADATA_BYTES, "metadata")
            if not isinstance(metadata, dict):
                raise FrameError(f"metadata must be a JSON object; got {type(metadata).__name__}")
        schema = _chunk_schema(rest, layout, total)
    elif len(body) != fixed:
        raise FrameError("only the first chunk of a version carries a schema")
    return Chunk(
        model_id,
        version,
        epoch,
        index,
        count,
        offset,
        total,
        layout,
        payload,
        schema,
        crc,
        metadata,
        base,
        targets,
    )


def _split_trailer(rest: bytes, limit: int, what: str) -> tuple[bytes, Any]:
    """A first chunk's body without its last trailer (JSON, then its length), and the
    trailer's value (checked to be JSON of at most ``limit`` bytes)."""
    if len(rest) < META_LEN.size:
        raise FrameError(f"a chunk announces {what} but carries none")
    (n,) = META_LEN.unpack_from(rest, len(rest) - META_LEN.size)
    if n > limit or n > len(rest) - META_LEN.size:
        raise FrameError(f"{what} of {n} bytes: over the limit ({limit}) or the body")
    start = len(rest) - META_LEN.size - n
    try:
        value = json.loads(rest[start : start + n])
    except (ValueError, RecursionError) as exc:  # deep nesting: a RecursionError
        raise FrameError(f"{what} is not JSON: {str(exc)[:200]}") from None
    return rest[:start], value


def _chunk_schema(body: bytes, layout_digest: bytes, total: int) -> WeightsSchema:
    """A first chunk's schema, checked: its digest, and a stream of exactly ``total``
    bytes (a receiver may allocate ``total``: the schema's tensors must account for it)."""
    if len(body) > MAX_SCHEMA_BYTES:
        raise FrameError(f"schema is {len(body)} bytes; the limit is {MAX_SCHEMA_BYTES}")
    layout = _schema_cache.get(body)
    fresh = layout is None
    if layout is None:
        if digest(body) != layout_digest:
            raise FrameError("layout digest does not match the schema: corrupted message")
        layout = _parse_layout(body, layout_digest, 1)
    elif layout_digest != layout.digest:
        raise FrameError("layout digest does not match the schema: corrupted message")
    if layout.end != total:  # empty tensors have no bytes: they may sit anywhere
        raise FrameError(f"the schema's tensors span {layout.end} bytes; the chunks say {total}")
    if fresh:
        _schema_cache.put(body, layout)
    return layout.schema


def _parse_layout(body: bytes, schema_digest: bytes, nbufs: int) -> _Layout:
    schema = _parse_schema(body, nbufs)
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


def _parse_schema(body: bytes, nbufs: int) -> WeightsSchema:
    doc = json.loads(body)
    if not isinstance(doc, dict) or set(doc) != {"strategy", "tensors"}:
        raise FrameError("schema must be an object with 'strategy' and 'tensors'")
    strategy, tensors = doc["strategy"], doc["tensors"]
    if strategy not in STRATEGIES:
        raise FrameError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise FrameError(f"schema 'tensors' must be a list of at most {MAX_TENSORS} entries")
    entries = []
    seen: set[tuple[str, ...]] = set()
    for raw in tensors:
        entry = _parse_entry(raw, nbufs)
        if entry.key in seen:
            raise FrameError(f"tensor {entry.dotted_key!r} appears twice in the schema")
        seen.add(entry.key)
        entries.append(entry)
    return WeightsSchema(strategy, tuple(entries))


def _parse_entry(raw: Any, nbufs: int) -> TensorEntry:
    if not (isinstance(raw, list) and len(raw) in (6, 7)):
        raise FrameError(
            f"schema entry must be [key, dtype, shape, buffer, offset, nbytes(, wire)]: {raw!r:.80}"
        )
    key, dtype, shape, buffer, offset, nbytes = raw[:6]
    wire = raw[6] if len(raw) == 7 else ""
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
    if wire and not (wire in WIRE_DTYPES and dtype in FLOAT_DTYPES and wire != dtype):
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
    for name, value, bound in (("buffer", buffer, nbufs - 1), ("offset", offset, MAX_TENSOR_BYTES)):
        if type(value) is not int or not 0 <= value <= bound:
            raise FrameError(f"tensor {'.'.join(key)!r} has an invalid {name} {value!r:.40}")
    if type(nbytes) is not int or nbytes != expected:
        raise FrameError(
            f"tensor {'.'.join(key)!r}: nbytes {nbytes!r:.40} does not match "
            f"shape {shape} of {wire or dtype} ({expected} bytes)"
        )
    if wire and offset % itemsize:
        raise FrameError(f"tensor {'.'.join(key)!r}: {wire} bytes at a misaligned offset")
    return TensorEntry(tuple(key), dtype, tuple(shape), buffer, offset, nbytes, wire)


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
