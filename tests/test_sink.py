"""Inference engines as workers: ``sink=`` takes the place of a model.

The receiver calls the sink with each chunk's complete tensors, as ``(name, tensor)``
lists, the way vLLM's and SGLang's ``load_weights`` take them, and acks once the last call
returned. The stand-in engine below renames and fuses tensors, as such engines do (q, k
and v projections fused into one ``qkv``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from zmqsync import WeightReceiver, WeightSender, ZMQWeightSyncScheme
from zmqsync.errors import WeightsRejected
from zmqsync.transport.memory import MemoryHub, MemorySpoke

CHUNK = 64 * 1024


def _learner(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "attn.q.weight": torch.randn(128, 256, generator=g),  # 128 KiB: spans chunks
        "attn.k.weight": torch.randn(128, 256, generator=g),
        "attn.v.weight": torch.randn(128, 256, generator=g),
        "mlp.weight": torch.randn(512, 256, generator=g),
        "steps": torch.tensor(7),
    }
    for i in range(50):
        out[f"norm.{i}.weight"] = torch.randn(16, generator=g)
    return out


class StandInEngine:
    """An engine's model runner: a fused ``qkv`` and renamed parameters, filled by a
    ``load_weights`` that knows the learner's names (zmqsync knows nothing of them)."""

    def __init__(self) -> None:
        self.params = {
            "qkv_proj": torch.zeros(384, 256),
            "ffn": torch.zeros(512, 256),
            "steps": torch.tensor(0),
        }
        self.params.update({f"ln{i}": torch.zeros(16) for i in range(50)})
        self.calls = 0
        self.names: list[str] = []
        self.generating = threading.Event()
        self.generating.set()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        assert not self.generating.is_set(), "weights loaded while generating"
        self.calls += 1
        for name, tensor in weights:
            self.names.append(name)
            if name.startswith("attn."):
                part = "qkv".index(name.split(".")[1])
                self.params["qkv_proj"][128 * part : 128 * (part + 1)].copy_(tensor)
            elif name == "mlp.weight":
                self.params["ffn"].copy_(tensor)
            elif name.startswith("norm."):
                self.params[f"ln{name.split('.')[1]}"].copy_(tensor)
            else:
                self.params[name].copy_(tensor)

    def expected(self, learner: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {
            "qkv_proj": torch.cat([learner[f"attn.{p}.weight"] for p in "qkv"]),
            "ffn": learner["mlp.weight"],
            "steps": learner["steps"],
        }
        out.update({f"ln{i}": learner[f"norm.{i}.weight"] for i in range(50)})
        return out


def _check(engine: StandInEngine, learner: dict[str, torch.Tensor]) -> None:
    for name, want in engine.expected(learner).items():
        assert torch.equal(engine.params[name], want), name


def test_a_sink_gets_every_tensor_by_its_learner_name_chunk_by_chunk() -> None:
    learner = _learner(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub, model=learner, strategy="state_dict", num_workers=1, timeout=20, chunk_bytes=CHUNK
    )
    engine = StandInEngine()
    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), strategy="state_dict", worker_idx=0, sink=engine.load_weights
    )
    try:
        engine.generating.clear()  # what an engine does around a sync: pause generation
        receiver.connect(timeout=30)
        _check(engine, learner)
        assert sorted(engine.names) == sorted(learner)  # each once, as the learner names it
        assert engine.calls > 1  # chunk by chunk, not one call at the end
        assert receiver.receive(timeout=0) is None  # nothing newer
        receiver.start()
        for step in (1, 2):
            with torch.no_grad():
                for t in learner.values():
                    t.add_(step)
            engine.names.clear()
            sender.send(metadata={"step": step})  # returns once the engine took it all
            assert receiver.version == step and receiver.metadata == {"step": step}
            _check(engine, learner)
            assert sorted(engine.names) == sorted(learner)
        engine.generating.set()
    finally:
        receiver.close()
        sender.close()


def test_a_sink_that_raises_refuses_the_version_with_its_text() -> None:
    learner = _learner(0)
    hub = MemoryHub()
    sender = WeightSender(
        hub, model=learner, strategy="state_dict", num_workers=1, timeout=20, chunk_bytes=CHUNK
    )
    engine = StandInEngine()
    fail = threading.Event()

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        if fail.is_set() and any(n == "mlp.weight" for n, _ in weights):
            raise RuntimeError("engine out of KV-cache memory")
        engine.generating.clear()
        engine.load_weights(weights)

    receiver = WeightReceiver(
        MemorySpoke(hub.endpoint), strategy="state_dict", worker_idx=0, sink=load_weights
    )
    try:
        receiver.connect(timeout=30)
        receiver.start()
        fail.set()
        with torch.no_grad():
            learner["mlp.weight"].add_(1)
        with pytest.raises(WeightsRejected, match="sink raised RuntimeError: engine out of KV"):
            sender.send()
        assert receiver.version == 0  # the version is not the engine's
        fail.clear()
        sender.send()  # the next one goes through whole
        assert receiver.version == 2
        _check(engine, learner)
        assert sender.status()["workers"][0]["version"] == 2
    finally:
        receiver.close()
        sender.close()


def test_a_scheme_passes_a_sink_on_and_refuses_a_sink_with_a_model() -> None:
    scheme = ZMQWeightSyncScheme("state_dict", endpoint="memory://sink-scheme", timeout=20)
    scheme.init_on_sender("policy", model=_learner(3), num_workers=1)
    engine = StandInEngine()
    worker = ZMQWeightSyncScheme("state_dict", endpoint="memory://sink-scheme", timeout=20)
    worker.init_on_receiver(model_id="policy", sink=engine.load_weights, worker_idx=0)
    try:
        # The engine is generating: its load_weights refuses, and connect() says so.
        with pytest.raises(WeightsRejected, match=r"sink refused version 0.*while generating"):
            worker.connect(timeout=10)
        engine.generating.clear()
        worker.connect(timeout=10)
        _check(engine, _learner(3))
        with pytest.raises(ValueError, match="not both"):
            WeightReceiver(
                MemorySpoke("memory://sink-scheme"), model=_learner(0), sink=engine.load_weights
            )
    finally:
        worker.shutdown()
        scheme.shutdown()
