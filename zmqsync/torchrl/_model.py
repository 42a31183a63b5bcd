"""The worker's policy as torchrl hands it over: real storage for a ``meta`` policy,
forward passes that hold the receiver's lock, and finding a model in a collector."""

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
