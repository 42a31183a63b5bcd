"""torchrl collectors built from a ``policy_factory``, torchrl's ``init_on_sender``
keyword forms, per-worker weights, and options refused when a scheme is built: real
``MultiSyncCollector`` workers (spawned processes) on zmqsync's ZeroMQ and pipe schemes.
(RayCollector: test_torchrl_ray.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _faults import until
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from test_torchrl import FRAMES_PER_BATCH, NUM_WORKERS, close, make_env, make_policy, per_worker
from torch import nn
from torchrl.collectors import MultiSyncCollector

import zmqsync
import zmqsync.torchrl

pytestmark = pytest.mark.slow

TRANSPORTS = ["zmq-pubsub", "zmq-router", "pipe"]


class ConstantPolicy:
    """A policy factory (picklable: workers are spawned): a ``Linear(2, 1)`` whose
    action is ``value`` at every step."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self) -> TensorDictModule:
        module = nn.Linear(2, 1)
        with torch.no_grad():
            module.weight.zero_()
            module.bias.fill_(self.value)
        return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


def constant(value: float) -> TensorDictBase:
    """Weights (torchrl's form: a TensorDict shaped like the module) that act ``value``."""
    return TensorDict(
        {"module": {"weight": torch.zeros(1, 2), "bias": torch.full((1,), float(value))}}
    )


def make_scheme(transport: str, **kwargs: Any) -> Any:
    if transport == "pipe":
        return zmqsync.torchrl.MultiProcessWeightSyncScheme(timeout=20, **kwargs)
    mode = transport.split("-")[1]
    return zmqsync.torchrl.ZMQWeightSyncScheme(mode=mode, timeout=20, **kwargs)


def factory_collector(factory: Any, scheme: Any, **kwargs: Any) -> MultiSyncCollector:
    return MultiSyncCollector(
        [make_env] * NUM_WORKERS,
        policy_factory=factory,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=-1,
        cat_results="stack",
        create_env_kwargs=[{"worker": i} for i in range(NUM_WORKERS)],
        weight_sync_schemes={"policy": scheme},
        **kwargs,
    )


def acts(batch: TensorDictBase, value: float) -> bool:
    return torch.allclose(batch["action"], torch.full_like(batch["action"], value))


def actions_by_worker(batch: TensorDictBase) -> dict[int, float]:
    """Worker -> the action it took at every step (asserted constant)."""
    out = {}
    for worker, row in per_worker(batch).items():
        first = float(row["action"].flatten()[0])
        assert acts(row, first), f"worker {worker} changed weights within a batch"
        out[worker] = first
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_factory_only_collector_takes_its_weights_from_the_first_update(transport: str) -> None:
    """No policy on the learner: the scheme accepts it, each worker keeps what its factory
    made until ``update_policy_weights_(weights)``, which every worker then holds, as
    version 1 (what the frames are tagged with, as with torchrl's schemes)."""
    scheme = make_scheme(transport)
    collector = factory_collector(ConstantPolicy(3.0), scheme, track_policy_version=True)
    try:
        batches = iter(collector)
        first = next(batches)
        assert acts(first, 3.0)  # the factory's weights: the learner published none
        assert (first["next", "policy_version"] == 0).all()
        assert scheme.worker_versions() == {0: 0, 1: 0}

        # Nothing to take weights from: said plainly, and nothing is sent.
        with pytest.raises(ValueError, match="no weights"):
            collector.update_policy_weights_()

        collector.update_policy_weights_(constant(10.0))
        assert scheme.worker_versions() == {0: 1, 1: 1}
        batch = next(batches)
        assert acts(batch, 10.0)
        assert (batch["next", "policy_version"] == 1).all()
        collector.update_policy_weights_(constant(-2.0), worker_ids=[1])
        assert actions_by_worker(next(batches)) == {0: 10.0, 1: -2.0}
    finally:
        close(collector, scheme)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["zmq-pubsub", "pipe"])
def test_torchrl_init_on_sender_forms_make_the_rendez_vous(transport: str) -> None:
    """torchrl's own call forms, before the collector exists: ``model=`` with
    ``devices=``, and ``params_map=`` with one set of weights for every worker. The
    workers hold those weights as soon as the collector is built, before any update."""
    learner = make_policy()  # Linear(2, 1) from seed 0: not what the factory makes
    scheme = make_scheme(transport)
    scheme.init_on_sender(model=learner, devices=["cpu"] * NUM_WORKERS, model_id="policy")
    collector = factory_collector(ConstantPolicy(3.0), scheme)
    try:
        batch = next(iter(collector))
        expected = batch["observation"] @ learner.module.weight.detach().T + learner.module.bias
        assert torch.allclose(batch["action"], expected, atol=1e-5)
    finally:
        close(collector, scheme)

    shared = constant(5.0)
    scheme = make_scheme(transport)
    scheme.init_on_sender(params_map=dict.fromkeys(range(NUM_WORKERS), shared))
    assert not scheme.per_worker_weights  # the same object for all: one set of weights
    collector = factory_collector(ConstantPolicy(3.0), scheme)
    try:
        assert acts(next(iter(collector)), 5.0)
    finally:
        close(collector, scheme)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["zmq-pubsub", "pipe"])
def test_distinct_factories_give_each_worker_its_own_weights(transport: str) -> None:
    """Distinct factories (or ``per_worker_weights=True``): each worker starts with its
    own weights and takes ``{worker: weights}`` updates of its own, each with its own
    version count; one set of weights still goes to every worker."""
    scheme = make_scheme(transport)
    factories = [ConstantPolicy(float(i)) for i in range(NUM_WORKERS)]
    collector = factory_collector(factories, scheme)
    try:
        batches = iter(collector)
        assert actions_by_worker(next(batches)) == {0: 0.0, 1: 1.0}
        assert scheme.per_worker_weights  # found from the distinct factories

        collector.update_policy_weights_({0: constant(10.0)})
        assert actions_by_worker(next(batches)) == {0: 10.0, 1: 1.0}
        assert scheme.worker_versions() == {0: 1, 1: 0}

        collector.update_policy_weights_({0: constant(100.0), 1: constant(200.0)})
        assert actions_by_worker(next(batches)) == {0: 100.0, 1: 200.0}
        assert scheme.worker_versions() == {0: 2, 1: 1}

        collector.update_policy_weights_(constant(7.0))  # one set: every worker
        assert actions_by_worker(next(batches)) == {0: 7.0, 1: 7.0}
        with pytest.raises(ValueError, match="no weights given for workers \\[1\\]"):
            collector.update_policy_weights_({0: constant(1.0)}, worker_ids=[0, 1])
        assert {row["worker"] for row in scheme.status()["workers"]} == {0, 1}
    finally:
        close(collector, scheme)

    # Asked for explicitly, with uniform factories: each worker still its own.
    scheme = make_scheme(transport, per_worker_weights=True)
    collector = factory_collector(ConstantPolicy(4.0), scheme)
    try:
        batches = iter(collector)
        assert actions_by_worker(next(batches)) == {0: 4.0, 1: 4.0}
        collector.update_policy_weights_({1: constant(-1.0)})
        assert actions_by_worker(next(batches)) == {0: 4.0, 1: -1.0}
    finally:
        close(collector, scheme)


@pytest.mark.timeout(60)
def test_weights_by_worker_need_per_worker_weights() -> None:
    """A ``{worker: weights}`` send to a scheme with one set of weights is refused, not
    sent to everyone."""
    scheme = zmqsync.torchrl.ZMQWeightSyncScheme(timeout=5)
    scheme.init_on_sender(model=make_policy(), num_workers=2, model_id="policy")
    try:
        scheme.connect()
        with pytest.raises(ValueError, match="per_worker_weights=True"):
            scheme.send({0: constant(1.0)})
    finally:
        scheme.shutdown()


@pytest.mark.parametrize(
    "name", ["ZMQWeightSyncScheme", "MultiProcessWeightSyncScheme", "RayWeightSyncScheme"]
)
def test_unsupported_options_fail_when_the_scheme_is_built(name: str) -> None:
    """An option no part of the scheme takes fails at construction, naming it (it used
    to be accepted and fail in the learner's init_on_sender, or never)."""
    cls = getattr(zmqsync.torchrl, name)
    with pytest.raises(TypeError, match="'heartbeats'"):
        cls(heartbeats=2.0)  # a typo of heartbeat
    with pytest.raises(TypeError, match="'bogus'"):
        getattr(zmqsync, name)(bogus=1)  # zmqsync's own schemes too
    # What torchrl's schemes take is taken here, with the same meaning.
    assert cls(per_worker_weights=True).per_worker_weights
    assert cls(sync=False).sync is False


@pytest.mark.parametrize(
    "name", ["ZMQWeightSyncScheme", "MultiProcessWeightSyncScheme", "RayWeightSyncScheme"]
)
def test_a_default_scheme_takes_torchrls_default_strategy_and_warns_of_nothing(
    name: str,
) -> None:
    """torchrl's RayCollector builds ``WeightStrategy(extract_as=scheme.strategy_str)``
    at every update, which warns "state_dict strategy is experimental" for state_dict:
    the defaults are torchrl's own (tensordict), so an update with one says nothing."""
    import warnings

    from torchrl.weight_update.weight_sync_schemes import WeightStrategy

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheme = getattr(zmqsync.torchrl, name)()
        WeightStrategy(extract_as=scheme.strategy_str)  # what RayCollector does
    assert scheme.strategy_str == "tensordict"


def test_ray_scheme_refuses_a_process_group_backend() -> None:
    with pytest.raises(TypeError, match="backend="):
        zmqsync.torchrl.RayWeightSyncScheme(backend="nccl")


def test_init_on_sender_forms_are_checked() -> None:
    """torchrl's keyword forms, with torchrl's rules for what goes together."""
    scheme = zmqsync.torchrl.ZMQWeightSyncScheme()
    weights = constant(1.0)
    with pytest.raises(ValueError, match="cannot be combined with model"):
        scheme.init_on_sender(params_map={0: weights}, model=make_policy())
    with pytest.raises(ValueError, match=r"workers 0\.\.n-1"):
        scheme.init_on_sender(params_map={1: weights})
    with pytest.raises(ValueError, match="num_workers=3 but 2 devices"):
        scheme.init_on_sender(model=make_policy(), devices=["cpu", "cpu"], num_workers=3)
    with pytest.raises(ValueError, match="device_map_fn needs num_workers"):
        scheme.init_on_sender(model=make_policy(), device_map_fn=lambda i, w: w)
    with pytest.raises(ValueError, match="leave endpoint=None"):
        zmqsync.torchrl.ZMQWeightSyncScheme(endpoint="ipc:///tmp/x", per_worker_weights=True)
    assert not scheme.initialized_on_sender  # every refusal left it as it was


@pytest.mark.timeout(120)
def test_sync_false_returns_before_the_acks_and_the_next_send_waits_for_them() -> None:
    """``sync=False`` (torchrl's option): send() returns once the version is on its way;
    the next send (or wait_async) waits for it first."""
    import pickle
    import threading

    learner = make_policy()
    sender = zmqsync.torchrl.ZMQWeightSyncScheme(timeout=10, connect_timeout=30, sync=False)
    sender.init_on_sender(model=learner, num_workers=1, model_id="policy")
    worker = pickle.loads(pickle.dumps(sender))
    local = make_policy()
    try:
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=0)
        joined = threading.Thread(target=worker.connect, kwargs={"worker_idx": 0})
        joined.start()
        sender.connect()
        joined.join(30)
        with worker.lock:  # the worker cannot apply while this is held: no ack comes
            sender.send(constant(1.0))  # returns anyway
            assert sender.worker_versions() == {0: 0}
        sender.send(constant(2.0))  # waits for version 1's ack first
        sender.wait_async()
        assert sender.worker_versions() == {0: 2}
        assert acts(local(TensorDict({"observation": torch.ones(2)})), 2.0)
    finally:
        worker.shutdown()
        sender.shutdown()


def _action(policy: TensorDictModule) -> float:
    return float(policy(TensorDict({"observation": torch.ones(2)}))["action"])


@pytest.mark.timeout(120)
def test_per_worker_weights_rendez_vous_and_restart_with_a_workers_own_weights() -> None:
    """``params_map`` with distinct weights: each worker's connect() returns holding its
    own; a worker that restarts gets its own latest back (not another worker's), since
    each worker has a sender, versions and snapshot of its own."""
    import pickle

    learner = zmqsync.torchrl.ZMQWeightSyncScheme(timeout=10, connect_timeout=30)
    learner.init_on_sender(params_map={0: constant(1.0), 1: constant(2.0)})
    assert learner.per_worker_weights
    assert set(learner.get_senders()) == {0, 1}
    state = pickle.dumps(learner)  # what each spawned worker gets: every worker's endpoint
    joined: list[Any] = []

    def join(worker_idx: int) -> TensorDictModule:
        worker = pickle.loads(state)
        local = make_policy()
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=worker_idx)
        worker.connect(worker_idx=worker_idx)
        joined.append(worker)
        return local

    try:
        policies = {i: join(i) for i in (0, 1)}
        assert {i: _action(p) for i, p in policies.items()} == {0: 1.0, 1: 2.0}
        learner.send({0: constant(9.0)})
        assert learner.worker_versions() == {0: 1, 1: 0}
        assert {i: _action(p) for i, p in policies.items()} == {0: 9.0, 1: 2.0}
        learner.send(constant(3.0), worker_ids=[1])
        assert learner.worker_versions() == {0: 1, 1: 1}

        # Worker 0 restarts (a new process would do the same): its own latest comes back.
        joined[0].shutdown()
        assert _action(join(0)) == 9.0
        # The learner hears the restarted worker's ack of its snapshot just after.
        until(lambda: learner.worker_versions() == {0: 1, 1: 1}, 5, "the learner heard it")
    finally:
        for worker in joined:
            worker.shutdown()
        learner.shutdown()


@pytest.mark.timeout(120)
def test_weights_given_at_init_are_what_an_update_without_weights_sends() -> None:
    """torchrl's meaning of ``params_map=`` (or ``weights=``) without a model: those
    tensors are the learner's weights, which it may change in place; an update without
    weights sends what they hold then."""
    import pickle

    shared = constant(5.0)
    learner = zmqsync.torchrl.ZMQWeightSyncScheme(timeout=10, connect_timeout=30)
    learner.init_on_sender(params_map={0: shared})
    worker = pickle.loads(pickle.dumps(learner))
    local = make_policy()
    try:
        worker.init_on_receiver(model_id="policy", model=local, worker_idx=0)
        worker.connect(worker_idx=0)
        assert _action(local) == 5.0
        shared["module", "bias"].fill_(6.0)
        learner.send()
        assert learner.worker_versions() == {0: 1}
        assert _action(local) == 6.0
    finally:
        worker.shutdown()
        learner.shutdown()
