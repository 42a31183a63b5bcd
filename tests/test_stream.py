"""The sans-IO chunk stream: a version is applied only from its first chunk to its last,
each in order; anything else breaks it, and says why."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync.protocol import Chunk, TensorEntry, WeightsSchema
from zmqsync.protocol.stream import Apply, Broken, ChunkStream, Ignored, Start

SCHEMA = WeightsSchema("state_dict", (TensorEntry(("w",), "uint8", (40,), 0, 0, 40),))


def _version(
    version: int, epoch: int = 1, count: int = 4, layout: bytes = b"L" * 16
) -> list[Chunk]:
    size = 40 // count
    return [
        Chunk(
            "p",
            version,
            epoch,
            i,
            count,
            i * size,
            40,
            layout,
            bytes(size),
            SCHEMA if i == 0 else None,
        )
        for i in range(count)
    ]


def _kinds(events: list[object]) -> list[str]:
    return [type(e).__name__ for e in events]


def test_a_whole_version_starts_applies_every_chunk_and_ends() -> None:
    stream = ChunkStream(gap=10)
    events = [e for c in _version(1) for e in stream.feed(c, 0.0)]
    assert _kinds(events) == ["Start", "Apply", "Apply", "Apply", "Apply"]
    assert [e.chunk.index for e in events if isinstance(e, Apply)] == [0, 1, 2, 3]
    assert not stream.active


def test_a_missing_chunk_breaks_the_version_and_says_which() -> None:
    stream = ChunkStream(gap=10)
    a, b, _, d = _version(1)
    stream.feed(a, 0)
    stream.feed(b, 0)
    events = stream.feed(d, 0)
    assert _kinds(events) == ["Broken", "Ignored"]
    broken = events[0]
    assert isinstance(broken, Broken) and broken.version == 1 and "chunk 2 of 4" in broken.reason
    assert not stream.active


def test_a_new_version_cuts_the_one_in_progress() -> None:
    stream = ChunkStream(gap=10)
    stream.feed(_version(1)[0], 0)
    events = stream.feed(_version(2)[0], 0)
    assert _kinds(events) == ["Broken", "Start", "Apply"]
    assert stream.in_progress == (1, 2)


def test_a_middle_chunk_of_another_version_or_layout_breaks_it() -> None:
    for intruder in (_version(2)[1], _version(1, layout=b"M" * 16)[1], _version(1, epoch=9)[1]):
        stream = ChunkStream(gap=10)
        stream.feed(_version(1)[0], 0)
        assert _kinds(stream.feed(intruder, 0)) == ["Broken", "Ignored"]


def test_a_silent_sender_breaks_the_stream_after_the_gap() -> None:
    stream = ChunkStream(gap=2.0)
    first, second, *_ = _version(1)
    stream.feed(first, 0.0)
    assert stream.expire(1.9) is None
    broken = stream.expire(2.1)
    assert isinstance(broken, Broken) and "no chunk for" in broken.reason
    # A chunk that comes after the gap finds nothing to continue.
    assert _kinds(stream.feed(second, 2.2)) == ["Ignored"]


def test_the_gap_counts_from_when_the_receiver_is_ready_for_the_next_chunk() -> None:
    """The time a receiver takes to apply a chunk is its own, not the stream's."""
    stream = ChunkStream(gap=2.0)
    first, second, *_ = _version(1)
    stream.feed(first, 0.0)
    stream.ready(5.0)  # it applied the first chunk only then
    assert stream.expire(6.9) is None
    assert _kinds(stream.feed(second, 6.9)) == ["Apply"]
    stream.ready(7.0)
    assert isinstance(stream.expire(9.1), Broken)
    stream.ready(20.0)  # nothing in progress: nothing to be ready for
    assert not stream.active


def test_an_unwanted_version_is_ignored_to_its_end() -> None:
    stream = ChunkStream(gap=10)
    events = [e for c in _version(1) for e in stream.feed(c, 0, wanted=False)]
    assert _kinds(events) == ["Ignored"] * 4
    assert all(isinstance(e, Ignored) for e in events)


@settings(max_examples=300)
@given(st.integers(0, 2**32), st.integers(1, 60))
def test_only_whole_versions_in_order_ever_complete(seed: int, steps: int) -> None:
    """Chunks of several versions, shuffled, dropped and repeated: every version the
    stream completes was applied from its first chunk to its last, in order, each once,
    with no other version's chunk in between."""
    rng = random.Random(seed)
    pool = [c for v in (1, 2, 3) for c in _version(v, count=rng.randint(1, 4))]
    # ...and finally a version sent whole, which must complete whatever came before.
    script = [rng.choice(pool) for _ in range(steps)] + _version(4, count=3)
    stream = ChunkStream(gap=10)
    applied: list[Chunk] = []
    completed = []
    for chunk in script:
        for event in stream.feed(chunk, 0.0):
            if isinstance(event, Start):
                applied = []
            elif isinstance(event, Apply):
                applied.append(event.chunk)
                if event.chunk.last:
                    assert [c.index for c in applied] == list(range(event.chunk.count))
                    assert len({(c.epoch, c.version) for c in applied}) == 1
                    completed.append(event.chunk.version)
                    applied = []
            elif isinstance(event, Broken):
                applied = []
    assert completed[-1:] == [4]
