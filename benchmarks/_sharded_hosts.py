"""The processes of the sharded benchmark, each on a namespace host of its own: a rank of
the FSDP2 learner (a sender of its own part, and a party to the gather that rank 0 sends
from), a worker holding one receiver per variant, and a relay host.

The learner's weights are small integers held in float32, and every version adds 1.0 to
every element on every rank, so a worker checks a version exactly against the seeded
initial model plus the version's value, with no gather and no checksum on the ranks.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import torch
from torch import nn

from benchmarks._memory import PeakMemoryMeter
from benchmarks._models import MIB
from tests.netns import enter_netns

#: The two ways a version reaches the workers: every rank its own part, or the full
#: state dict gathered on rank 0 and sent from there (what users do today).
VARIANTS: Final = ("sharded", "gather")
#: One layer: ``Linear(IN, OUT)``, 2047 rows so that FSDP2's shards are uneven for M > 1.
IN_FEATURES: Final = 4096
OUT_FEATURES: Final = 2047
#: The seed of the initial weights, the same on every rank and worker.
SEED: Final = 34
#: The initial weights are integers in [-LIMIT, LIMIT): exact in float32 after any number
#: of +1.0 steps a run makes, and small enough to keep as int8 on the workers.
LIMIT: Final = 64
#: Every sender's and receiver's ``timeout=``: a version crosses shaped links.
PEER_SECONDS: Final = 600
#: How long the ranks may take to find each other (gloo) and agree at init_on_sender.
GROUP_SECONDS: Final = 300
#: How often the memory meter samples during a version (coarser than its default, so
#: that its thread takes little of a loaded 2-core machine).
SAMPLE_SECONDS: Final = 0.005
#: Where each variant's senders listen, on each rank's host; where relays listen.
PORTS: Final = {"sharded": 6000, "gather": 6100}
RELAY_PORTS: Final = {"sharded": 7000, "gather": 7100}
#: The gloo rendez-vous port, on rank 0's host.
MASTER_PORT: Final = 29534


def layers_for(mib: int) -> int:
    """How many layers make a model of about ``mib`` MiB (at least one)."""
    per_layer = (IN_FEATURES + 1) * OUT_FEATURES * 4
    return max(1, round(mib * MIB / per_layer))


def build_model(layers: int) -> nn.Module:
    """The model every rank starts from and every worker holds: ``layers`` Linear
    layers of seeded small integers."""
    torch.manual_seed(SEED)
    with torch.device("cpu"):
        net = nn.Sequential(*[nn.Linear(IN_FEATURES, OUT_FEATURES) for _ in range(layers)])
    with torch.no_grad():
        for p in net.parameters():
            p.random_(-LIMIT, LIMIT)
    return net


def _memory_mib(meter: PeakMemoryMeter) -> tuple[float, float]:
    """The meter's peak extra and retained memory, in MiB ("heap" where it is read)."""
    name = "heap" if "heap" in meter.extra else "rss_anon"
    return meter.extra.get(name, 0) / MIB, meter.retained.get(name, 0) / MIB


class RankHost:
    """Rank ``rank`` of an FSDP2 learner of ``world`` ranks on its own host: the sender
    of its own part (``"sharded"``), and, for ``"gather"``, a party to the gather of the
    full state dict that rank 0 then sends with a plain sender.

    Answers ``("connect", ())`` and ``("send", (variant,))``: a new version (every local
    element + 1.0), then that variant's send; its time, memory and bytes.
    """

    def __init__(
        self,
        namespace: str,
        rank: int,
        world: int,
        master: str,
        layers: int,
        workers: int,
        chunk_bytes: int,
    ) -> None:
        import torch.distributed as dist

        enter_netns(namespace)
        os.environ.update(
            MASTER_ADDR=master, MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME="eth0"
        )
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=PEER_SECONDS),
        )
        self.rank = rank
        self.net = _fully_sharded(build_model(layers))
        self.schemes: dict[str, Any] = {}
        self.full: dict[str, torch.Tensor] = {}
        #: What setting up each variant's sender took (rank 0's full buffer, ...), MiB.
        self.setup_mib: dict[str, float] = {}
        self._open(workers, chunk_bytes)

    def _open(self, workers: int, chunk_bytes: int) -> None:
        """Bind this rank's sharded sender, and rank 0's gather-then-send sender."""
        import zmqsync

        host = _own_address()
        with PeakMemoryMeter(SAMPLE_SECONDS) as meter:
            sharded = zmqsync.ZMQWeightSyncScheme(
                "state_dict",
                endpoint=f"tcp://{host}:{PORTS['sharded']}",
                insecure=True,
                timeout=PEER_SECONDS,
                connect_timeout=GROUP_SECONDS,
                chunk_bytes=chunk_bytes,
            )
            sharded.init_on_sender("policy", model=self.net, num_workers=workers)
        self.schemes["sharded"] = sharded
        self.setup_mib["sharded"] = _memory_mib(meter)[1]
        if self.rank != 0:
            self.setup_mib["gather"] = 0.0
            return
        with PeakMemoryMeter(SAMPLE_SECONDS) as meter:
            # The buffer a gather-then-send learner sends from: the whole model.
            self.full = {
                name: torch.empty(t.shape, dtype=t.dtype)
                for name, t in self.net.state_dict().items()
            }
            plain = zmqsync.ZMQWeightSyncScheme(
                "state_dict",
                endpoint=f"tcp://{host}:{PORTS['gather']}",
                insecure=True,
                timeout=PEER_SECONDS,
                chunk_bytes=chunk_bytes,
            )
            plain.init_on_sender("policy", model=self.full, num_workers=workers)
        self.schemes["gather"] = plain
        self.setup_mib["gather"] = _memory_mib(meter)[1]

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {"connect": self.connect, "send": self.send, "endpoint": self.endpoint}

    def endpoint(self, variant: str) -> str:
        """The endpoint workers are given for ``variant`` (rank 0's)."""
        return str(self.schemes[variant].endpoint)

    def connect(self, timeout: float) -> dict[str, float]:
        """Every variant's rendez-vous with its workers."""
        for scheme in self.schemes.values():
            scheme.connect(timeout=timeout)
        return dict(self.setup_mib)

    def send(self, variant: str) -> dict[str, float]:
        """A new version, sent the ``variant`` way: seconds, peak extra memory (MiB) and
        what this rank's zmqsync sender counted (bytes streamed, repairs, stalls)."""
        _bump(self.net)
        scheme = self.schemes.get(variant)
        before = _totals(scheme)
        with PeakMemoryMeter(SAMPLE_SECONDS) as meter:
            started = time.perf_counter()
            if variant == "sharded":
                self.schemes["sharded"].send()
            else:
                self._gather_then_send()
            seconds = time.perf_counter() - started
        extra, _ = _memory_mib(meter)
        counted = {k: v - before[k] for k, v in _totals(scheme).items()}
        rss = meter.peak.get("rss_anon", 0) / MIB  # the whole process's, both variants'
        return {"seconds": seconds, "extra_mib": extra, "rss_peak_mib": rss, **counted}

    def _gather_then_send(self) -> None:
        """What users do today: the full state dict gathered on rank 0 (a collective
        over the learner's group), copied into the buffer rank 0 sends, and sent."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        gathered = get_model_state_dict(self.net, options=options)
        if self.rank != 0:
            return
        for name, t in gathered.items():
            self.full[name].copy_(cast(torch.Tensor, t))
        del gathered
        self.schemes["gather"].send()

    def close(self) -> None:
        import torch.distributed as dist

        for scheme in self.schemes.values():
            scheme.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _own_address() -> str:
    """This host's address on the test subnet (its eth0's)."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    return out.split()[3].split("/")[0]


def _fully_sharded(net: nn.Module) -> nn.Module:
    """``net`` under FSDP2, each layer a unit of its own, over every rank of the group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in net.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _bump(net: nn.Module) -> None:
    """A new version: every element of this rank's shards + 1.0."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in net.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).add_(1.0)


#: The sender's totals a version's figures report.
COUNTED: Final = ("bytes_sent", "repair_bytes", "stalls")


def _totals(scheme: Any) -> dict[str, int]:
    """What a rank's zmqsync sender counted so far (zeros where the rank has none)."""
    if scheme is None:
        return dict.fromkeys(COUNTED, 0)
    totals = scheme.get_sender().report().totals
    return {name: int(getattr(totals, name)) for name in COUNTED}


class WorkerHost:
    """A worker with a plain module per variant, each given rank 0's endpoint of that
    variant (or a relay's); answers ``("check", (variant, value))``."""

    def __init__(self, namespace: str, index: int, layers: int, endpoints: dict[str, str]) -> None:
        import zmqsync

        enter_netns(namespace)
        self.init = {n: t.to(torch.int8) for n, t in build_model(layers).state_dict().items()}
        self.models = {variant: build_model(layers) for variant in endpoints}
        self.schemes: dict[str, Any] = {}
        try:
            for variant, endpoint in endpoints.items():
                scheme = zmqsync.ZMQWeightSyncScheme(
                    "state_dict", endpoint=endpoint, insecure=True, timeout=PEER_SECONDS
                )
                scheme.init_on_receiver(
                    model_id="policy", model=self.models[variant], worker_idx=index
                )
                self.schemes[variant] = scheme
            for scheme in self.schemes.values():
                scheme.connect(timeout=GROUP_SECONDS)
                scheme.start_receiver_thread()
        except BaseException:
            self.close()
            raise

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {"check": self.check}

    def check(self, variant: str, value: float) -> bool:
        """Whether this worker's model of ``variant`` is the initial one + ``value``."""
        scheme = self.schemes[variant]
        with scheme.lock:
            state = self.models[variant].state_dict()
            return all(torch.equal(state[n], t.float() + value) for n, t in self.init.items())

    def close(self) -> None:
        for scheme in self.schemes.values():
            scheme.shutdown()


class RelayHost:
    """A relay host: one relay per variant, in front of that variant's rank 0."""

    def __init__(
        self, namespace: str, index: int, upstreams: dict[str, str], chunk_bytes: int
    ) -> None:
        from zmqsync import Relay

        enter_netns(namespace)
        host = _own_address()
        self.relays: dict[str, Any] = {}
        try:
            for variant, upstream in upstreams.items():
                relay = Relay.over_zmq(
                    upstream,
                    f"tcp://{host}:{RELAY_PORTS[variant]}",
                    insecure=True,
                    strategy="state_dict",
                    worker_idx=index,
                    timeout=PEER_SECONDS,
                    # What its workers joining late get version 0 in: small chunks, as
                    # the learners' (8 MiB ones stall behind a shaped link).
                    chunk_bytes=chunk_bytes,
                )
                self.relays[variant] = relay
                relay.connect(timeout=GROUP_SECONDS)
                relay.start()
        except BaseException:
            self.close()
            raise

    def commands(self) -> Mapping[str, Callable[..., Any]]:
        return {}

    def close(self) -> None:
        for relay in self.relays.values():
            relay.close()
