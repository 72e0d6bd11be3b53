"""Hypothesis strategies for shapes and arrays used across the test suite."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

FLOATS = [np.float64, np.float32]

# Small shapes keep finite differences cheap; size-0 and size-1 axes are included.
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
nonempty_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)


@st.composite
def broadcast_pair(draw: st.DrawFn, min_side: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast together (sides of 1, missing leading axes, size 0)."""
    shapes = draw(hnp.mutually_broadcastable_shapes(
        num_shapes=2, min_dims=0, max_dims=3, min_side=min_side, max_side=4))
    return shapes.input_shapes[0], shapes.input_shapes[1]


def values(draw: st.DrawFn, shape: tuple[int, ...], dtype: type = np.float64,
           low: float = -2.0, high: float = 2.0, away_from: float | None = None,
           margin: float = 0.2) -> np.ndarray:
    """An array of ``shape`` with values in [low, high], optionally kept ``margin`` away
    from one point (for ops that are not differentiable there)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    a = rng.uniform(low, high, size=shape)
    if away_from is not None:
        close = np.abs(a - away_from) < margin
        a = np.where(close, away_from + np.where(a >= away_from, margin, -margin) * 2, a)
    return a.astype(dtype)


def distinct(draw: st.DrawFn, shape: tuple[int, ...], low: float = -2.0,
             high: float = 2.0) -> np.ndarray:
    """Values at least 0.05 apart from each other (no ties within a finite difference)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    grid = np.linspace(low, high, max(n, 1) * 2)
    return rng.permutation(grid)[:n].reshape(shape)
