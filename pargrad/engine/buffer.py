"""Gradient accumulation: the one place where gradients are added together.

``accumulate`` adds a gradient to a running sum. The first gradient is kept by
reference; the second makes a new array that the accumulator owns, and later ones are
added into that array in place. An array that a caller, a node or another edge can see
is therefore never written. Gradients that are Tensors (a backward recording its own
graph) are added out of place, by the differentiable ``add``.
"""

from __future__ import annotations

import numpy as np

from pargrad.graph import Grad


def accumulate(total: Grad | None, owned: bool, grad: Grad) -> tuple[Grad, bool]:
    """Return ``(total + grad, owned)``, writing into ``total`` only if ``owned`` says so."""
    if total is None:
        return grad, False
    if not (isinstance(total, np.ndarray) and isinstance(grad, np.ndarray)):
        return total + grad, False
    if owned:
        np.add(total, grad, out=total)
        return total, True
    return np.asarray(np.add(total, grad)), True


class InputBuffer:
    """The gradients gathered so far for one node: one running sum per output.

    Gradients are summed in the order they are accumulated. Not thread-safe: an engine
    that shares a buffer between threads guards it with its own lock.
    """

    __slots__ = ("_owned", "_sums")

    def __init__(self, num_outputs: int) -> None:
        self._sums: list[Grad | None] = [None] * num_outputs
        self._owned = [False] * num_outputs

    def accumulate(self, output_nr: int, grad: Grad | None) -> None:
        """Add ``grad`` (ignored if None) to the sum for output ``output_nr``."""
        if grad is not None:
            self._sums[output_nr], self._owned[output_nr] = accumulate(
                self._sums[output_nr], self._owned[output_nr], grad
            )

    def take(self) -> list[Grad | None]:
        """Hand over the sums; the buffer must not be used afterwards."""
        sums, self._sums = self._sums, []
        return sums
