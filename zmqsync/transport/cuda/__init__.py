"""Device memory lent to workers on the learner's own GPU, through CUDA IPC.

A learner whose model lives on a GPU writes each version once into a device block of
its hub's :mod:`~.blocks` pool; a worker on the same host whose model lives on that same
GPU opens the block once, from its CUDA IPC handle (:mod:`~.handles`: bytes on the pipe,
or a :class:`~zmqsync.transport.shm.records.DeviceGrant` record on a ZeroMQ socket or in
a Ray call; never a pickle), and copies each version from it device to device: nothing crosses to
the host. The leases and releases are the shared-memory blocks' own
(:mod:`zmqsync.transport.shm`); a worker synchronizes its device before it releases a
block, so the learner never rewrites bytes a queued copy still reads.
"""

from zmqsync.transport.cuda.blocks import DeviceBlock, DevicePool
from zmqsync.transport.cuda.handles import DEVICE_IDS, DeviceHandle

__all__ = ["DEVICE_IDS", "DeviceBlock", "DeviceHandle", "DevicePool"]
