"""Extract, flatten and apply: every dtype and layout; apply is all-or-nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from _wire import through_the_wire
from tensordict import TensorDict
from torch import nn

from zmqsync.chunking.layout import MIN_CHUNK_BYTES, POOLED_PIECE_BYTES, Sources, StreamLayout
from zmqsync.errors import SchemaMismatchError
from zmqsync.protocol import Weights
from zmqsync.tensors.apply import apply_weights, materialize
from zmqsync.tensors.extract import as_weights_object, checksum, extract
from zmqsync.tensors.flatten import Flattener, PackReader
from zmqsync.tensors.views import read_view

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _wire(tensors, strategy, **kw):  # type: ignore[no-untyped-def]
    return _decoded(Flattener(strategy, **kw).flatten(tensors))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 2)))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.reshape(-1).contiguous().view(torch.uint8),
            b.reshape(-1).contiguous().view(torch.uint8),
        )
    )


def test_extract_from_every_source_kind() -> None:
    model = _model()
    sd = extract(model, "state_dict")
    assert ("1.running_mean",) in sd and ("1.num_batches_tracked",) in sd  # buffers travel
    td = extract(model, "tensordict")
    assert ("2", "0", "weight") in td  # nested keys
    assert extract(None, "state_dict", model=model).keys() == sd.keys()
    assert extract(TensorDict.from_module(model), "tensordict").keys() == td.keys()
    assert extract(TensorDict.from_module(model), "state_dict").keys() == {
        (".".join(k),) for k in td
    }
    nested = {"a": {"b": torch.ones(2)}, "c": torch.zeros(1)}
    assert set(extract(nested, "tensordict")) == {("a", "b"), ("c",)}
    assert set(extract(nested, "state_dict")) == {("a.b",), ("c",)}
    # A module's state_dict given for the tensordict strategy: its dotted keys are the
    # nested keys they name (torchrl's update_policy_weights_(policy.state_dict())).
    assert extract(model.state_dict(), "tensordict").keys() == td.keys()
    # Extraction is a view, not a copy.
    assert extract(model, "state_dict")[("0.weight",)].data_ptr() == model[0].weight.data_ptr()


def test_extract_errors_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match="give the scheme a model"):
        extract(None, "state_dict")
    with pytest.raises(TypeError, match=r"pass an nn\.Module"):
        extract(42, "state_dict")
    with pytest.raises(TypeError, match="'x' is a str"):
        extract({"x": "nope"}, "state_dict")
    with pytest.raises(ValueError, match="strategy"):
        extract({}, "pickle")


@pytest.mark.parametrize("pack_threshold", [0, 1 << 20])  # every tensor alone / all packed
def test_every_dtype_and_layout_round_trips(pack_threshold: int) -> None:
    tensors = {}
    for i, dtype in enumerate(ALL_DTYPES):
        base = torch.randn(5, 3) * 10
        tensors[(f"t{i}",)] = base.to(dtype) if not dtype.is_complex else base.to(dtype) * 1j
    tensors[("scalar",)] = torch.tensor(3.5)
    tensors[("empty",)] = torch.empty(0, 7)
    tensors[("noncontig",)] = torch.randn(6, 4).t()
    tensors[("sliced",)] = torch.arange(20.0)[::3]
    message = _wire(tensors, "state_dict", pack_threshold=pack_threshold)
    out = materialize(message)
    for key, tensor in tensors.items():
        assert _same(out[key], tensor), key


def test_apply_in_place_for_both_strategies() -> None:
    for strategy in ("state_dict", "tensordict"):
        src, dst = _model(), _model()
        ptr = dst[0].weight.data_ptr()
        apply_weights(_wire(extract(src, strategy), strategy), extract(dst, strategy), strategy)
        assert checksum(src) == checksum(dst)
        assert dst[0].weight.data_ptr() == ptr  # in place
        assert dst[0].weight.requires_grad


def test_received_weights_alias_nothing() -> None:
    src = {("w",): torch.ones(1000)}
    flat = Flattener("state_dict").flatten(src)
    message = Weights("m", 1, 1, flat.schema, tuple(flat.buffers))  # buffers view src
    out = materialize(message)
    src[("w",)].add_(1)
    assert torch.equal(out[("w",)], torch.ones(1000))


@pytest.mark.parametrize(
    ("change", "match", "key"),
    [
        (lambda sd: sd.pop("2.0.bias"), "lack '2.0.bias'", "2.0.bias"),
        (lambda sd: sd.__setitem__("extra", torch.ones(1)), "carry 'extra'", "extra"),
        (
            lambda sd: sd.__setitem__("0.weight", torch.ones(4, 3, dtype=torch.float64)),
            "float64 in the weights but float32",
            "0.weight",
        ),
        (lambda sd: sd.__setitem__("0.weight", torch.ones(3, 4)), r"shape \[3, 4\]", "0.weight"),
    ],
)
def test_apply_is_all_or_nothing(change, match, key) -> None:  # type: ignore[no-untyped-def]
    src, dst = _model(), _model()
    before = checksum(dst)
    sd = {k: v.clone() + 1 for k, v in src.state_dict().items()}
    change(sd)
    message = _wire(extract(sd, "state_dict"), "state_dict")
    with pytest.raises(SchemaMismatchError, match=match) as info:
        apply_weights(message, extract(dst, "state_dict"), "state_dict")
    assert info.value.key == key
    assert checksum(dst) == before  # nothing was copied


def test_strategy_mismatch_is_named() -> None:
    src, dst = _model(), _model()
    message = _wire(extract(src, "tensordict"), "tensordict")
    with pytest.raises(SchemaMismatchError, match="same strategy"):
        apply_weights(message, extract(dst, "state_dict"), "state_dict")


def test_layout_is_reused_between_versions() -> None:
    model = _model()
    flattener = Flattener("state_dict")
    first = flattener.flatten(extract(model, "state_dict"))
    with torch.no_grad():
        model[0].weight.add_(1)
    second = flattener.flatten(extract(model, "state_dict"))
    assert second.schema is first.schema and second.schema_bytes is first.schema_bytes


def test_as_weights_object_shapes() -> None:
    tensors = {("a", "b"): torch.ones(2)}
    assert isinstance(as_weights_object(tensors, "tensordict"), TensorDict)
    assert set(as_weights_object({("a.b",): torch.ones(2)}, "state_dict")) == {"a.b"}


def test_model_tensors_cache_follows_the_model() -> None:
    from zmqsync.tensors.model_tensors import ModelTensors

    model = _model()
    cache = ModelTensors("state_dict")
    first = cache.get(model)
    assert cache.get(model) is first  # unchanged model: no re-walk
    model[0].weight = nn.Parameter(torch.zeros(4, 3))  # parameter replaced
    second = cache.get(model)
    assert second is not first and second[("0.weight",)].data_ptr() == model[0].weight.data_ptr()
    model[0].bias.data = torch.ones(4)  # new storage behind the same Parameter
    third = cache.get(model)
    assert third is not second and third[("0.bias",)].data_ptr() == model[0].bias.data_ptr()
    model[0].weight.data = model[0].weight.data.view(3, 4)  # same memory, new shape
    fourth = cache.get(model)
    assert fourth is not third and fourth[("0.weight",)].shape == (3, 4)
    model.append(nn.Linear(2, 2))  # module added
    assert ("3.weight",) in cache.get(model)


@pytest.mark.parametrize("strategy", ["state_dict", "tensordict"])
def test_storage_the_caller_moved_is_remembered_and_a_later_change_still_seen(
    strategy: str,
) -> None:
    """The shared mode re-points every tensor at each version (``t.data = view``): it
    says so, and the next walk is spared; anything changed after that is still seen."""
    from zmqsync.tensors.model_tensors import ModelTensors

    for model in (_model(), {"a": torch.zeros(3), "inner": {"b": torch.ones(2)}}):
        cache = ModelTensors(strategy)
        first = cache.get(model)
        owned = (
            model.parameters()
            if isinstance(model, nn.Module)
            else [model["a"], model["inner"]["b"]]
        )
        for t in owned:
            t.data = t.data.clone()  # what the shared mode does, version after version
        cache.storage_moved()
        assert cache.get(model) is first  # not walked again
        for t in first.values():
            t.data = t.data.clone()  # an alias of the walk (as the shared mode moves too)
        cache.storage_moved()
        assert cache.get(model) is first
        owner = model[0].bias if isinstance(model, nn.Module) else model["a"]
        owner.data = torch.full_like(owner, 5.0)  # the user's own change, unannounced
        second = cache.get(model)
        assert second is not first
        assert any(t.data_ptr() == owner.data_ptr() for t in second.values())


@pytest.mark.parametrize("strategy", ["state_dict", "tensordict"])
def test_model_tensors_cache_follows_a_dict_of_tensors(strategy: str) -> None:
    from zmqsync.tensors.model_tensors import ModelTensors

    weights = {"a": torch.zeros(3), "inner": {"b": torch.ones(2)}}
    cache = ModelTensors(strategy)
    first = cache.get(weights)
    assert cache.get(weights) is first  # unchanged dict: the apply plan can be kept
    weights["a"] = torch.ones(3)  # tensor replaced
    second = cache.get(weights)
    assert second is not first and next(iter(second.values())).data_ptr() == weights["a"].data_ptr()
    weights["a"].data = torch.full((3,), 2.0)  # new storage behind the same tensor
    third = cache.get(weights)
    assert third is not second
    weights["inner"]["c"] = torch.zeros(1)  # key added in a nested dict
    assert len(cache.get(weights)) == 3
    other = {"a": torch.zeros(3)}
    assert len(cache.get(other)) == 1  # another model: walked afresh


@pytest.mark.parametrize("serial", [True, False])  # memcpy per tensor / torch's foreach copy
@pytest.mark.parametrize("pack_threshold", [0, 1 << 20])
def test_both_copy_paths_land_every_dtype_in_place(serial: bool, pack_threshold: int) -> None:
    from zmqsync.tensors.apply import ApplyPlan

    source, target = {}, {}
    for i, dtype in enumerate(ALL_DTYPES):
        base = torch.randn(5, 3) * 10
        source[(f"t{i}",)] = base.to(dtype) if not dtype.is_complex else base.to(dtype) * 1j
        target[(f"t{i}",)] = torch.zeros(5, 3, dtype=dtype)
    source[("big",)], target[("big",)] = torch.randn(300, 300), torch.zeros(300, 300)
    source[("param",)] = torch.randn(4)
    target[("param",)] = nn.Parameter(torch.zeros(4))  # requires grad: still copied in place
    source[("noncontig",)], target[("noncontig",)] = torch.randn(4, 6), torch.zeros(6, 4).t()
    pointers = {k: t.data_ptr() for k, t in target.items()}
    message = _wire(source, "state_dict", pack_threshold=pack_threshold)
    plan = ApplyPlan(message.schema, target, "state_dict")
    assert plan.serial  # small: memcpy by default
    plan.serial = serial
    plan.apply(message)
    for key, tensor in source.items():
        assert _same(target[key], tensor), key
        assert target[key].data_ptr() == pointers[key], key


@pytest.mark.parametrize("shift", [0, 1, 4])  # the frame's address: 8-byte aligned or not
def test_the_parallel_copy_moves_words_and_still_every_byte(shift: int) -> None:
    """torch's parallel copy moves the bytes of tensors that start and end on 8-byte
    words as ``int64`` (faster than ``uint8``), the others byte by byte; a received frame
    at an address that is not a multiple of 8 is copied byte by byte. Every bit lands,
    NaN payloads included."""
    from zmqsync.tensors.apply import ApplyPlan

    torch.manual_seed(3)
    source: dict[tuple[str, ...], torch.Tensor] = {
        ("w",): torch.randn(1000, 33),
        ("odd",): torch.randint(0, 2, (13,), dtype=torch.bool),
        ("half",): torch.randn(7).to(torch.float16),  # 14 bytes
        ("nan",): torch.full((6,), float("nan")).view(torch.int32).add_(7).view(torch.float32),
        ("tail",): torch.randn(40),
    }
    target = {k: torch.zeros_like(t) for k, t in source.items()}
    message = _wire(source, "state_dict")
    buffer = message.buffers[0]
    raw = bytearray(len(buffer) + 16)
    frame = memoryview(raw)[shift : shift + len(buffer) + 3]  # a length no word divides
    start = np.frombuffer(frame, dtype=np.uint8).__array_interface__["data"][0]
    frame[: len(buffer)] = bytes(buffer)
    message = dataclasses.replace(message, buffers=(frame, *message.buffers[1:]))
    plan = ApplyPlan(message.schema, target, "state_dict")
    plan.serial = False
    split = plan._buffers[0]
    assert {d.dtype for d in split.words.dests} == {torch.int64}
    assert len(split.words.dests) >= 3 and len(split.rest.dests) >= 1
    _, dests = split.pieces(torch.frombuffer(frame, dtype=torch.uint8))
    assert (torch.int64 in {d.dtype for d in dests}) == (shift == 0)  # words where aligned
    plan.apply(message)
    assert (start % 8 == 0) == (shift == 0)
    for key, tensor in source.items():
        assert _same(target[key], tensor), key


def _applied_in_place(layout: StreamLayout, flat: Any, target: dict[Any, torch.Tensor]) -> Any:
    """An InPlace plan over ``target`` that was given every chunk of ``layout``."""
    from zmqsync.tensors.in_place import InPlace

    sources = layout.sources(flat)
    plan = InPlace(layout.schema, target, "state_dict")
    for i in range(layout.count):
        offset, length = layout.span(i)
        payload = np.empty(length, dtype=np.uint8)
        layout.write(i, sources, payload)
        plan.apply(offset, payload.data.toreadonly())
    plan.finish()
    return plan


@pytest.mark.parametrize("chunk_bytes", [7, 4096, MIN_CHUNK_BYTES, 1 << 22])
def test_chunks_written_in_place_land_every_dtype_and_layout(chunk_bytes: int) -> None:
    """However a stream is cut (chunk edges inside tensors, many tensors in a chunk),
    InPlace puts every byte where it belongs, in the target's own memory."""
    source, target = {}, {}
    for i, dtype in enumerate(ALL_DTYPES):
        base = torch.randn(5, 3) * 10
        source[(f"t{i}",)] = base.to(dtype) if not dtype.is_complex else base.to(dtype) * 1j
        target[(f"t{i}",)] = torch.zeros(5, 3, dtype=dtype)
    for i in range(100):  # many pieces in one chunk: the cached-views path
        source[(f"s{i}",)], target[(f"s{i}",)] = torch.randn(3), torch.zeros(3)
    source[("big",)], target[("big",)] = torch.randn(300, 300), torch.zeros(300, 300)
    source[("empty",)], target[("empty",)] = torch.zeros(0, 3), torch.ones(0, 3)
    source[("noncontig",)], target[("noncontig",)] = torch.randn(4, 6), torch.zeros(6, 4).t()
    pointers = {k: t.data_ptr() for k, t in target.items()}
    flat = Flattener("state_dict").flatten(source)
    layout = StreamLayout(flat, chunk_bytes)
    _applied_in_place(layout, flat, target)
    for key, tensor in source.items():
        assert _same(target[key], tensor), key
        assert target[key].data_ptr() == pointers[key], key


def test_tensors_laid_out_as_the_stream_are_written_in_one_copy_per_chunk() -> None:
    """Tensors that lie back to back as the stream lays them (lent tensors do) are one
    destination per chunk, not one per tensor; every byte still lands, and tensors
    elsewhere (a gap, another buffer) keep destinations of their own."""
    from zmqsync.tensors.views import torch_dtype

    source = {(f"s{i}",): torch.randn(1024) for i in range(500)}
    source[("apart",)] = torch.randn(7)
    flat = Flattener("state_dict").flatten(source)
    layout = StreamLayout(flat, MIN_CHUNK_BYTES)
    memory = torch.zeros(layout.total, dtype=torch.uint8)
    target = {}
    for e in layout.schema.entries:
        if e.key == ("apart",):
            target[e.key] = torch.zeros(7)  # private memory: not merged with the rest
            continue
        view = memory[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype))
        target[e.key] = view.view(tuple(int(n) for n in e.shape))
    plan = _applied_in_place(layout, flat, target)
    for key, tensor in source.items():
        assert torch.equal(target[key], tensor), key
    spans = list(plan._spans.values())
    assert layout.count > 1 and all(len(s.dests) <= 2 for s in spans)
    assert sum(len(s.dests) for s in spans) <= layout.count + 1  # "apart" is its own


def test_a_staged_apply_reads_the_same_buffer_through_views_made_once() -> None:
    """A worker's staging buffer is the same memory every version: the plan slices it
    once, and each apply reads what the buffer holds then; another buffer is sliced
    afresh."""
    from zmqsync.tensors.apply import ApplyPlan

    source = {(f"t{i}",): torch.full((3,), float(i)) for i in range(50)}
    target = {k: torch.zeros(3) for k in source}
    message = _wire(source, "state_dict")
    plan = ApplyPlan(message.schema, target, "state_dict")
    plan.apply(message)
    assert all(torch.equal(target[k], v) for k, v in source.items())
    stream = np.frombuffer(message.buffers[0], dtype=np.uint8)
    stream.view(np.float32)[:] += 1  # the next version, in the same memory
    plan.apply(message)
    assert all(torch.equal(target[k], v + 1) for k, v in source.items())
    other = _wire({k: v * 2 for k, v in source.items()}, "state_dict")
    plan.apply(other)
    assert all(torch.equal(target[k], v * 2) for k, v in source.items())


def test_flattener_reuses_a_layout_and_still_sends_current_values() -> None:
    from zmqsync.tensors.model_tensors import ModelTensors

    model = {
        "big": torch.zeros(64, 64),
        "small": torch.zeros(3),
        "flag": torch.zeros(2, dtype=torch.bool),
    }
    cache, flattener = ModelTensors("state_dict"), Flattener("state_dict", pack_threshold=1024)
    first = flattener.flatten(cache.get(model))
    model["big"].add_(1)
    model["small"].add_(2)
    model["flag"].fill_(True)
    second = flattener.flatten(cache.get(model))
    assert second.schema is first.schema  # layout reused
    assert second.buffers[1] is not first.buffers[1]  # the pack is a fresh buffer each time
    out = materialize(_decoded(second))
    assert torch.equal(out[("big",)], model["big"]) and torch.equal(out[("small",)], model["small"])
    assert out[("flag",)].all()
    # A non-contiguous tensor is copied to be sent: its copy is never reused.
    strided = {"t": torch.zeros(8, 4).t()}
    flattener = Flattener("state_dict", pack_threshold=1024)
    flattener.flatten(cache.get(strided))
    strided["t"].add_(5)
    assert torch.equal(
        materialize(_decoded(flattener.flatten(cache.get(strided))))[("t",)], strided["t"]
    )
    # A tensor reshaped in place is seen.
    module = nn.Linear(4, 4)
    cache = ModelTensors("state_dict")
    cache.get(module)
    with torch.no_grad():
        module.weight.data = module.weight.data.reshape(2, 8)
    assert cache.get(module)[("weight",)].shape == (2, 8)


@pytest.mark.parametrize("chunk_bytes", [1, 100, 4099, 1 << 20])
def test_small_tensors_read_where_they_lie_make_the_packs_stream(chunk_bytes: int) -> None:
    torch.manual_seed(0)
    tensors: dict[tuple[str, ...], torch.Tensor] = {
        ("f", str(i)): torch.randn(i % 7 + 1) for i in range(300)
    }
    tensors.update(  # another dtype group (padding before it), empty tensors among them
        {("i", str(i)): torch.randint(0, 100, (i % 5,), dtype=torch.int64) for i in range(50)}
    )
    tensors[("h",)] = torch.ones(3, dtype=torch.float16)
    tensors[("big",)] = torch.randn(300)  # over the threshold: its own buffer
    flattener = Flattener("state_dict", pack_threshold=1024)
    packed = flattener.flatten(tensors)
    in_place = flattener.flatten(tensors, pack=False)
    assert isinstance(in_place.buffers[-1], PackReader)
    assert in_place.sizes == packed.sizes and in_place.nbytes == packed.nbytes
    layout = StreamLayout(packed, chunk_bytes)
    assert layout.fits(in_place, chunk_bytes)

    def stream(flat):  # type: ignore[no-untyped-def]
        out = np.full(layout.total, 7, dtype=np.uint8)
        sources = layout.sources(flat)
        for index in range(layout.count):
            offset, length = layout.span(index)
            layout.write(index, sources, out[offset : offset + length])
        return out

    assert np.array_equal(stream(in_place), stream(packed))
    # What a delta's digests read, without writing the stream: the same bytes.
    step = max(chunk_bytes, 1000)
    for lo in range(0, layout.total, step):
        hi = min(lo + step, layout.total)
        here = layout.stretches(layout.sources(in_place), lo, hi)
        there = layout.stretches(layout.sources(packed), lo, hi)
        assert here is not None and there is not None
        assert b"".join(map(bytes, here)) == b"".join(map(bytes, there))
    # Read where they lie: a change made after flatten() is in the stream, as for a
    # large tensor (the pack copied it at flatten()).
    tensors[("f", "3")].fill_(5.0)
    assert not np.array_equal(stream(in_place), stream(packed))
    assert np.array_equal(stream(in_place), stream(flattener.flatten(tensors)))


@pytest.mark.parametrize("chunk_bytes", [100_003, 1 << 20, 64 << 20])
def test_a_pooled_write_makes_the_same_stream(chunk_bytes: int) -> None:
    """The shared mode's learner writes large pieces with torch's thread pool (one
    ``_foreach_copy_`` a chunk): byte for byte the stream numpy's copies make, at chunk
    sizes that cut the large tensors, with gaps zeroed in a reused buffer; a source
    torch cannot take (read-only memory) is copied by numpy."""
    torch.manual_seed(1)
    tensors: dict[tuple[str, ...], torch.Tensor] = {
        (f"w{i}",): torch.randn(70_000 + 13 * i)
        for i in range(6)  # 280 KB and up
    }
    tensors[("half",)] = torch.randn(200_001).to(torch.float16)  # pads the next buffer
    for i in range(40):
        tensors[("s", str(i))] = torch.randn(i + 1)
    flat = Flattener("state_dict").flatten(tensors, pack=False)
    layout = StreamLayout(flat, chunk_bytes)
    sources = layout.sources(flat)
    assert isinstance(sources, list)
    assert sum(isinstance(x, np.ndarray) and x.nbytes >= POOLED_PIECE_BYTES for x in sources) >= 6

    def stream(pooled: bool, sources: Sources) -> np.ndarray:
        out = np.full(layout.total, 7, dtype=np.uint8)  # stale bytes: gaps must be zeroed
        for index in range(layout.count):
            offset, length = layout.span(index)
            layout.write(index, sources, out[offset : offset + length], pooled)
        return out

    plain = stream(False, sources)
    assert np.array_equal(stream(True, sources), plain)
    frozen = [x.copy() if isinstance(x, np.ndarray) else x for x in sources]
    for x in frozen:
        if isinstance(x, np.ndarray):
            x.flags.writeable = False
    assert np.array_equal(stream(True, frozen), plain)


def _decoded(flat):  # type: ignore[no-untyped-def]
    return through_the_wire(flat)


@pytest.mark.parametrize("chunk_bytes", [7, 4096, 1 << 22])
def test_a_device_reader_cuts_the_same_chunks_through_two_slots(chunk_bytes: int) -> None:
    """A learner on a GPU reads each chunk out of the device a chunk at a time, through
    two chunk-sized host slots (the next chunk is copied while this one is sent). The
    reader takes tensors on any device, so its mapping is checked here on CPU tensors
    standing where a GPU's would be: every chunk, in order, out of order (a repair) and
    again, has the same bytes as the host path's, gaps zeroed."""
    from zmqsync.tensors.device_reader import DeviceReader
    from zmqsync.tensors.flatten import Flat

    source = {(f"t{i}",): torch.randn(5, 3).to(dtype) for i, dtype in enumerate(ALL_DTYPES)}
    for i in range(100):
        source[(f"s{i}",)] = torch.randn(3)
    source[("big",)] = torch.randn(300, 300)
    flat = Flattener("state_dict").flatten(source)
    layout = StreamLayout(flat, chunk_bytes)
    host = layout.sources(flat)
    on_device = Flat(
        flat.schema,
        flat.schema_bytes,
        [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in flat.buffers],
        flat.nbytes,
        [],
        on_device=True,
    )
    assert StreamLayout(on_device, chunk_bytes).schema == layout.schema
    reader = layout.sources(on_device)
    assert isinstance(reader, DeviceReader)
    order = [*range(layout.count), layout.count // 2, 0, layout.count - 1]
    for i in order:
        _, length = layout.span(i)
        want = np.empty(length, dtype=np.uint8)
        layout.write(i, host, want)
        got = np.full(length, 0xAB, dtype=np.uint8)  # stale bytes a reused buffer holds
        layout.write(i, reader, got)
        assert np.array_equal(got, want), i
    reader.close()
    # Two slots of at most one chunk: the reader's whole memory, whatever the size.
    assert reader.nbytes <= 2 * chunk_bytes and reader.nbytes <= 2 * layout.total


def test_read_only_memory_is_viewed_without_a_warning_and_still_read_only() -> None:
    """Received frames and mapped versions are read-only: viewing them shows the user no
    torch warning (torch warns once a process: the first view silences it, later ones
    pay nothing for silencing), and the views read the bytes."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import mmap, numpy as np
        from zmqsync.tensors.views import read_only_storage, read_view
        ro = np.frombuffer(mmap.mmap(-1, 4096, prot=mmap.PROT_READ), dtype=np.uint8)
        for _ in range(3):
            assert read_view(ro).shape == (4096,)
            assert read_only_storage(ro).nbytes() == 4096
        assert read_view(bytearray(b"ab")).tolist() == [97, 98]
        assert read_view(b"") is None
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    ro = np.frombuffer(b"\x01\x02", dtype=np.uint8)
    view = read_view(ro)
    assert view is not None and view.tolist() == [1, 2]
