"""One version of weights as the chunk messages a sender sends (for tests and tools)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zmqsync.chunking.layout import DEFAULT_CHUNK_BYTES, StreamLayout
from zmqsync.protocol import Buffer, Chunk, encode
from zmqsync.tensors.extract import extract
from zmqsync.tensors.flatten import Flattener

__all__ = ["version_messages"]


def version_messages(
    weights: Any,
    *,
    model_id: str = "policy",
    version: int = 1,
    epoch: int = 1,
    strategy: str = "state_dict",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[list[Buffer]]:
    """One version of ``weights`` (a module, TensorDict or dict of tensors) as the chunk
    messages a sender sends, each ready for a transport's ``send_frames`` (tests, tools)."""
    flat = Flattener(strategy).flatten(extract(weights, strategy))
    layout = StreamLayout(flat, chunk_bytes)
    data = np.empty(layout.total, dtype=np.uint8)
    sources = layout.sources(flat)
    messages = []
    for i in range(layout.count):
        offset, length = layout.span(i)
        layout.write(i, sources, data[offset : offset + length])
        chunk = Chunk(
            model_id,
            version,
            epoch,
            i,
            layout.count,
            offset,
            layout.total,
            layout.layout,
            data[offset : offset + length].tobytes(),
        )
        messages.append(encode(chunk, schema_bytes=layout.schema_bytes if i == 0 else None))
    return messages
