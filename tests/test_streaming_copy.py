"""zmqsync.tensors.streaming: the copies that write a version past the learner's caches.

The C extension writes raw addresses: every byte of each destination must be the
source's, and not one byte around it may change (guard bands on both sides), for every
alignment and length the head, the 64-byte body and the tail of its loop meet, split
over any number of threads, fanned out to any number of destinations."""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync.tensors import streaming
from zmqsync.tensors.streaming import fan_out

GUARD = 4096


def test_the_extension_is_built_where_it_can_be() -> None:
    # pip builds it wherever a C compiler is found; on x86-64 it streams.
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: zmqsync copies with torch (tested below)")
    assert streaming._streamcopy is not None, "the C extension was not built"
    assert (platform.machine() in ("x86_64", "AMD64")) == streaming.AVAILABLE


def _with_guards(n: int, offset: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of ``n`` bytes at ``offset`` bytes into a buffer with random guard bands
    around it; the buffer and the view."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randint(0, 256, (GUARD + offset + n + GUARD,), dtype=torch.uint8, generator=g)
    return whole, whole[GUARD + offset : GUARD + offset + n]


@pytest.mark.parametrize(
    "n", [0, 1, 15, 16, 17, 63, 64, 65, 127, 4095, 4096, 4097, 65536 + 3, (1 << 20) + 13]
)
@pytest.mark.parametrize("offset", [0, 1, 8, 15])
def test_every_length_and_alignment_lands_exactly(n: int, offset: int) -> None:
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    guarded = [_with_guards(n, offset, seed) for seed in range(2)]
    wholes_before = [whole.clone() for whole, _ in guarded]
    fan_out([[view for _, view in guarded]], [src])
    for (whole, view), before in zip(guarded, wholes_before, strict=True):
        assert torch.equal(view, src)
        start = GUARD + offset
        assert torch.equal(whole[:start], before[:start])
        assert torch.equal(whole[start + n :], before[start + n :])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=6),
    k=st.integers(1, 4),
    threads=st.integers(1, 5),
    offset=st.integers(0, 63),
)
def test_many_sources_to_many_destinations_on_many_threads(
    sizes: list[int], k: int, threads: int, offset: int
) -> None:
    if streaming._streamcopy is None:
        pytest.skip("the C extension is not built here")
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    guarded = [[_with_guards(n, offset, 10 * i + j) for j in range(k)] for i, n in enumerate(sizes)]
    befores = [[whole.clone() for whole, _ in row] for row in guarded]
    streaming._streamcopy.fan_out(
        np.array([s.data_ptr() for s in sources], dtype=np.uint64),
        np.array(sizes, dtype=np.uint64),
        np.array([view.data_ptr() for row in guarded for _, view in row], dtype=np.uint64),
        k,
        threads,
    )
    for src, row, before_row in zip(sources, guarded, befores, strict=True):
        for (whole, view), before in zip(row, before_row, strict=True):
            assert torch.equal(view, src)
            start = GUARD + offset
            assert torch.equal(whole[:start], before[:start])
            assert torch.equal(whole[start + src.numel() :], before[start + src.numel() :])


def _fans_out_exactly(sources: list[torch.Tensor], k: int) -> None:
    """``fan_out`` of ``sources`` into ``k`` fresh tensors each leaves each a copy."""
    dests = [[torch.empty_like(s) for _ in range(k)] for s in sources]
    fan_out(dests, sources)
    for src, into in zip(sources, dests, strict=True):
        for d in into:
            assert torch.equal(d, src)


def test_a_large_fan_out_on_torch_threads_matches_torch() -> None:
    # what a lent write does: float tensors of a model, several workers
    _fans_out_exactly([torch.randn(1024, 1024), torch.randn(3, 777), torch.randn(2048 * 513)], 3)


def test_what_cannot_stream_is_copied_by_torch() -> None:
    src = torch.randn(64, 64)
    transposed = torch.empty(64, 64).t()  # not contiguous
    other_dtype = torch.empty(64, 64, dtype=torch.float64)
    plain = torch.empty(64, 64)
    fan_out([[transposed, other_dtype, plain]], [src])
    assert torch.equal(transposed, src)
    assert torch.equal(other_dtype, src.double())
    assert torch.equal(plain, src)


def test_without_the_extension_torch_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "AVAILABLE", False)
    _fans_out_exactly([torch.randn(300, 300), torch.arange(10)], 2)


def test_malformed_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="same number of destinations"):
        fan_out([[torch.empty(4)], [torch.empty(4), torch.empty(4)]], [torch.ones(4)] * 2)
    with pytest.raises(ValueError, match="lists of destinations"):
        fan_out([[torch.empty(4)]], [torch.ones(4)] * 2)
    ext = streaming._streamcopy
    if ext is None:
        return
    one = np.zeros(1, dtype=np.uint64)
    with pytest.raises(ValueError, match="uint64"):
        ext.fan_out(b"123", one, one, 1, 1)
    with pytest.raises(ValueError, match="k=2"):
        ext.fan_out(one, one, one, 2, 1)
    with pytest.raises(ValueError, match="at least 1"):
        ext.fan_out(one, one, one, 1, 0)
    with pytest.raises(OverflowError):
        ext.fan_out(
            np.zeros(2, dtype=np.uint64),
            np.array([2**63, 2**63], dtype=np.uint64),
            np.zeros(2, dtype=np.uint64),
            1,
            1,
        )


def test_lazy_views_are_resolved_by_torch() -> None:
    # a conjugate or negative view's bytes are not its values: torch resolves them
    z = torch.randn(256, 256, dtype=torch.complex64)
    conj, neg = z.conj(), torch._neg_view(z)
    assert conj.is_conj() and neg.is_neg()
    dests = [[torch.empty_like(z)], [torch.empty_like(z)]]
    fan_out(dests, [conj, neg])
    assert torch.equal(dests[0][0], z.conj().resolve_conj())
    assert torch.equal(dests[1][0], -z)
