"""What a sharded learner's rank holds: without a snapshot, nothing above a few chunk
buffers; with one, its own part (about 1/M of the model), never the whole model.

Spawned FSDP2 ranks over gloo and a worker with a plain module; each rank samples its own
memory from just before ``init_on_sender`` through ``connect()`` and a few sends.
"""

from __future__ import annotations

from typing import Any

import pytest
from _sharded_fixtures import Processes, ask, ipc_endpoints

from zmqsync.sender.transfers import RING_SLOTS

MIB = 1 << 20

#: Ranks, and 16 MiB layers: a 128 MiB model, 64 MiB per rank (uneven shards), large
#: enough that a copy of a part or of the model stands far above the noise.
WORLD = 2
LAYERS = 8
#: Small chunks, so that the buffers a send may hold at once stay far below a rank's
#: part: the sender's ring holds at most ``RING_SLOTS`` chunks (the window in flight, and
#: those a slow reader's transport queue still holds, as on a loaded machine), 8 MiB here.
CHUNK_BYTES = 256 * 1024
#: What a rank may allocate above its shard without a snapshot: the ring at its fullest,
#: and what libzmq and the sender's threads allocate (a few MiB), far below a part
#: (64 MiB). Quiet, a rank measures about 5 MiB; a full ring is the loaded worst case.
SLACK = RING_SLOTS * CHUNK_BYTES + 16 * MIB
#: What resident memory may show besides: the new threads' stacks and malloc arenas.
RSS_SLACK = 16 * MIB
#: Sends measured after connect().
VERSIONS = 3


def _answer(conn: Any, kind: str, timeout: float = 180.0) -> tuple[Any, ...]:
    assert conn.poll(timeout), f"no {kind!r} within {timeout}s"
    reply = conn.recv()
    assert reply[0] == kind, reply
    return tuple(reply)


def _ranks_and_worker(tmp_path: Any, retain: bool) -> list[tuple[Any, ...]]:
    """Every rank's ``("done", extra, shard_bytes, model_bytes, checksum)``, once a
    worker holds the last version whole (its checksum the gathered model's)."""
    from _sharded_memory import run_memory_rank, run_memory_worker
    from conftest import free_port

    endpoints = ipc_endpoints(tmp_path, WORLD)
    with Processes(join=20.0) as procs:
        after = (LAYERS, retain, CHUNK_BYTES, VERSIONS)
        ranks = procs.ranks(run_memory_rank, free_port(), endpoints, after)
        endpoint = _answer(ranks[0], "bound")[1]
        _answer(ranks[1], "bound")
        worker = procs.start(run_memory_worker, endpoint, LAYERS)
        done = [_answer(c, "done") for c in ranks]
        version, digest = ask(worker, "state", 180.0)
        assert (version, digest) == (VERSIONS, done[0][4])
        return done


@pytest.mark.timeout(300)
def test_a_rank_without_a_snapshot_holds_no_more_than_chunk_buffers(tmp_path: Any) -> None:
    done = _ranks_and_worker(tmp_path, False)
    for rank, (_, extra, shard, model, _) in enumerate(done):
        assert shard > 0.45 * model, (rank, shard, model)  # the rank's own half
        # Its peak above what it held before init_on_sender: chunk buffers, no part
        # (from malloc, or from the hub's shared memory: an ipc hub lends it).
        assert extra["heap"] + extra["shmem"] < SLACK, (rank, extra)
        assert extra["rss"] < SLACK + RSS_SLACK, (rank, extra)


@pytest.mark.timeout(300)
def test_a_rank_with_a_snapshot_holds_its_own_part_not_the_model(tmp_path: Any) -> None:
    done = _ranks_and_worker(tmp_path, True)
    for rank, (_, extra, shard, _model, _) in enumerate(done):
        # The snapshot is this rank's part (its shard; FSDP2's shards are uneven), in
        # the blocks its ipc hub lends (shared memory, not malloc): the latest version's,
        # and while a send runs the next one's, written apart (the snapshot served as v
        # stays v's bytes until v + 1 is whole). Two parts at the peak, whatever the
        # number of ranks; a rank that gathered would hold the whole model besides.
        held = extra["heap"] + extra["shmem"]
        assert held < 2 * shard + SLACK, (rank, extra, shard)
        assert extra["heap"] < SLACK, (rank, extra)  # nothing of it from malloc
        assert extra["rss"] < SLACK + RSS_SLACK, (rank, extra)
        # ... and it is a snapshot of the whole part, not just a few chunks.
        assert held > 0.9 * shard, (rank, extra, shard)
