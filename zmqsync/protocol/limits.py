"""What the protocol accepts: a limit on every size a message announces, each checked
before anything is allocated for it, and the dtypes a tensor may have on the wire.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DTYPE_ITEMSIZE",
    "MAX_BELOW",
    "MAX_BODY_BYTES",
    "MAX_BUFFERS",
    "MAX_CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_MODEL_ID_BYTES",
    "MAX_NDIM",
    "MAX_PARTS",
    "MAX_SCHEMA_BYTES",
    "MAX_SLICES",
    "MAX_TARGETS",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "MAX_TEXT_CHARS",
    "MAX_VERSION_BYTES",
    "SESSION_CHARS",
    "WIRE_DTYPES",
]

#: model_ids are short names ("policy"); a longer one is garbage, not a name.
MAX_MODEL_ID_BYTES: Final = 256
#: Workers a relay names in each heartbeat (``SnapshotRequest.below``); the rest are
#: counted by the relay's own status.
MAX_BELOW: Final = 1_000
#: Worker ids a version's first chunk may name as its targets (through relays).
MAX_TARGETS: Final = 16_384
#: One tensor per entry; 100k covers the largest state_dicts seen in practice (LLMs have
#: a few thousand) while keeping a hostile schema from describing billions of entries.
MAX_TENSORS: Final = 100_000
#: A schema entry is ~60 bytes of JSON, so 100k tensors fit in well under 16 MiB.
MAX_SCHEMA_BYTES: Final = 16 * 1024 * 1024
#: Tensor buffers per message: at most one per tensor, plus the packed small-tensor buffer.
MAX_BUFFERS: Final = MAX_TENSORS + 1
#: Control bodies (acks, requests, status) are small JSON; status of a 10k-worker fleet
#: is the largest and stays far below this.
MAX_BODY_BYTES: Final = 8 * 1024 * 1024
#: Chunks per version: a version of 1 TiB in chunks of 64 KiB. Bounds the index a
#: receiver tracks, not memory (a receiver holds a chunk or two at a time).
MAX_CHUNKS: Final = 1 << 24
#: One chunk's payload: what a receiver must be ready to hold at once.
MAX_CHUNK_BYTES: Final = 1 << 30
#: One version's bytes, all chunks together.
MAX_VERSION_BYTES: Final = 1 << 44
#: Parts one version may be made of (the ranks of a sharded learner): a worker keeps a
#: session and a stream per part.
MAX_PARTS: Final = 1024
#: Slices one worker may declare in its Hello (one per tensor it holds a slice of):
#: each rank cuts every version for it, so the declaration is bounded like a schema's
#: tensors, and far below them (tensor-parallel workers slice a few thousand tensors).
MAX_SLICES: Final = 16_384
#: torch supports at most 64 dimensions; real weights have fewer than 8.
MAX_NDIM: Final = 64
#: One tensor's bytes; guards the shape product from overflowing into nonsense.
MAX_TENSOR_BYTES: Final = 1 << 40
#: Free-text fields (reasons, hosts, endpoints) in control bodies.
MAX_TEXT_CHARS: Final = 4096
#: A version's metadata (``send(..., metadata=)``), as compact JSON: a tag such as the
#: optimizer step, not a side channel for data.
MAX_METADATA_BYTES: Final = 64 * 1024

#: Element size of every dtype name the protocol accepts. The protocol does not import
#: torch; zmqsync.tensors maps these names to torch dtypes (and checks the table agrees).
DTYPE_ITEMSIZE: Final[dict[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

#: Floating dtypes a version may be cast to for the wire (``wire_dtype``), and those it
#: may be cast from (every floating one).
WIRE_DTYPES: Final = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
FLOAT_DTYPES: Final = frozenset(n for n in DTYPE_ITEMSIZE if n.startswith(("float", "bfloat")))

#: A session secret travels as this many hex characters (128 random bits).
SESSION_CHARS: Final = 32
