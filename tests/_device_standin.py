"""CPU shared memory standing in for CUDA IPC, where there is no GPU (CI's machines).

Device lending's one CUDA-specific part is :class:`zmqsync.transport.cuda.handles.CudaIpc`
(naming a GPU, allocating, sharing and opening a block, waiting for the device). With
:class:`CpuIpc` in its place, "the device" is the CPU: blocks are torch shared-memory
files opened by name, and everything around them (the sender's write into a lent block,
the pool, the hub's leases and handle records, the pipe, the worker's opening, applying
from a tensor and releasing) runs as it is, in real processes. ``tests/test_cuda.py``
runs the same paths on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import CudaIpc, DeviceHandle

__all__ = ["STAND_IN_UUID", "CpuIpc", "install", "run_worker_on_the_device"]

#: The name of the one "GPU" the stand-in has.
STAND_IN_UUID = b"stand-in device!"


class CpuIpc(CudaIpc):
    """CUDA IPC's operations on CPU tensors in torch's shared memory (see the module)."""

    def __init__(self, *, opens: bool = True, refuses: int = 0) -> None:
        #: False: a worker that names the device but cannot open its blocks.
        self.opens = opens
        #: How many blocks the device refuses to open first (a RuntimeError, as CUDA
        #: raises for a handle of memory freed meanwhile).
        self.refuses = refuses

    def lendable(self, device: Any) -> bool:
        return device is not None and torch.device(device).type == "cpu"

    def is_device(self, frame: Any) -> bool:
        return isinstance(frame, torch.Tensor) and frame.device.type == "cpu"

    def uuid_of(self, device: torch.device | int) -> bytes:
        return STAND_IN_UUID

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        block = torch.empty(nbytes, dtype=torch.uint8)
        block.untyped_storage()._share_filename_cpu_()  # moves it into a shared file
        return block

    def share(self, tensor: torch.Tensor) -> DeviceHandle:
        manager, name, size = tensor.untyped_storage()._share_filename_cpu_()
        return DeviceHandle(STAND_IN_UUID, name, size, 0, manager, 0, b"", False)

    def open_handle(self, handle: DeviceHandle) -> torch.Tensor:
        if handle.uuid != STAND_IN_UUID or not self.opens:
            raise ValueError("a device block on a device this process does not see")
        if self.refuses > 0:
            self.refuses -= 1
            raise RuntimeError("the stand-in's device refuses this block")
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            handle.ref_handle, handle.handle, handle.size
        )
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (handle.size,), (1,))

    def synchronize(self, device: torch.device) -> None:
        pass


def install(ipc: CpuIpc | None = None) -> None:
    """Stand the CPU in for CUDA IPC in this process."""
    handles.IPC = ipc or CpuIpc()


def run_worker_on_the_device(*args: Any) -> None:
    """``_workers.run_worker`` in a process whose "device" is the stand-in's."""
    from _workers import run_worker

    install()
    run_worker(*args)


def run_worker_that_cannot_open(*args: Any) -> None:
    """``_workers.run_worker`` in a process that names the stand-in's device but cannot
    open its blocks (a confused worker)."""
    from _workers import run_worker

    install(CpuIpc(opens=False))
    run_worker(*args)


def run_worker_whose_device_refuses_once(*args: Any) -> None:
    """``_workers.run_worker`` in a process whose device refuses the first block it is
    asked to open (then opens every one)."""
    from _workers import run_worker

    install(CpuIpc(refuses=1))
    run_worker(*args)
