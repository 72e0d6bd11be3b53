"""Gradient accumulation: the one place where gradients are added together.

``InputBuffer`` sums the gradients of one node in the order they arrive;
``OrderedInputBuffer`` sums them in the canonical order of docs/design.md §4 whatever
the order of arrival (the threaded engine's deterministic mode). Neither takes a lock:
the engine guards each buffer with the lock of its node.

``accumulate`` adds a gradient to a running sum. The first gradient is kept by
reference; the second makes a new array that the accumulator owns, and later ones are
added into that array in place. An array that a caller, a node or another edge can see
is therefore never written. Gradients that are Tensors (a backward recording its own
graph) are added out of place, by the differentiable ``add``.
"""

from __future__ import annotations

import numpy as np

from pargrad import memory
from pargrad.graph import Grad

_add = np.add
"""numpy's add, called with ``out`` positional: ~100 ns less per call than ``out=`` on
the small arrays where the call is most of the cost."""


def _sum(total: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``total + grad`` in a new array; a large one from pargrad's pool (its memory comes
    back to the pool when nothing sees the sum any more: pargrad/memory.py)."""
    if (total.nbytes >= memory.MIN_BYTES and total.shape == grad.shape
            and total.dtype == grad.dtype and total.dtype.isnative):
        return _add(total, grad, memory.empty(total.shape, total.dtype))
    return np.asarray(_add(total, grad))


Key = tuple[int, ...]
"""Where a contribution sits in the canonical order: ``(0, root_index)`` for a root
gradient, ``(1, -producer.sequence_nr, edge_index)`` for one sent along an edge."""


def accumulate(total: Grad | None, owned: bool, grad: Grad) -> tuple[Grad, bool]:
    """Return ``(total + grad, owned)``, writing into ``total`` only if ``owned`` says so."""
    if total is None:
        return grad, False
    if not (isinstance(total, np.ndarray) and isinstance(grad, np.ndarray)):
        return total + grad, False
    if owned:
        _add(total, grad, total)
        return total, True
    return _sum(total, grad), True


class InputBuffer:
    """The gradients gathered so far for one node: one running sum per output.

    Gradients are summed in the order they are accumulated. Not thread-safe: an engine
    that shares a buffer between threads guards it with its own lock.
    """

    __slots__ = ("_owned", "_sums")

    def __init__(self, num_outputs: int) -> None:
        self._sums: list[Grad | None] = [None] * num_outputs
        self._owned = 0  # bit i: the sum of output i is an array this buffer made

    # Run for every gradient that meets another: ``accumulate`` written out (same adds,
    # same order), without its call and the tuple it returns.
    def accumulate(self, output_nr: int, grad: Grad | None, key: Key | None = None) -> None:
        """Add ``grad`` (ignored if None) to the sum for output ``output_nr``.

        ``key`` is ignored: gradients are summed in arrival order.
        """
        if grad is None:
            return
        sums = self._sums
        total = sums[output_nr]
        if total is None:
            sums[output_nr] = grad
        elif not (isinstance(total, np.ndarray) and isinstance(grad, np.ndarray)):
            sums[output_nr] = total + grad
            self._owned &= ~(1 << output_nr)
        elif self._owned >> output_nr & 1:
            _add(total, grad, total)
        else:
            sums[output_nr] = _sum(total, grad)
            self._owned |= 1 << output_nr

    def take(self) -> list[Grad | None]:
        """Hand over the sums; the buffer must not be used afterwards."""
        sums, self._sums = self._sums, []
        return sums


class OrderedInputBuffer:
    """Like ``InputBuffer``, but sums in key order, whatever the order of arrival.

    Given the keys each output will receive (``expected``, in order), a contribution is
    folded in as soon as every contribution before it has arrived; the ones that came
    early wait for those. Gradients that arrive in the canonical order (most do: workers
    take the newest nodes first) are summed at once and never kept, so the buffer holds
    what the reference's buffer holds. The sum is folded left through ``accumulate``,
    exactly as the reference engine adds.
    """

    __slots__ = ("_early", "_expected", "_next", "_owned", "_sums")

    def __init__(self, num_outputs: int, expected: list[list[Key]]) -> None:
        self._expected = expected
        self._sums: list[Grad | None] = [None] * num_outputs
        self._owned = [False] * num_outputs
        self._next = [0] * num_outputs  # per output: how many expected keys are folded
        self._early: list[dict[Key, Grad | None]] = [{} for _ in range(num_outputs)]

    def accumulate(self, output_nr: int, grad: Grad | None, key: Key | None = None) -> None:
        """Add ``grad`` (None: nothing to add) for output ``output_nr`` at position
        ``key``."""
        assert key is not None, "an ordered buffer needs the key of each contribution"
        order, early = self._expected[output_nr], self._early[output_nr]
        i = self._next[output_nr]
        if i >= len(order) or order[i] != key:
            early[key] = grad  # something before it is still to come
            return
        self._fold(output_nr, grad)
        i += 1
        while i < len(order) and order[i] in early:
            self._fold(output_nr, early.pop(order[i]))
            i += 1
        self._next[output_nr] = i

    def _fold(self, output_nr: int, grad: Grad | None) -> None:
        if grad is not None:
            self._sums[output_nr], self._owned[output_nr] = accumulate(
                self._sums[output_nr], self._owned[output_nr], grad)

    def take(self) -> list[Grad | None]:
        """Each output's sum in key order; the buffer is spent afterwards."""
        assert not any(self._early), "a contribution arrived that was not expected"
        sums, self._sums = self._sums, []
        return sums
