"""The sans-IO codec: every message round-trips; any bytes decode or raise FrameError."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqsync.errors import FrameError
from zmqsync.protocol import (
    ACK_BODY,
    CHUNK_BODY,
    DTYPE_ITEMSIZE,
    HEADER,
    MAGIC,
    MAX_SCHEMA_BYTES,
    MAX_TEXT_CHARS,
    Ack,
    Chunk,
    ErrorMessage,
    Goodbye,
    Hello,
    Kind,
    Probe,
    ProbeRequest,
    Reading,
    SnapshotRequest,
    StatusReply,
    StatusRequest,
    TensorEntry,
    UpToDate,
    WeightsSchema,
    Welcome,
    checksum,
    decode,
    encode,
    encode_schema,
    layout_digest,
    peek_kind,
    schemas,
)

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
text = st.text(max_size=40)
model_ids = st.text(min_size=0, max_size=30)
names = st.text(min_size=1, max_size=12)


def _chunks(
    schema: WeightsSchema,
    stream: bytes,
    *,
    model_id: str = "p",
    version: int = 1,
    epoch: int = 2,
    chunk_bytes: int | None = None,
    checksums: bool = False,
) -> list[Chunk]:
    """A version's stream cut into chunks, as a sender cuts it."""
    size = chunk_bytes or max(1, len(stream))
    count = max(1, -(-len(stream) // size))
    layout = layout_digest(encode_schema(schema))
    out = []
    for i in range(count):
        payload = stream[i * size : (i + 1) * size]
        out.append(
            Chunk(
                model_id,
                version,
                epoch,
                i,
                count,
                i * size,
                len(stream),
                layout,
                payload,
                schema if i == 0 else None,
                checksum(payload) if checksums else 0,
            )
        )
    return out


@st.composite
def versions(draw) -> list[Chunk]:  # type: ignore[no-untyped-def]
    """A whole version as its chunks: tensors one after the other in the stream, with
    gaps (alignment) between them, cut at any chunk size."""
    n = draw(st.integers(0, 6))
    keys = draw(
        st.lists(
            st.lists(names, min_size=1, max_size=3).map(tuple), min_size=n, max_size=n, unique=True
        )
    )
    entries, stream = [], b""
    for key in keys:
        dtype = draw(st.sampled_from(sorted(DTYPE_ITEMSIZE)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        stream += bytes(draw(st.integers(0, 8)))
        entries.append(TensorEntry(key, dtype, shape, 0, len(stream), nbytes))
        stream += draw(st.binary(min_size=nbytes, max_size=nbytes))
    end = max((e.offset + e.nbytes for e in entries if e.nbytes), default=0)
    strategy = draw(st.sampled_from(["state_dict", "tensordict"]))
    return _chunks(
        WeightsSchema(strategy, tuple(entries)),
        stream[:end],
        model_id=draw(model_ids),
        version=draw(u64),
        epoch=draw(u64),
        chunk_bytes=draw(st.integers(1, 64)),
        checksums=draw(st.booleans()),
    )


control_messages = st.one_of(
    st.builds(
        Ack,
        model_ids,
        u64,
        u64,
        worker=u64,
        applied=st.booleans(),
        reason=text,
        received_bytes=u64,
        apply_seconds=st.floats(0, 1e6),
        rejected_frames=u64,
        pid=u64,
        host=text,
        session=st.text(alphabet="0123456789abcdef", max_size=32),
    ),
    st.builds(Hello, model_ids, u64, u64, worker=u64, pid=u64, host=text, attempt=text),
    st.builds(
        Welcome,
        model_ids,
        u64,
        u64,
        mode=text,
        strategy=text,
        data_endpoint=text,
        ack_endpoint=text,
        heartbeat_seconds=st.floats(0, 100),
        session=text,
        attempt=text,
    ),
    st.builds(SnapshotRequest, model_ids, u64, u64, worker=u64, session=text),
    st.builds(UpToDate, model_ids, u64, u64),
    st.builds(
        ProbeRequest, model_ids, worker=u64, nonce=text, version=u64, epoch=u64, session=text
    ),
    st.builds(Probe, model_ids, worker=u64, nonce=text, version=u64, epoch=u64),
    st.builds(StatusRequest, model_ids, u64, u64),
    st.builds(
        StatusReply,
        model_ids,
        u64,
        u64,
        status=st.dictionaries(text, st.one_of(st.integers(), text, st.none()), max_size=4),
    ),
    st.builds(ErrorMessage, model_ids, code=text, message=text, version=u64, epoch=u64),
    st.builds(Goodbye, model_ids, u64, u64, worker=u64, session=text),
    st.builds(
        Reading,
        model_ids,
        u64,
        u64,
        worker=u64,
        session=text,
        index=u64,
        gap=st.floats(-1e9, 1e9, allow_nan=False),
    ),
)


@given(control_messages)
def test_control_messages_round_trip(message) -> None:  # type: ignore[no-untyped-def]
    frames = encode(message)
    assert peek_kind(frames[0]) is message.kind
    assert decode(frames) == message


@given(versions())
def test_chunks_round_trip_without_copying_payloads(chunks: list[Chunk]) -> None:
    for chunk in chunks:
        frames = encode(chunk)
        assert peek_kind(frames[0]) is Kind.WEIGHTS
        decoded = decode(frames)
        assert decoded == chunk
        assert isinstance(decoded, Chunk) and decoded.payload is frames[2]
    assert sum(len(c.payload) for c in chunks) == chunks[0].total


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), max_size=6))
def test_any_bytes_decode_or_raise_frame_error(frames: list[bytes]) -> None:
    with contextlib.suppress(FrameError):
        decode(frames)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(control_messages, versions().map(lambda c: c[-1]), versions().map(lambda c: c[0])),
    st.data(),
)
def test_corrupted_messages_decode_or_raise_frame_error(message, data) -> None:  # type: ignore[no-untyped-def]
    frames = [bytearray(f) for f in encode(message)]
    i = data.draw(st.integers(0, len(frames) - 1))
    if frames[i]:
        j = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i][j] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(frames)))
    for candidate in ([bytes(f) for f in frames], [bytes(f) for f in frames[:cut]]):
        with contextlib.suppress(FrameError):
            decode(candidate)


def _weights_frames() -> list[bytes]:
    entry = TensorEntry(("w",), "float32", (2,), 0, 0, 8)
    (chunk,) = _chunks(WeightsSchema("state_dict", (entry,)), b"\0" * 8)
    return [bytes(f) for f in encode(chunk)]


def _set_flags(head: bytes, flags: int) -> bytes:
    return head[:6] + flags.to_bytes(2, "big") + head[8:]


def _set_body(body: bytes, **fields: int) -> bytes:
    index, count, offset, total, crc = CHUNK_BODY.unpack_from(body)
    values = {"index": index, "count": count, "offset": offset, "total": total, "crc": crc}
    values.update(fields)
    return CHUNK_BODY.pack(*values.values()) + body[CHUNK_BODY.size :]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda f: [b"XXXX" + f[0][4:], *f[1:]], "bad magic"),
        (lambda f: [f[0][:4] + b"\x09" + f[0][5:], *f[1:]], "protocol version 9"),
        (lambda f: [f[0][:5] + b"\x77" + f[0][6:], *f[1:]], "unknown message kind"),
        (lambda f: f[:2], "3 frames"),
        (lambda f: [f[0], f[1], b"\0" * 4], "ends at 4, not at the total 8"),
        (lambda f: [f[0], f[1].replace(b"float32", b"float99"), f[2]], "digest"),
        (lambda f: f[:1], "at least 2 frames"),
        (lambda f: [f[0], _set_body(f[1], count=0), f[2]], "out of range"),
        (lambda f: [f[0], _set_body(f[1], index=3, count=2), f[2]], "out of range"),
        (lambda f: [f[0], _set_body(f[1], total=1 << 50), f[2]], "limits"),
        (lambda f: [_set_flags(f[0], 1), *f[1:]], "flags"),  # first, not last: it is both
        (lambda f: [_set_flags(f[0], 3 | 64), *f[1:]], "flags"),
        (lambda f: [_set_flags(f[0], 3 | 32), *f[1:]], "targets"),
        (lambda f: [_set_flags(f[0], 3 | 16), *f[1:]], "delta of version 1 against"),
        (lambda f: [_set_flags(f[0], 3 | 4), _set_body(f[1], crc=5), f[2]], "checksum"),
        (lambda f: [f[0], _set_body(f[1], crc=5), f[2]], "do not announce"),
        (lambda f: [f[0], _set_body(f[1], offset=1, total=9), f[2]], "starts at 1"),
        (lambda f: [f[0], _set_body(f[1], total=16), b"\0" * 16], "span 8 bytes"),
    ],
)
def test_malformed_chunks_say_what_is_wrong(mutate, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameError, match=match):
        decode(mutate(_weights_frames()))


def test_only_a_first_chunk_carries_a_schema() -> None:
    entry = TensorEntry(("w",), "float32", (4,), 0, 0, 16)
    first, second = _chunks(WeightsSchema("state_dict", (entry,)), bytes(16), chunk_bytes=8)
    frames = [bytes(f) for f in encode(second)]
    assert decode(frames) == second
    with pytest.raises(FrameError, match="only the first chunk"):
        decode([frames[0], frames[1] + b"{}", frames[2]])
    head = bytes(encode(first)[0])
    with pytest.raises(FrameError, match="flags"):  # a middle chunk posing as a first
        decode([_set_flags(head, 1), frames[1], frames[2]])


def _ack_frames(**fields: object) -> list[bytes]:
    ack = Ack("p", 3, 4, worker=1, applied=True, reason="", received_bytes=8, pid=7, host="h")
    return [bytes(f) for f in encode(dataclasses.replace(ack, **fields))]  # type: ignore[arg-type]


def _ack_body(**values: object) -> bytes:
    fields = dict(
        worker=1,
        received=8,
        rejected=0,
        pid=7,
        seconds=0.5,
        applied=1,
        reason=b"",
        host=b"h",
        session=b"s" * 32,
    )
    fields.update(values)
    texts = [fields.pop("reason"), fields.pop("host"), fields.pop("session")]
    lengths = [len(t) for t in texts]  # type: ignore[arg-type]
    return ACK_BODY.pack(*fields.values(), *lengths) + b"".join(texts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "ACK body is 0 bytes; at least"),
        (_ack_body()[:-1], "its texts say"),
        (_ack_body() + b"x", "its texts say"),
        (_ack_body(applied=2), "applied must be 0 or 1"),
        (_ack_body(seconds=float("nan")), "finite"),
        (_ack_body(reason=b"\xff\xfe"), "UnicodeDecodeError"),
        (_ack_body(host=b"h" * (MAX_TEXT_CHARS + 1)), "limited to"),
        (_ack_body(session=b"s" * 33), "session is at most"),
    ],
)
def test_malformed_acks_say_what_is_wrong(body: bytes, match: str) -> None:
    """An ack's body is a binary struct (the sender decodes one per worker per send)."""
    head = _ack_frames()[0]
    expected = Ack("p", 3, 4, 1, True, "", 8, 0.5, 0, 7, "h", "s" * 32)
    assert decode([head, _ack_body()]) == expected
    with pytest.raises(FrameError, match=match):
        decode([head, body])


def test_an_ack_that_cannot_be_encoded_says_which_field() -> None:
    with pytest.raises(ValueError, match="out of range"):
        _ack_frames(pid=-1)


def test_limits_are_checked_before_parsing() -> None:
    frames = _weights_frames()
    huge = b" " * (MAX_SCHEMA_BYTES + 1)
    with pytest.raises(FrameError, match="limit"):
        decode([frames[0], frames[1][: CHUNK_BODY.size] + huge, frames[2]])
    deep = b"[" * 100_000
    with pytest.raises(FrameError):
        decode([encode(StatusRequest("p"))[0], deep])


def test_frame_error_is_a_value_error() -> None:
    assert issubclass(FrameError, ValueError)
    assert HEADER.size == 46
    assert Kind.WEIGHTS == 1


# --- receiver bombs: a schema that would make a receiver allocate what the wire lacks ---


def _frames(entries: list[TensorEntry], buffers: list[bytes]) -> list[bytes]:
    """A one-chunk version as a hostile sender would build it: any entries, a valid
    digest, the buffers' bytes as the stream."""
    schema = WeightsSchema("state_dict", tuple(entries))
    (chunk,) = _chunks(schema, b"".join(buffers))
    return [bytes(f) for f in encode(chunk)]


_TIB = 1 << 40


@pytest.mark.parametrize(
    ("entries", "buffers"),
    [
        pytest.param(
            [
                TensorEntry(("a",), "float32", (2,), 0, 0, 8),
                TensorEntry(("b",), "float32", (2,), 0, 4, 8),
            ],
            [bytes(12)],
            id="overlapping-entries",
        ),
        pytest.param(
            [TensorEntry(("a",), "float32", (2,), 0, 4, 8)], [bytes(8)], id="past-buffer-end"
        ),
        pytest.param(
            # 200 tensors of the same kilobyte: 200 KiB to allocate for 1 KiB on the wire
            [TensorEntry((f"t{i}",), "uint8", (1024,), 0, 0, 1024) for i in range(200)],
            [bytes(1024)],
            id="total-larger-than-buffers",
        ),
        pytest.param(
            [TensorEntry(("a",), "float32", (2, 3), 0, 0, 8)], [bytes(24)], id="nbytes-not-shape"
        ),
        pytest.param(
            # holds no element, yet torch's stride computation overflows on it
            [TensorEntry(("a",), "float32", (0, _TIB, _TIB), 0, 0, 0)],
            [b""],
            id="overflowing-shape",
        ),
        pytest.param(
            [TensorEntry(("a",), "float32", (_TIB, _TIB), 0, 0, _TIB * _TIB * 4)],
            [b""],
            id="shape-product-past-limit",
        ),
        pytest.param(
            [TensorEntry(("a",), "float32", (-1, -2), 0, 0, 8)], [bytes(8)], id="negative-dim"
        ),
    ],
)
def test_receiver_bombs_are_refused(entries: list[TensorEntry], buffers: list[bytes]) -> None:
    with pytest.raises(FrameError):
        decode(_frames(entries, buffers))


def test_empty_tensors_share_no_bytes() -> None:
    """Zero-byte entries may sit anywhere inside their buffer, next to others or on them."""
    entries = [
        TensorEntry(("a",), "float32", (2,), 0, 0, 8),
        TensorEntry(("b",), "float32", (0, 3), 0, 4, 0),
        TensorEntry(("c",), "float32", (0,), 0, 8, 0),
    ]
    decoded = decode(_frames(entries, [bytes(8)]))
    assert isinstance(decoded, Chunk)
    assert decoded.schema is not None and decoded.schema.entries == tuple(entries)


def test_a_schema_is_cached_only_once_a_whole_message_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = schemas._SchemaCache()
    monkeypatch.setattr(schemas, "_schema_cache", cache)
    entry = TensorEntry(("w",), "float32", (4,), 0, 0, 16)
    good = _frames([entry], [bytes(16)])
    short = [good[0], _set_body(good[1], total=12), bytes(12)]
    with pytest.raises(FrameError, match="span 16 bytes"):
        decode(short)
    with pytest.raises(FrameError, match="overlap"):
        decode(_frames([entry, dataclasses.replace(entry, key=("v",))], [bytes(16)]))
    assert len(cache) == 0
    decode(good)
    assert short[1][CHUNK_BODY.size :] in cache
    # Totals differ per message: a cached schema is still checked against them.
    with pytest.raises(FrameError, match="span 16 bytes"):
        decode(short)


def test_the_schema_cache_holds_a_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of large schemas, each valid, cannot pin more than the budget."""
    cache = schemas._SchemaCache(max_bytes=4096)
    monkeypatch.setattr(schemas, "_schema_cache", cache)
    bodies = []
    for i in range(40):
        # ~1 KiB of schema each: 40 of them are ten times the budget
        entry = TensorEntry((f"t{i}", "x" * 1000), "uint8", (1,), 0, 0, 1)
        frames = _frames([entry], [b"\0"])
        decode(frames)
        bodies.append(frames[1][CHUNK_BODY.size :])
        assert cache.nbytes <= cache.max_bytes
        assert cache.nbytes == sum(len(b) for b in bodies if b in cache)
    assert bodies[-1] in cache and bodies[0] not in cache
    assert 0 < len(cache) < 5
    huge = _frames([TensorEntry(("big", "x" * 4000, "y" * 1000), "uint8", (1,), 0, 0, 1)], [b"\0"])
    decode(huge)
    assert huge[1][CHUNK_BODY.size :] not in cache  # larger than the whole budget: never kept
    assert bodies[-1] in cache
    assert schemas._SchemaCache().max_bytes == schemas.SCHEMA_CACHE_BYTES


_MUTATIONS = ("offset", "nbytes", "shape", "buffer", "alias", "resize")


@st.composite
def mutated_weights(draw) -> list[bytes]:  # type: ignore[no-untyped-def]
    """A valid one-chunk version, then a few hostile edits of its schema or its stream;
    re-encoded with a valid digest so that the decoder's checks, not the digest, decide."""
    (chunk,) = draw(
        versions()
        .map(lambda cs: _chunks(cs[0].schema, b"".join(bytes(c.payload) for c in cs)))
        .filter(lambda cs: cs[0].schema.entries)
    )
    entries, stream = list(chunk.schema.entries), bytes(chunk.payload)
    ints = st.one_of(st.integers(-2, 40), st.sampled_from([_TIB, _TIB + 1, 1 << 63, -(1 << 63)]))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(entries) - 1))
        e = entries[i]
        what = draw(st.sampled_from(_MUTATIONS))
        if what == "shape":
            e = dataclasses.replace(e, shape=tuple(draw(st.lists(ints, max_size=4))))
        elif what == "alias":  # another tensor's bytes, under this one's key
            other = entries[draw(st.integers(0, len(entries) - 1))]
            e = dataclasses.replace(other, key=e.key)
        elif what == "resize":
            stream = bytes(draw(st.integers(0, len(stream) + 8)))
        else:
            e = dataclasses.replace(e, **{what: draw(ints)})
        entries[i] = e
    return _frames(entries, [stream])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_weights())
def test_mutated_weights_decode_inside_their_stream_or_raise(frames: list[bytes]) -> None:
    try:
        message = decode(frames)
    except FrameError:
        return
    assert isinstance(message, Chunk) and message.schema is not None
    spans = []
    for e in message.schema.entries:
        assert e.buffer == 0 and e.offset >= 0
        assert e.offset + e.nbytes <= message.total or not e.nbytes  # empty: no bytes anywhere
        assert e.nbytes == math.prod(e.shape) * DTYPE_ITEMSIZE[e.dtype]
        assert math.prod(max(d, 1) for d in e.shape) * DTYPE_ITEMSIZE[e.dtype] <= _TIB
        if e.nbytes:
            spans.append((e.offset, e.offset + e.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert sum(e.nbytes for e in message.schema.entries) <= message.total == len(message.payload)


# --- routing before decoding -----------------------------------------------------------


def test_decode_refuses_kinds_not_accepted_before_parsing_the_body() -> None:
    frames = _weights_frames()
    assert isinstance(decode(frames, accept={Kind.WEIGHTS}), Chunk)
    with pytest.raises(FrameError, match="unexpected kind WEIGHTS"):
        decode([frames[0], b"not even json", *frames[2:]], accept=(Kind.ACK, Kind.HELLO))
    ack = _ack_frames()
    assert isinstance(decode(ack, accept=frozenset({Kind.ACK})), Ack)
    with pytest.raises(FrameError, match="unexpected kind ACK"):
        decode(ack, accept=())


@settings(max_examples=300)
@given(
    st.one_of(
        st.binary(max_size=80),
        st.binary(min_size=HEADER.size, max_size=HEADER.size + 8).map(lambda b: MAGIC + b[4:]),
    )
)
def test_peek_kind_never_raises(header: bytes) -> None:
    kind = peek_kind(header)
    assert kind is None or (isinstance(kind, Kind) and header[:4] == MAGIC)
    assert peek_kind(memoryview(header)) is kind
    assert peek_kind(bytearray(header)) is kind


@pytest.mark.parametrize(
    "garbage",
    [
        None,
        7,
        "ZSY1" + "x" * 60,
        memoryview(MAGIC + bytes(60)).cast("B", (64, 1)),  # indexing it raises
        memoryview(b""),
    ],
)
def test_peek_kind_returns_none_for_what_is_not_a_frame(garbage: object) -> None:
    assert peek_kind(garbage) is None  # type: ignore[arg-type]
