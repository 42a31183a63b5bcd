"""A sharded learner: an FSDP2 model over 2 ranks (gloo, on the CPU), every rank sending
its own shard of each version; a worker with a plain module receives whole versions.

Run it as it is: ``python docs/examples/sharded_fsdp2.py``.
"""

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zmqsync

WORLD = 2  # learner ranks
VERSIONS = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 33 rows: FSDP2's shards of it are uneven over 2 ranks, and that is fine.
    return nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))


def learner(rank: int, folder: str, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # every parameter is now a DTensor: this rank's shard
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # Every rank binds an endpoint of its own (across hosts: tcp://its-host:port);
    # workers are given rank 0's alone.
    scheme = zmqsync.ZMQWeightSyncScheme(
        "state_dict", endpoint=f"ipc://{folder}/rank{rank}", timeout=30
    )
    scheme.init_on_sender("policy", model=model, num_workers=1)  # every rank, together
    scheme.connect(timeout=60)  # every rank: waits for the worker
    for _ in range(VERSIONS):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheme.send()  # every rank sends its own shard: together, one version

    # Only to check the worker: the whole model, gathered (a collective call).
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}
    if rank == 0:
        out.put(("learner", scheme.get_sender().version, zmqsync.checksum(full, "state_dict")))
    scheme.shutdown()
    dist.destroy_process_group()


def worker(endpoint: str, out: mp.Queue) -> None:
    model = make_model()  # a plain module: no torch.distributed here
    scheme = zmqsync.ZMQWeightSyncScheme("state_dict", endpoint=endpoint, timeout=30)
    scheme.init_on_receiver(model_id="policy", model=model, worker_idx=0)
    scheme.connect(timeout=60)
    receiver = scheme.get_receiver()
    while receiver.version < VERSIONS:
        scheme.receive(timeout=30)  # applies each version whole, once every shard is in
    out.put(("worker", receiver.version, zmqsync.checksum(model, "state_dict")))
    scheme.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()  # for the ranks' process group
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=learner, args=(r, folder, port, out)) for r in range(WORLD)]
        procs.append(ctx.Process(target=worker, args=(f"ipc://{folder}/rank0", out)))
        for p in procs:
            p.start()
        replies = [out.get(timeout=120) for _ in range(2)]  # the learner's and the worker's
        results = {who: (version, digest) for who, version, digest in replies}
        for p in procs:
            p.join(timeout=60)
    version, digest = results["worker"]
    print(
        f"worker holds version {version}; equal to the learner's gathered model: "
        f"{results['learner'] == (version, digest)}"
    )


if __name__ == "__main__":
    main()
