"""A base for what closes on leaving a ``with`` block."""

from __future__ import annotations

import abc
from typing import TypeVar

__all__ = ["ClosesOnExit"]

_Self = TypeVar("_Self", bound="ClosesOnExit")


class ClosesOnExit(abc.ABC):
    """A context manager whose exit is :meth:`close`: ``with Thing(...) as thing:``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what it holds. Closing twice silently succeeds."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
