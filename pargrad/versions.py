"""Version counters: how a node notices that a tensor it saved was changed in place.

Every Tensor holds a ``VersionCounter``. An in-place operation (``add_``, ``x[i] = v``,
``+=``...) bumps it; tensors that share memory (``detach``, and the views made by
``reshape``, basic indexing, ``transpose``...) share one counter, so a change through any
of them is seen by all. A node that saves tensors for its backward records their
versions with ``record`` and calls ``check`` before it reads the saved values.

The counters are not locked: a counter changes only when the tensor's memory is
written, and writing a tensor on one thread while another thread reads it (a backward
included) is a data race on the array itself, which no lock on the counter would make
safe. The check catches every in-place change that happens before the node runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pargrad.graph import BackwardError


class VersionCounter:
    """How many times a tensor's memory was changed in place (shared by its views)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


Saved = tuple[str, int, VersionCounter, int, Any]
"""What a node keeps of one saved tensor: what it is to the node (``"argument"``,
``"output"``, ``"saved tensor"``) and its index, its counter, the version it had when
saved, and its array (for the shape and dtype in the error message)."""


def record(kind: str, tensors: Iterable[object]) -> list[Saved]:
    """The versions of the Tensors among ``tensors`` now, each labelled by its index."""
    from pargrad.tensor import Tensor

    return [(kind, i, t._counter, t._counter.value, t.data)
            for i, t in enumerate(tensors) if isinstance(t, Tensor)]


def check(node_name: str, saved: Iterable[Saved]) -> None:
    """Raise ``BackwardError`` naming ``node_name`` if a saved tensor's version moved on.

    The message names the saved tensor (what it is, its index, shape and dtype) and both
    versions.
    """
    for kind, i, counter, version, array in saved:
        if counter.value != version:
            raise BackwardError(
                node_name,
                f"one of the tensors saved for its backward was changed by an in-place "
                f"operation: {kind} {i} (shape {array.shape}, dtype {array.dtype}) is at "
                f"version {counter.value}, but was saved at version {version}. Change it "
                f"only after the backward that needs it, or change a .copy() instead",
            )
