"""Linear algebra: matmul with exactly numpy's semantics, dot and outer, and transpose.

A 1-D operand of matmul is promoted to a matrix (a row on the left, a column on the
right) and the extra axis is dropped again from its gradient; batch axes that were
broadcast are summed away by ``Node.apply``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.ops.core import defop, implements, ndim_of, normalize_axes, normalize_axis
from pargrad.ops.elementwise import multiply
from pargrad.ops.shape import reshape
from pargrad.tensor import Tensor


def _matmul_lhs(g: Any, ans: Any, a: Any, b: Any) -> Any:
    if b.ndim == 1:
        g, b = np.expand_dims(g, -1), np.expand_dims(b, -1)
    if a.ndim == 1:
        g = np.expand_dims(g, -2)
    ga = g @ np.swapaxes(b, -1, -2)
    return np.squeeze(ga, -2) if a.ndim == 1 else ga


def _matmul_rhs(g: Any, ans: Any, a: Any, b: Any) -> Any:
    if b.ndim == 1:
        g = np.expand_dims(g, -1)
    if a.ndim == 1:
        g, a = np.expand_dims(g, -2), np.expand_dims(a, -2)
    gb = np.swapaxes(a, -1, -2) @ g
    return np.squeeze(gb, -1) if b.ndim == 1 else gb


# ----- products -----
matmul = defop("matmul", np.matmul, _matmul_lhs, _matmul_rhs, calls_blas=True,
               doc="Matrix product with numpy's semantics (1-D operands, batch broadcasting).")



@implements(np.dot)
def dot(a: Any, b: Any) -> Tensor:
    """``np.dot`` for operands of at most 2 dimensions: the inner product of two vectors,
    a matrix product (as ``matmul``), or a product with a scalar (as ``multiply``), with
    those ops' gradients. Raises ValueError for more dimensions (use ``matmul``)."""
    if ndim_of(a) == 0 or ndim_of(b) == 0:
        return multiply(a, b)
    if ndim_of(a) > 2 or ndim_of(b) > 2:
        raise ValueError(f"dot: operands of {ndim_of(a)} and {ndim_of(b)} dimensions; pargrad's "
                         f"dot takes at most 2 (use matmul for stacks of matrices)")
    return matmul(a, b)


@implements(np.outer)
def outer(a: Any, b: Any) -> Tensor:
    """``np.outer``: ``out[i, j] = a[i] * b[j]`` of the flattened operands; the gradient
    is multiply's (``ā = Σ_j g[i, j]·b[j]``)."""
    return multiply(reshape(a, (-1, 1)), reshape(b, (1, -1)))


# ----- axes -----
_transpose = defop("transpose", lambda x, *, axes: np.transpose(x, axes),
                   lambda g, ans, x, *, axes: np.transpose(g, tuple(np.argsort(axes))),
                   needs_values=False, view=True)


@implements(np.transpose)
def transpose(x: Any, axes: Any = None) -> Tensor:
    """Permute the axes (reverse them if ``axes`` is None). Gradient: ``g`` with the
    inverse permutation."""
    ndim = ndim_of(x)
    perm = tuple(range(ndim))[::-1] if axes is None else normalize_axes(axes, ndim, "transpose")
    if len(perm) != ndim:
        raise ValueError(f"transpose: axes {axes!r} are not a permutation of {ndim} axes")
    return _transpose(x, axes=perm)


@implements(np.swapaxes)
def swapaxes(x: Any, axis1: int, axis2: int) -> Tensor:
    """Interchange two axes. Gradient: ``g`` with the two axes swapped back."""
    ndim = ndim_of(x)
    a, b = normalize_axis(axis1, ndim, "swapaxes"), normalize_axis(axis2, ndim, "swapaxes")
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)
