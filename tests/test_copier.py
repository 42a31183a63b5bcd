"""Large copies split over threads (zmqsync.chunking.copier): the same bytes whatever
the split, a thread count read from the environment or the cores, and a forked child
that copies with threads of its own."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmqsync.chunking import copier as copier_module
from zmqsync.chunking.copier import COPY_THREADS_ENV, SPLIT_MIN_BYTES, Copier, default_threads


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize(
    "n", [0, 1, SPLIT_MIN_BYTES - 1, SPLIT_MIN_BYTES, SPLIT_MIN_BYTES + 63, 9 * SPLIT_MIN_BYTES + 5]
)
def test_every_byte_lands_once_whatever_the_split(threads: int, n: int) -> None:
    rng = np.random.default_rng(n)
    source = rng.integers(0, 256, n + 128, dtype=np.uint8)
    dest = np.zeros(n + 128, dtype=np.uint8)
    # Unaligned views of bigger arrays, as a chunk's piece of a tensor is.
    copier = Copier(threads)
    try:
        copier.copy(dest[3 : 3 + n], source[5 : 5 + n])
    finally:
        copier.close()
    assert np.array_equal(dest[3 : 3 + n], source[5 : 5 + n])
    assert not dest[:3].any() and not dest[3 + n :].any()  # nothing outside


def test_the_thread_count_comes_from_the_environment_or_the_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(COPY_THREADS_ENV, "3")
    assert default_threads() == 3
    monkeypatch.setenv(COPY_THREADS_ENV, "1000")
    assert default_threads() == copier_module.MAX_THREADS
    monkeypatch.setenv(COPY_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=COPY_THREADS_ENV):
        default_threads()
    monkeypatch.delenv(COPY_THREADS_ENV)
    monkeypatch.setattr(copier_module.os, "sched_getaffinity", lambda _: set(range(2)))
    assert default_threads() == 1  # two cores: the calling thread alone, as before
    monkeypatch.setattr(copier_module.os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setattr(copier_module, "CGROUP_CPU_MAX", str(tmp_path / "cpu.max"))
    assert default_threads() == 4  # no quota file: the affinity
    for quota, threads in (("max 100000", 4), ("1600000 100000", 4), ("250000 100000", 1)):
        (tmp_path / "cpu.max").write_text(quota + "\n")
        assert default_threads() == threads, quota  # a container's --cpus 2.5: 3 cores
    assert copier_module.usable_cores() == 3


def _copy_in_child(result: mp.Queue) -> None:  # type: ignore[type-arg]
    source = np.arange(4 * SPLIT_MIN_BYTES, dtype=np.uint8)
    dest = np.zeros_like(source)
    copier_module.copier().copy(dest, source)
    result.put(bool(np.array_equal(dest, source)))


@pytest.mark.timeout(60)
def test_a_forked_child_copies_with_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's helper threads do not exist in a forked child: slices handed to them
    would never be copied. The child makes its own."""
    parent = Copier(3)
    monkeypatch.setattr(copier_module, "_copier", parent)
    big = np.ones(4 * SPLIT_MIN_BYTES, dtype=np.uint8)
    parent.copy(np.empty_like(big), big)  # the parent's threads run
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(target=_copy_in_child, args=(result,))
    child.start()
    try:
        assert result.get(timeout=30) is True
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        parent.close()
    assert child.exitcode == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_versions_arrive_exact_through_split_copies(
    fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 32 MiB model to two pipe workers with 3 copy threads in the learner and in each
    worker (set through the environment, as on a many-core host): every version exact,
    through the shared blocks, large pieces split on both sides (streamed: lent tensors
    would take every version after the first without a block)."""
    from _workers import make_model

    monkeypatch.setenv(COPY_THREADS_ENV, "3")  # the spawned workers inherit it
    monkeypatch.setattr(copier_module, "_copier", None)  # the learner reads it anew
    model = make_model("big", seed=0)
    scheme = fleet.over_pipes(model, "big", workers=2, lend_tensors=False)
    try:
        fleet.each_version_exact(scheme, model, workers=2)
        assert copier_module.copier().threads == 3
        assert scheme.get_sender().transport.counters()["shm_bytes"] > 0
    finally:
        scheme.shutdown()
        copier_module.copier().close()
        monkeypatch.setattr(copier_module, "_copier", None)
