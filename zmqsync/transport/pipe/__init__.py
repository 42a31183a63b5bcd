"""Transport over multiprocessing pipes: one duplex pipe per worker, no sockets to bind.

The hub (:class:`PipeHub`) holds one end of each worker's ``multiprocessing.Pipe()``
(``duplex=True``); the worker's :class:`PipeSpoke` holds the other. Each end writes on a
thread of its own (:mod:`.writer`), so ``send_frames`` never blocks on a busy or dead
peer, and a version waiting to be written is replaced by a newer one. ``send_frames``
copies what it is given once (shared by every worker's queue), so the caller may change
its tensors as soon as it returns; ``bytes`` and read-only buffers (a sender's
snapshot), which never change, are not copied.

Large frames skip the pipe where the platform has ``memfd`` (Linux): the hub puts them
once into a shared-memory block (:mod:`zmqsync.transport.shm`), passes each worker the
block's descriptor once (``SCM_RIGHTS``), and then only sends leases naming where each
frame lies; the worker releases a block once its frames are garbage.
``PipeHub(shared_memory=False)`` keeps every byte on the pipe. A version on the
learner's GPU, for workers whose models live on that GPU, is written once into a block
of device memory the hub lends instead (:mod:`zmqsync.transport.cuda`): each worker
opens it once from its CUDA IPC handle and copies each version device to device.
A worker learns its index from the first record on its pipe (:attr:`PipeSpoke.peer_index`).

Example::

    parent, child = multiprocessing.get_context("spawn").Pipe()
    hub = PipeHub([parent])                 # learner
    spoke = PipeSpoke(child)                # worker process (child end passed at spawn)

Close the learner's copy of each child end once the worker has started: then a worker
that dies is seen at once (end of file) instead of at the next send's timeout.
"""

from zmqsync.transport.pipe.hub import PipeHub, peer_id
from zmqsync.transport.pipe.spoke import PipeSpoke

__all__ = ["PipeHub", "PipeSpoke", "peer_id"]
