"""The worker's policy as torchrl hands it over: real storage for a ``meta`` policy,
forward passes that hold the receiver's lock, the collector's policy-version tracker,
and finding a model in a collector."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tensordict import TensorDictBase
from torch import nn
from torchrl.weight_update.utils import _resolve_model


def _materialize(model: Any) -> Any:
    """Give a ``meta``-device module real, uninitialised CPU storage, in place.

    torchrl sends workers the policy's structure only (parameters on ``meta``); the
    scheme's first version then fills the storage. A module with no meta tensors is
    returned untouched.
    """
    if not isinstance(model, nn.Module):
        return model  # a TensorDict or dict is the caller's own storage: never on meta here
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        # to_empty swaps the module's parameters for new CPU ones (same module objects).
        model.to_empty(device="cpu", recurse=True)
    return model


class _ForwardLock:
    """Forward hooks that hold a receiver's lock for a module's whole forward pass.

    ``always_call=True`` releases the lock even when the forward raises, so a failing
    policy cannot stall the background receiver. The hooks are plain closures, not bound
    methods: ``copy.deepcopy`` shares functions, so a hooked policy can still be deep
    copied (torchrl copies policies to their device), and the copy takes the same lock.
    """

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self._handles: list[Any] = []

        def acquire(module: nn.Module, args: Any) -> None:
            lock.acquire()

        def release(module: nn.Module, args: Any, output: Any) -> None:
            lock.release()

        acquire.zmqsync_lock = lock  # type: ignore[attr-defined]
        self._acquire, self._release = acquire, release

    def attach(self, module: Any) -> None:
        """Hook ``module`` (detaching from the previous one); non-modules are skipped."""
        self.detach()
        if not isinstance(module, nn.Module):
            return
        # A deep copy of a hooked module already carries these hooks: hooking it again
        # would take the lock twice per call.
        if any(
            getattr(h, "zmqsync_lock", None) is self.lock
            for h in module._forward_pre_hooks.values()
        ):
            return
        self._handles = [
            module.register_forward_pre_hook(self._acquire),
            module.register_forward_hook(self._release, always_call=True),
        ]

    def detach(self) -> None:
        """Remove the hooks this object added."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _PolicyVersion:
    """Keeps a collector's policy-version tracker (``track_policy_version=True``)
    naming the version its policy holds: what torchrl writes under
    ``"policy_version"`` in each frame and saves in ``state_dict()``.

    torchrl's own schemes bump the tracker from their ``receive()``; zmqsync applies
    versions in its own thread (or at connect), so it is told here, from the
    receiver's ``on_applied`` listeners: under the receiver's lock, which every
    forward pass holds too, so no forward runs on a version the tracker does not
    name yet. (torchrl writes the tag at the env step that follows the forward, after
    the lock is let go: a version landing in that gap tags that one frame with the
    newer version, as with torchrl's own schemes.)
    """

    def __init__(self) -> None:
        #: What the tracker was last told: (tracker id, epoch, version), so a uuid
        #: tracker gets one new id per version, not per call.
        self._told: tuple[int, int, int] | None = None

    def record(self, context: Any, epoch: int, version: int) -> None:
        """Tell ``context``'s tracker (if it has one) that the policy holds ``version``."""
        tracker = getattr(context, "policy_version_tracker", None)
        if tracker is None:
            return
        told = (id(tracker), epoch, version)
        previous, self._told = self._told, told
        if told == previous:
            return
        if getattr(tracker, "version_type", int) in (int, "int"):
            # torchrl counts updates: the initial weights are 0, two updates make 2, as
            # the learner numbers its versions (it publishes its initial weights as 0).
            # Numbering by the learner's version, not by updates this worker got, keeps
            # equal numbers meaning equal weights across workers (a worker skipped by
            # worker_ids= jumps ahead); a restarted learner numbers from 0 again.
            tracker.version = version
        elif version > 0 or (previous is not None and previous[1] != epoch):
            tracker.increment_version()  # a uuid tracker: a fresh id per new version


def _check_retain_snapshot(sender_options: Mapping[str, Any]) -> None:
    if sender_options.get("retain_snapshot", True) is False:
        raise ValueError(
            "retain_snapshot=False cannot work with torchrl collectors: their workers "
            "take their first weights from the sender's snapshot. Leave it at True."
        )


def _model_of(context: Any, model_id: str) -> Any:
    """The model named ``model_id`` in a torchrl collector (or any object)."""
    getter = getattr(context, "get_model", None)
    if callable(getter):
        try:
            return getter(model_id)
        except (ValueError, AttributeError, KeyError):
            pass
    try:
        return _resolve_model(context, model_id)
    except AttributeError:
        return None


def _weightless(model: Any) -> bool:
    """Whether ``model`` holds no weights to synchronize: a module without parameters or
    buffers, an empty TensorDict or dict, or a policy that is not a module at all and
    has no ``state_dict`` (torchrl's ``RandomPolicy``)."""
    if model is None:
        return False
    if isinstance(model, nn.Module):
        return next(model.parameters(), None) is None and next(model.buffers(), None) is None
    if isinstance(model, TensorDictBase):
        return next(iter(model.keys(True, True)), None) is None
    if isinstance(model, Mapping):
        return not model
    return not callable(getattr(model, "state_dict", None))


def _built(getter: Any) -> Any:
    """``getter()`` (the inner scheme's get_sender/get_receiver), or None before init."""
    try:
        return getter()
    except RuntimeError:
        return None
