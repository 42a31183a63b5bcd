"""Encode messages to lists of buffers and decode them back. Pure functions, no I/O.

The header is checked and dispatched here, as are the bodies of acks (a binary struct)
and of the control messages (JSON); chunks go to :mod:`zmqsync.protocol.chunks`. The
layouts are in :mod:`zmqsync.protocol.wire`. :func:`decode` either returns a message or
raises :class:`~zmqsync.errors.FrameError`, whatever it is given; fuzz tests hold it to that.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import struct
import typing
from collections.abc import Collection, Sequence
from typing import Any, Final

from zmqsync.errors import FrameError
from zmqsync.protocol.chunks import decode_chunk, encode_chunk
from zmqsync.protocol.limits import (
    MAX_BELOW,
    MAX_BODY_BYTES,
    MAX_MODEL_ID_BYTES,
    MAX_PARTS,
    MAX_TEXT_CHARS,
    SESSION_CHARS,
)
from zmqsync.protocol.messages import Ack, Buffer, Chunk, Kind, Message

# Each ``X as X``: a name this module held before the codec was split, importable still.
from zmqsync.protocol.schemas import layout_digest as layout_digest
from zmqsync.protocol.slices import decode_slices, encode_slices
from zmqsync.protocol.wire import (
    ACK_BODY,
    COMPACT_JSON,
    HEADER,
    KINDS,
    MAGIC,
    NO_DIGEST,
    PROTOCOL_VERSION,
    U64_MAX,
    pack_header,
)
from zmqsync.protocol.wire import CHUNK_BODY as CHUNK_BODY
from zmqsync.protocol.wire import FLAG_METADATA as FLAG_METADATA
from zmqsync.protocol.wire import META_LEN as META_LEN
from zmqsync.protocol.wire import digest as digest

__all__ = ["decode", "encode", "peek_kind", "worker_id_key"]

#: Every message but a chunk and an ack has a JSON body: its fields but the header's.
_JSON_KINDS: Final[dict[Kind, type]] = {
    cls.kind: cls for cls in typing.get_args(Message) if cls not in (Chunk, Ack)
}
#: Header fields, which travel in the struct rather than in the JSON body.
_HEADER_FIELDS: Final = frozenset({"model_id", "version", "epoch"})
#: Fields added since a message was first sent, left out of its body while empty: the
#: message is then the very bytes it was before them.
_OMITTED_IF_EMPTY: Final = frozenset({"ranks", "gathering", "waiting", "slices"})
_JSON_DECODER: Final = json.JSONDecoder()


def encode(message: Message, *, schema_bytes: bytes | None = None) -> list[Buffer]:
    """Turn a message into ``[header, body, *buffers]``.

    ``schema_bytes``: for a first :class:`Chunk`, the schema JSON a sender encoded once
    (:func:`~zmqsync.protocol.schemas.encode_schema`), instead of encoding
    ``message.schema`` again. A chunk's payload is passed through untouched (zero-copy).
    """
    if isinstance(message, Chunk):
        return encode_chunk(message, schema_bytes)
    if isinstance(message, Ack):
        body = _encode_ack(message)
    else:
        cls: type = type(message)  # mypy takes a plain type for hashable, not a union
        fields = {name: getattr(message, name) for name, _, _ in _body_fields(cls)}
        for name in _OMITTED_IF_EMPTY & fields.keys():
            if not fields[name]:
                del fields[name]
        if "slices" in fields:
            fields["slices"] = encode_slices(fields["slices"])
        body = COMPACT_JSON.encode(fields).encode()
    head = pack_header(message.kind, message.model_id, message.version, message.epoch, 0, NO_DIGEST)
    return [head, body]


def peek_kind(header: Buffer) -> Kind | None:
    """The kind of a message from its first frame, or ``None`` if it is not ours.

    O(1) and never raises, whatever it is given (no validation beyond magic and kind):
    a sender uses it to drop kinds it never accepts unparsed.
    """
    try:
        if len(header) < HEADER.size or bytes(header[:4]) != MAGIC:
            return None
        return KINDS.get(header[5])
    # What a non-bytes "frame" raises: a str, a multi-dimensional memoryview, None.
    except (TypeError, ValueError, IndexError, NotImplementedError):
        return None


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
        # json and struct raise these on hostile input the checks did not catch.
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
    kind = KINDS.get(kind_byte)
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
        return decode_chunk(frames, model_id, version, epoch, flags, nbufs, schema_digest)
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


# --- acks: a binary struct, then three texts ----------------------------------------


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


# --- control messages: a JSON object of the fields the header does not carry ---------


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
        ok = type(value) is int and 0 <= value <= U64_MAX
    elif expected == "float":
        ok = type(value) in (int, float) and math.isfinite(value)
        value = float(value) if ok else value
    elif expected == "bool":
        ok = type(value) is bool
    elif expected == "str":
        ok = type(value) is str and len(value) <= MAX_TEXT_CHARS
    elif expected == "dict[str, int]":  # worker id -> version (a relay's claims)
        ok = _worker_versions(value)
    elif expected == "tuple[str, ...]":  # endpoints (a sharded learner's ranks)
        ok = (
            type(value) is list
            and len(value) <= MAX_PARTS
            and all(type(v) is str and 0 < len(v) <= MAX_TEXT_CHARS for v in value)
        )
        value = tuple(value) if ok else value
    elif expected == "tuple[int, ...]":  # parts (of a sharded learner's version)
        ok = (
            type(value) is list
            and len(value) <= MAX_PARTS
            and all(type(v) is int and 0 <= v < MAX_PARTS for v in value)
            and all(a < b for a, b in itertools.pairwise(value))
        )
        value = tuple(value) if ok else value
    elif expected == "tuple[Slice, ...]":  # a tensor-parallel worker's slices
        return decode_slices(value)
    else:  # dict[str, Any]: the status document
        ok = type(value) is dict
    if not ok:
        raise FrameError(f"{cls.__name__}.{name} must be {expected}; got {value!r:.80}")
    return value


#: The longest decimal worker id: U64_MAX has 20 digits.
_WORKER_ID_CHARS: Final = len(str(U64_MAX))


def worker_id_key(key: object) -> int | None:
    """A worker id written as a JSON key (ASCII digits, at most 20, within the wire's
    integer range), or None. ``str.isdigit`` alone lets ``"²"`` through, which ``int``
    then refuses."""
    if type(key) is not str or not 0 < len(key) <= _WORKER_ID_CHARS:
        return None
    if not (key.isascii() and key.isdigit()):
        return None
    value = int(key)
    return value if value <= U64_MAX else None


def _worker_versions(value: Any) -> bool:
    """Whether ``value`` is ``{"<worker id>": version}``: at most MAX_BELOW entries, each
    id as :func:`worker_id_key` reads it and each version within the wire's range."""
    return (
        type(value) is dict
        and len(value) <= MAX_BELOW
        and all(
            worker_id_key(k) is not None and type(v) is int and 0 <= v <= U64_MAX
            for k, v in value.items()
        )
    )
