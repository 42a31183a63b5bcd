"""What the sync-latency benchmark is made of: model layouts, a memory meter, and a pool
of worker processes driven over control pipes.

The control pipes (multiprocessing ``Pipe``, pickle) only set sessions up, tear them
down and collect digests; weights never travel over them, and nothing on them is timed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import hashlib
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

#: Bytes in the benchmark's "MB" (the issue's sizes are powers of two in practice).
MIB: Final = 1024 * 1024
#: How often the memory meter samples the learner's memory.
MEMORY_SAMPLE_SECONDS: Final = 0.001
#: How long a worker may take to start (spawn + import torch) on a loaded 2-core box.
WORKER_START_SECONDS: Final = 120.0


@dataclass(frozen=True)
class Layout:
    """A state_dict layout: ``count`` float32 tensors of shape ``shape``."""

    name: str
    count: int
    shape: tuple[int, ...]

    @property
    def tensor_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * 4

    @property
    def nbytes(self) -> int:
        return self.count * self.tensor_bytes

    def key_names(self) -> list[str]:
        return [f"layer{i}.weight" for i in range(self.count)]

    def describe(self) -> str:
        return f"{self.count} x float32{list(self.shape)}"


#: The issue's sizes. The three "MB" models are a few equal weight matrices, the way a
#: policy's linear layers are; "2000x4KB" is many tiny tensors (norms, biases, heads).
SIZES: Final[dict[str, Layout]] = {
    "1MB": Layout("1MB", 4, (256, 256)),
    "16MB": Layout("16MB", 8, (1024, 512)),
    "128MB": Layout("128MB", 16, (2048, 1024)),
    "2000x4KB": Layout("2000x4KB", 2000, (1024,)),
}


#: Where the learner's and every worker's tensors live: ``cpu`` or ``cuda`` (spawned
#: workers read it from the environment, which ``--device`` sets).
DEVICE_ENV: Final = "ZMQSYNC_BENCH_DEVICE"


def bench_device() -> str:
    return os.environ.get(DEVICE_ENV, "cpu")


def make_state_dict(layout: Layout, *, fill: str) -> dict[str, torch.Tensor]:
    """A state_dict of ``layout`` on :func:`bench_device`: random values (the learner) or
    zeros (a worker)."""
    gen = torch.Generator().manual_seed(1234)
    out = {}
    for key in layout.key_names():
        if fill == "random":
            out[key] = torch.randn(layout.shape, generator=gen)
        else:
            out[key] = torch.zeros(layout.shape)
    device = bench_device()
    return out if device == "cpu" else {k: v.to(device) for k, v in out.items()}


def digest(state_dict: dict[str, torch.Tensor]) -> str:
    """A digest of a state_dict's bytes, read in place (no copy of CPU tensors)."""
    h = hashlib.blake2b(digest_size=16)
    for key, tensor in state_dict.items():
        h.update(key.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().data.cast("B"))
    return h.hexdigest()


# --- memory -------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _heap_reader() -> Callable[[], int] | None:
    """Bytes this process holds from malloc now (glibc >= 2.33), or None elsewhere."""
    path = ctypes.util.find_library("c")
    if not path or not sys.platform.startswith("linux"):
        return None
    try:
        mallinfo2 = ctypes.CDLL(path).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)  # in use on the heaps + mmapped blocks

    return read


def _anon_rss_reader() -> Callable[[], int] | None:
    """Anonymous resident bytes now (resident minus file-backed), or None without /proc."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> int:
        fields = os.pread(fd, 256, 0).split()
        return (int(fields[1]) - int(fields[2])) * page

    return read


@functools.cache
def _readers() -> dict[str, Callable[[], int]]:
    """What the meter reads, best first ("heap" is what the table shows); built once, so
    the process holds one open /proc/self/statm however many meters it makes."""
    made = {"heap": _heap_reader(), "rss_anon": _anon_rss_reader()}
    return {name: read for name, read in made.items() if read is not None}


class PeakMemoryMeter:
    """Peak increase of this process's memory over a ``with`` block, sampled every ~1 ms.

    Two measures, each as ``extra[name]`` (peak minus the value when the block began) and
    ``retained[name]`` (what the block left allocated, e.g. a snapshot kept for late
    joiners):

    - ``"heap"``: bytes held from malloc (glibc's ``mallinfo2``), which is where torch,
      numpy and libzmq put every buffer. It counts a copy even when malloc serves it from
      memory freed earlier, which RSS does not see: the figure to judge "is there a copy
      of the model" by.
    - ``"rss_anon"``: anonymous resident memory from ``/proc/self/statm`` (file-backed
      pages, such as libtorch's code paged in on first use, are left out). What the
      machine feels; it can read low when a copy reuses freed memory.

    A measure this platform lacks is absent from the dicts.
    """

    def __init__(self, interval: float = MEMORY_SAMPLE_SECONDS) -> None:
        self.interval = interval
        self._readers = _readers()
        self.base: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, int]:
        return {name: read() for name, read in self._readers.items()}

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            for name, value in self._read().items():
                if value > self.peak[name]:
                    self.peak[name] = value

    def __enter__(self) -> PeakMemoryMeter:
        gc.collect()
        self.base = self._read()
        self.peak = dict(self.base)
        if self._readers:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self.end = self._read()
        for name, value in self.end.items():
            self.peak[name] = max(self.peak[name], value)

    @property
    def extra(self) -> dict[str, int]:
        return {name: self.peak[name] - self.base[name] for name in self.base}

    @property
    def retained(self) -> dict[str, int]:
        return {name: self.end[name] - self.base[name] for name in self.base}


# --- the machine ----------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    return "unknown"


def _git_commit(repo: str) -> str:
    """The commit measured, with "+dirty" when zmqsync/ has uncommitted changes."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--", "zmqsync"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    return "unknown"


def machine_info() -> dict[str, Any]:
    """What the table's figures were measured on."""
    import zmq

    import zmqsync

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "zmqsync": zmqsync.__version__,
        "commit": _git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# --- worker processes -----------------------------------------------------------------


class WorkerError(RuntimeError):
    """A worker process failed a command (its traceback is in the message)."""


class WorkerPool:
    """``size`` spawned worker processes, reused by every cell of the benchmark.

    Starting a process that imports torch takes seconds on a small machine; doing it
    once keeps a full run's time on the measurements. Every command has a deadline, and
    :meth:`close` ends every process (exit, then terminate, then kill).
    """

    def __init__(self, size: int, torch_threads: int | None = None) -> None:
        self.size = size
        self.torch_threads = torch_threads
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def start(self, timeout: float = WORKER_START_SECONDS) -> None:
        from benchmarks._worker import worker_main

        for idx in range(self.size):
            parent, child = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=worker_main,
                args=(idx, child, os.getpid(), self.torch_threads),
                name=f"bench-worker-{idx}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        # "start" is answered once the worker has imported torch and zmqsync.
        self.call(range(self.size), "start", (), timeout)

    def call(
        self,
        workers: Iterable[int],
        command: str,
        args: Sequence[Any] | dict[int, Any],
        timeout: float,
    ) -> list[Any]:
        """Send ``command`` to each worker, then collect every reply (in worker order).

        ``args`` is one tuple for all, or ``{worker: tuple}``.
        """
        ids = list(workers)
        for i in ids:
            a = args[i] if isinstance(args, dict) else args
            self._conns[i].send((command, tuple(a)))
        return self.collect(ids, command, timeout)

    def collect(self, ids: Iterable[int], command: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        replies = []
        for i in ids:
            conn = self._conns[i]
            remaining = max(0.0, deadline - time.monotonic())
            if not conn.poll(remaining):
                proc = self._procs[i]
                state = "alive" if proc.is_alive() else f"dead, exit code {proc.exitcode}"
                raise TimeoutError(
                    f"worker {i} did not answer {command!r} within {timeout:g}s ({state})"
                )
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                raise WorkerError(
                    f"worker {i} died during {command!r} (exit code {self._procs[i].exitcode})"
                ) from None
            if status != "ok":
                raise WorkerError(f"worker {i} failed {command!r}:\n{payload}")
            replies.append(payload)
        return replies

    def close(self, timeout: float = 5.0) -> None:
        """End every worker: ask, then terminate, then kill. Idempotent."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                conn.send(("exit", ()))
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
