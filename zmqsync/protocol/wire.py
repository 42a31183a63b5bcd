"""The binary layouts of the wire: the header, the chunk and ack bodies, flags, digests.

A message is ``[header, body, buffer, buffer, ...]``:

- ``header``: a fixed binary struct (:data:`HEADER`) followed by the UTF-8 model_id.
- ``body``: for a chunk of weights, a fixed binary struct (:data:`CHUNK_BODY`), then
  (first chunk only) the JSON schema of the version's tensors; for an ack, a fixed
  binary struct (:data:`ACK_BODY`) and its three texts; for every other kind, a small
  JSON object with that kind's fields.
- ``buffer``: a chunk's payload, raw bytes never copied by the codec.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Final

from zmqsync.protocol.limits import MAX_MODEL_ID_BYTES
from zmqsync.protocol.messages import Buffer, Kind

__all__ = ["ACK_BODY", "CHUNK_BODY", "HEADER", "MAGIC", "PROTOCOL_VERSION", "checksum", "digest"]

#: First bytes of every header. A frame that does not start with them is not ours.
MAGIC: Final = b"ZSY1"
#: Bumped on any incompatible change of the header or a body (2: session secrets;
#: 3: a version travels as a stream of chunks).
PROTOCOL_VERSION: Final = 3

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
#: An ack's body: worker, received_bytes, rejected_frames, pid, apply_seconds, applied,
#: and the UTF-8 lengths of reason, host and session, which follow it in that order.
#: Binary rather than JSON: the sender decodes one per worker per version, on the path
#: every ``send()`` waits on.
ACK_BODY: Final = struct.Struct("!QQQQdBHHH")

#: Header flags of a chunk: the first and the last of its version, whether it carries a
#: checksum, (first chunk only) metadata and targets, and whether the version is a delta.
FLAG_FIRST: Final = 1
FLAG_LAST: Final = 2
FLAG_CHECKSUM: Final = 4
FLAG_METADATA: Final = 8
FLAG_DELTA: Final = 16
FLAG_TARGETS: Final = 32
CHUNK_FLAGS: Final = (
    FLAG_FIRST | FLAG_LAST | FLAG_CHECKSUM | FLAG_METADATA | FLAG_DELTA | FLAG_TARGETS
)

#: The largest version, epoch and worker id: each travels in 64 unsigned bits.
U64_MAX: Final = (1 << 64) - 1
#: The layout digest of a message that is not a chunk.
NO_DIGEST: Final = bytes(16)
#: Kinds by their header byte.
KINDS: Final[dict[int, Kind]] = {k.value: k for k in Kind}
#: JSON bodies and trailers: compact (one encoder, not one per message).
COMPACT_JSON: Final = json.JSONEncoder(separators=(",", ":"))


def digest(body: Buffer) -> bytes:
    """The 16-byte schema digest carried in a weights header."""
    return hashlib.blake2b(body, digest_size=16).digest()


def checksum(payload: Buffer) -> int:
    """What a chunk's ``checksum`` field holds for ``payload`` (CRC-32 plus one)."""
    return zlib.crc32(payload) + 1


def pack_header(
    kind: Kind,
    model_id: str,
    version: int,
    epoch: int,
    nbufs: int,
    schema_digest: bytes,
    flags: int = 0,
) -> bytes:
    """A message's first frame; ``ValueError`` if a field does not fit in it."""
    mid = model_id.encode()
    if len(mid) > MAX_MODEL_ID_BYTES:
        raise ValueError(f"model_id is {len(mid)} bytes; the limit is {MAX_MODEL_ID_BYTES}")
    if not (0 <= version <= U64_MAX and 0 <= epoch <= U64_MAX):
        raise ValueError(f"version and epoch must fit in 64 unsigned bits: {version}, {epoch}")
    return (
        HEADER.pack(
            MAGIC, PROTOCOL_VERSION, kind, flags, version, epoch, nbufs, len(mid), schema_digest
        )
        + mid
    )
