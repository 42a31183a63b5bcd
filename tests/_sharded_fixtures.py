"""The setup the sharded-learner tests share, so that each test file keeps only what it
tests: in-process ranks (a fake part of rows over memory hubs, a hub that dies), their
collective sends, and spawned ranks and workers driven over pipes."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from _faults import until

from zmqsync import WeightSender
from zmqsync.protocol import Box, Chunk, TensorEntry, WeightsSchema, encode_schema, layout_digest
from zmqsync.transport.memory import MemoryHub

SPAWN = mp.get_context("spawn")


# --- in-process ranks -------------------------------------------------------------------


class RowsPart:
    """A fake rank's part (as :class:`~zmqsync.tensors.dtensor.LocalPart` gives it): rows
    ``[p*n//M, (p+1)*n//M)`` of each tensor of two or more dimensions, the others whole
    from part 0. The same tensors give the same part (a sender asks at every send)."""

    def __init__(self, part: int, parts: int) -> None:
        self.part, self.parts = part, parts
        self.boxes: dict[Any, Box] = {}
        self._source: Any = None
        self._local: dict[Any, Any] = {}

    def local(self, tensors: Any) -> Any:
        """This part of ``tensors`` (views, not copies), its boxes in :attr:`boxes`."""
        if tensors is self._source:
            return self._local
        local, boxes = {}, {}
        for key, t in tensors.items():
            if t.dim() < 2:
                if self.part == 0:
                    local[key] = t
                continue
            n = t.shape[0]
            lo, hi = self.part * n // self.parts, (self.part + 1) * n // self.parts
            local[key] = t[lo:hi]
            boxes[key] = Box(tuple(t.shape), (lo,) + (0,) * (t.dim() - 1))
        self._source, self._local, self.boxes = tensors, local, boxes
        return local


def rank_senders(
    names: list[Any], model: Any, *, hubs: dict[int, Any] | None = None, **options: Any
) -> list[WeightSender]:
    """One sender per rank of a learner holding ``model``: rank ``r`` a :class:`RowsPart`
    over ``hubs[r]`` where given, else a memory hub bound at ``names[r]``, each told every
    rank's endpoint. ``options`` (an ``epoch`` the ranks agree on among them: a scheme
    makes them) go to every sender."""
    return [
        WeightSender(
            (hubs or {}).get(r) or MemoryHub(names[r]),
            model=model,
            strategy="state_dict",
            part=RowsPart(r, len(names)),  # type: ignore[arg-type]
            ranks=names,
            **options,
        )
        for r in range(len(names))
    ]


def call_on_every_rank(
    senders: list[WeightSender], call: Callable[[int, WeightSender], Any], timeout: float = 60.0
) -> list[BaseException | None]:
    """``call(rank, sender)`` on every rank at once (a collective call), each on a thread
    of its own: what each raised, by rank (``None``: it returned)."""
    errors: list[BaseException | None] = [None] * len(senders)

    def run(rank: int) -> None:
        try:
            call(rank, senders[rank])
        except BaseException as exc:
            errors[rank] = exc

    threads = [
        threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(len(senders))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank's call did not return"
    return errors


def on_every_rank(senders: list[WeightSender], call: Callable[[int, WeightSender], Any]) -> None:
    """``call(rank, sender)`` on every rank at once; none may raise."""
    errors = [e for e in call_on_every_rank(senders, call) if e is not None]
    assert not errors, errors


def sends(senders: list[WeightSender], worker_ids: Any = None) -> list[BaseException | None]:
    """Every rank's send of one version at once: what each raised, by rank."""
    return call_on_every_rank(senders, lambda _, sender: sender.send(worker_ids=worker_ids))


def send_all(senders: list[WeightSender], worker_ids: Any = None) -> None:
    """Every rank's send of one version at once; none may raise."""
    on_every_rank(senders, lambda _, sender: sender.send(worker_ids=worker_ids))


def close_all(receivers: list[Any], senders: list[Any]) -> None:
    """Workers first, then the ranks they hold sessions with."""
    for r in receivers:
        r.close()
    for s in senders:
        s.close()


def below_of(sender: WeightSender, relay: int) -> set[int]:
    """The workers whose claim by ``relay`` stands, as ``sender``'s status shows them."""
    for row in sender.status()["workers"]:
        if row["worker"] == relay:
            return {int(w) for w in row.get("below") or {}}
    return set()


class DyingHub(MemoryHub):
    """A memory hub that, once ``die(after)`` is called, lets ``after`` more messages
    out and then nothing at all: a rank that dies in the middle of its part's stream
    (what it is sent still comes in, as to a socket whose process is gone). ``revive``
    brings it back."""

    left: int | None = None

    def die(self, after: int) -> None:
        self.left = after

    def revive(self) -> None:
        self.left = None

    def send_frames(self, frames: Any, **kwargs: Any) -> None:
        if self.left is not None:
            if self.left <= 0:
                return
            self.left -= 1
        super().send_frames(frames, **kwargs)


# --- parts on the wire, as ranks would cut them (fakes) -------------------------------


def first_chunk(schema: WeightsSchema, stream: bytes, version: int = 1, epoch: int = 7) -> Chunk:
    """A version's one whole chunk of ``stream``, the first of its part: it carries the
    part's schema."""
    layout = layout_digest(encode_schema(schema))
    return Chunk("p", version, epoch, 0, 1, 0, len(stream), layout, stream, schema)


def fake_parts(global_tensors: dict[str, np.ndarray], cuts: int) -> list[WeightsSchema]:
    """Each tensor cut into ``cuts`` boxes along its last dimension (uneven, some empty),
    ``"s"`` whole in part 0: the schemas and streams ranks would send."""
    out = []
    for p in range(cuts):
        entries, pos = [], 0
        for key, t in global_tensors.items():
            if key == "s":
                if p:
                    continue
                entries.append(TensorEntry((key,), "float32", t.shape, 0, pos, t.nbytes))
                pos += t.nbytes
                continue
            n = t.shape[-1]
            lo, hi = p * n // cuts, (p + 1) * n // cuts
            shape = (*t.shape[:-1], hi - lo)
            at = (0,) * (t.ndim - 1) + (lo,)
            nbytes = 4 * math.prod(shape)
            entries.append(
                TensorEntry((key,), "float32", shape, 0, pos, nbytes, "", Box(t.shape, at))
            )
            pos += nbytes
        out.append(WeightsSchema("state_dict", tuple(entries), p, cuts))
    return out


def part_stream(schema: WeightsSchema, tensors: dict[str, np.ndarray]) -> bytes:
    """The bytes a rank sends of ``schema``'s boxes of ``tensors``."""
    out = b""
    for e in schema.entries:
        t = tensors[e.key[0]]
        if e.box is not None:
            t = t[tuple(slice(o, o + n) for o, n in zip(e.box.offsets, e.shape, strict=True))]
        out += np.ascontiguousarray(t).tobytes()
    return out


def fake_tensors(seed: int) -> dict[str, np.ndarray]:
    """A small model of ``seed``: a matrix, a vector and a scalar."""
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal((7,)).astype(np.float32),
        "s": rng.standard_normal(()).astype(np.float32),
    }


def gathered_arrays(chunk: Chunk) -> dict[str, np.ndarray]:
    """The arrays a gathered whole chunk holds, by name."""
    assert chunk.schema is not None
    data = np.frombuffer(chunk.payload, dtype=np.uint8)
    return {
        e.key[0]: data[e.offset : e.offset + e.nbytes].view(np.float32).reshape(e.shape)
        for e in chunk.schema.entries
    }


# --- spawned ranks and workers, driven over pipes ---------------------------------------


def answer(conn: Any, what: Any, timeout: float = 90.0, who: str = "a process") -> Any:
    """The next reply on ``conn`` within ``timeout``; a process's traceback raised here."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {what!r} in {timeout}s")
    reply = conn.recv()
    if isinstance(reply, tuple) and reply and reply[0] == "error":
        raise AssertionError(f"{who} failed: {reply[1]}")
    return reply


def ask(conn: Any, command: Any, timeout: float = 90.0, who: str = "a process") -> Any:
    """``command`` sent, and its reply."""
    conn.send(command)
    return answer(conn, command, timeout, who)


def answers(conns: list[Any], what: Any, timeout: float = 90.0) -> list[Any]:
    """The next reply of every process, in order."""
    return [answer(c, what, timeout) for c in conns]


def collective(conns: list[Any], command: Any, timeout: float = 90.0) -> list[Any]:
    """``command`` sent to every rank before any reply is read (the ranks' collective
    calls need them all), then every rank's reply."""
    for c in conns:
        c.send(command)
    return answers(conns, command, timeout)


def ipc_endpoints(tmp_path: Any, world: int) -> list[str]:
    """Each rank's own ipc endpoint under ``tmp_path``."""
    return [f"ipc://{tmp_path}/rank{r}" for r in range(world)]


class Processes:
    """The spawned processes of one test and the test's end of each one's pipe. Closing
    tells each to stop (a stopped one is continued first, so that it hears), kills what
    does not exit in time; leaving the block without an error, every one has exited."""

    def __init__(self, join: float = 10.0, exited: float = 10.0) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._join, self._exited = join, exited

    def start(self, target: Any, *args: Any, after: tuple[Any, ...] = ()) -> Any:
        """``target(*args, conn, *after)`` in a spawned process; the test's end of
        ``conn``."""
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=target, args=(*args, child, *after), daemon=True)
        proc.start()
        child.close()
        self.procs.append(proc)
        self.conns.append(parent)
        return parent

    def ranks(
        self, target: Any, port: int, endpoints: list[str], after: tuple[Any, ...] = ()
    ) -> list[Any]:
        """Rank ``r`` of ``len(endpoints)``: ``target(r, world, port, endpoints[r], conn,
        *after)``, for every rank (not waited for: each answers when it is ready)."""
        world = len(endpoints)
        return [self.start(target, r, world, port, endpoints[r], after=after) for r in range(world)]

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                if proc.pid is not None and proc.is_alive():
                    os.kill(proc.pid, signal.SIGCONT)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send("stop")
        for proc in self.procs:
            proc.join(self._join)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        self.close()
        if kind is None:
            until(
                lambda: not any(p.is_alive() for p in self.procs),
                self._exited,
                "every process exited",
            )
