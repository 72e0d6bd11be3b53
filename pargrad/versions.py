"""Version counters: how a node notices that a tensor it saved was changed in place.

Every Tensor has a ``VersionCounter`` (made on first use). An in-place operation
(``add_``, ``x[i] = v``, ``+=``...) bumps it; tensors that share memory (``detach``, and
the views made by ``reshape``, basic indexing, ``transpose``...) share one counter, so a
change through any of them is seen by all. A node that saves tensors for its backward
records their versions (``tensor.saved_versions``) and calls ``check`` before it reads
the saved values.

The counters are not locked (their lazy creation aside): a counter changes only when the
tensor's memory is written, and writing a tensor on one thread while another thread
reads it (a backward included) is a data race on the array itself, which no lock on the
counter would make safe. The check catches every in-place change that happens before the
node runs.
"""

from __future__ import annotations

import threading
from typing import Any, NoReturn

from pargrad.graph import BackwardError
from pargrad.replay import recorder


class VersionCounter:
    """How many times a tensor's memory was changed in place (shared by its views)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        if recorder.active:
            recorder.fail("a tensor is changed in place (an in-place op, an item "
                          "assignment, or an optimizer step)")
        self.value += 1


# Guards the lazy creation of every tensor's counter (Tensor._counter), so that two
# threads saving one tensor at once share one counter. Reads take no lock: a counter,
# once set, is never replaced (except on a tensor no other thread sees yet).
_lock = threading.Lock()


def counter_of(tensor: Any) -> VersionCounter:
    """The version counter of ``tensor``, made on first use: most tensors are never
    saved nor changed in place, and a counter for each would only feed the garbage
    collector.

    A node that saved its output 0 (``reads_output``) holds that output's counter in
    its ``output_counter`` (None until one is made): the counter of a tensor that is
    output 0 of such a node is that one, made here on first use by any tensor with that
    history (the output itself, or one rebuilt around the node for ``create_graph``). So
    the forward makes no counter for the outputs it saves, and the node still sees the
    first in-place change of its output. Whatever gives a tensor another history (an
    in-place op's ``_rebase``, ``detach_``) asks for its counter first.
    """
    counter: VersionCounter | None = tensor._counter
    if counter is None:
        with _lock:
            counter = tensor._counter
            if counter is None:
                fn = tensor.grad_fn
                if fn is not None and fn.reads_output and tensor.output_nr == 0:
                    counter = fn.output_counter
                    if counter is None:
                        counter = fn.output_counter = VersionCounter()
                else:
                    counter = VersionCounter()
                tensor._counter = counter
    return counter


class SavedVersion:
    """What a node keeps of one tensor it saved, to check before reading it: ``where``,
    ``i`` for argument (or saved tensor) ``i`` and ``-1 - i`` for output ``i``; the
    tensor's ``counter`` and its ``version`` (the counter's value) when saved; the saved
    ``array`` (for the error message)."""

    __slots__ = ("array", "counter", "version", "where")

    def __init__(self, where: int, counter: VersionCounter, version: int, array: Any) -> None:
        self.where = where
        self.counter = counter
        self.version = version
        self.array = array


Saved = tuple[SavedVersion, ...]
"""The versions of the tensors a node saved."""


def check(node_name: str, saved: Saved, kind: str = "argument") -> None:
    """Raise ``BackwardError`` naming ``node_name`` if a saved tensor's version moved on.

    The message names the saved tensor (``kind`` and index, or output and index; shape,
    dtype) and both versions.
    """
    for record in saved:
        if record.counter.value != record.version:
            changed(node_name, record, kind)


def changed(node_name: str, record: SavedVersion, kind: str = "argument") -> NoReturn:
    """Raise the ``BackwardError`` of ``check`` for ``record``, whose version moved on."""
    where, array = record.where, record.array
    what = f"{kind} {where}" if where >= 0 else f"output {-1 - where}"
    raise BackwardError(
        node_name,
        f"one of the tensors saved for its backward was changed by an in-place "
        f"operation: {what} (shape {array.shape}, dtype {array.dtype}) is at "
        f"version {record.counter.value}, but was saved at version {record.version}. "
        f"Change it only after the backward that needs it, or change a .copy() instead",
    )
