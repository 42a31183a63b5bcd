"""A Flat through the wire, as a staged worker receives it (test helper)."""

from __future__ import annotations

import numpy as np

from zmqsync.chunking.layout import MIN_CHUNK_BYTES, StreamLayout
from zmqsync.chunking.staging import Staging
from zmqsync.protocol import Chunk, Weights, decode, encode
from zmqsync.tensors.flatten import Flat


def through_the_wire(flat: Flat, chunk_bytes: int = MIN_CHUNK_BYTES) -> Weights:
    """``flat`` laid out as a stream, cut into chunks, encoded, decoded from copies of
    the bytes, and gathered again."""
    layout = StreamLayout(flat, chunk_bytes)
    sources = layout.sources(flat)
    staging = Staging()
    staging.start(layout.total)
    for i in range(layout.count):
        offset, length = layout.span(i)
        payload = np.empty(length, dtype=np.uint8)
        layout.write(i, sources, payload)
        chunk = Chunk("m", 1, 1, i, layout.count, offset, layout.total, layout.layout, payload)
        frames = encode(chunk, schema_bytes=layout.schema_bytes if i == 0 else None)
        decoded = decode([bytes(f) for f in frames])
        assert isinstance(decoded, Chunk)
        staging.write(decoded.offset, decoded.payload)
    return staging.weights("m", 1, 1, layout.schema)
