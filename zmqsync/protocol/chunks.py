"""A :class:`~zmqsync.protocol.messages.Chunk` to and from its frames: the body struct,
the flags, the delta base, the checksum, and the first chunk's schema, metadata and
targets (JSON trailers, each followed by its length).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from zmqsync.errors import FrameError
from zmqsync.protocol.limits import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_METADATA_BYTES,
    MAX_TARGETS,
    MAX_VERSION_BYTES,
)
from zmqsync.protocol.messages import Buffer, Chunk, Kind, WeightsSchema
from zmqsync.protocol.schemas import decode_schema, encode_schema
from zmqsync.protocol.wire import (
    CHUNK_BODY,
    CHUNK_FLAGS,
    COMPACT_JSON,
    DELTA_BASE,
    FLAG_CHECKSUM,
    FLAG_DELTA,
    FLAG_FIRST,
    FLAG_LAST,
    FLAG_METADATA,
    FLAG_TARGETS,
    META_LEN,
    U64_MAX,
    checksum,
    pack_header,
)

__all__ = ["encode_metadata"]

#: The targets trailer's JSON: at most 20 digits and a comma per worker id.
_MAX_TARGETS_BYTES: Final = MAX_TARGETS * 21


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


def encode_chunk(chunk: Chunk, schema_bytes: bytes | None) -> list[Buffer]:
    """``[header, body, payload]`` of ``chunk``; ``ValueError`` if it cannot travel."""
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
                type(w) is int and 0 <= w <= U64_MAX for w in chunk.targets
            ):
                raise ValueError(f"targets must be at most {MAX_TARGETS} worker ids")
            named = COMPACT_JSON.encode(list(chunk.targets)).encode()
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
    head = pack_header(
        Kind.WEIGHTS, chunk.model_id, chunk.version, chunk.epoch, 1, chunk.layout, flags
    )
    return [head, body + schema if schema else body, chunk.payload]


def decode_chunk(
    frames: Sequence[Buffer],
    model_id: str,
    version: int,
    epoch: int,
    flags: int,
    nbufs: int,
    layout: bytes,
) -> Chunk:
    """The chunk in ``frames``, whose header (already checked) held the other arguments.

    Raises :class:`FrameError`, or what ``json`` and ``struct`` raise on hostile input.
    """
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
    if flags != expected or flags & ~CHUNK_FLAGS:
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
            rest, named = _split_trailer(rest, _MAX_TARGETS_BYTES, "targets")
            if not isinstance(named, list) or not all(
                type(w) is int and 0 <= w <= U64_MAX for w in named
            ):
                raise FrameError("targets must be a JSON list of worker ids")
            targets = tuple(named)
        if flags & FLAG_METADATA:
            rest, metadata = _split_trailer(rest, MAX_METADATA_BYTES, "metadata")
            if not isinstance(metadata, dict):
                raise FrameError(f"metadata must be a JSON object; got {type(metadata).__name__}")
        schema = decode_schema(rest, layout, total)
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
