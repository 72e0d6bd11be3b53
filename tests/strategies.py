"""Hypothesis strategies for shapes and arrays used across the test suite."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

FLOATS = [np.float64, np.float32]
T = TypeVar("T")

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
    a = _uniform(draw(st.integers(0, 2**32 - 1)), shape, np.float64, low, high)
    if away_from is not None:
        close = np.abs(a - away_from) < margin
        a = np.where(close, away_from + np.where(a >= away_from, margin, -margin) * 2, a)
    return a.astype(dtype)


def _uniform(seed: int, shape: tuple[int, ...], dtype: type, low: float,
             high: float) -> np.ndarray:
    """Uniform values in [low, high] from numpy's generator seeded with ``seed``."""
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(dtype)


def distinct(draw: st.DrawFn, shape: tuple[int, ...], low: float = -2.0,
             high: float = 2.0) -> np.ndarray:
    """Values at least 0.05 apart from each other (no ties within a finite difference)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    grid = np.linspace(low, high, max(n, 1) * 2)
    return rng.permutation(grid)[:n].reshape(shape)


# ----- random graphs -----
# A GraphRecipe is a random DAG described as data, so that the same graph can be built
# again on fresh leaves (for finite differences, or to run it on another engine).


class Pair:
    """A custom Function with two outputs, ``(sin x, x * cos x)``, built lazily to keep
    this module importable without pargrad's Function machinery at collection time."""

    fn: Any = None

    @classmethod
    def apply(cls, x: Any) -> Any:
        if cls.fn is None:
            import pargrad

            class _Pair(pargrad.Function):
                @staticmethod
                def forward(ctx: Any, t: Any) -> tuple[np.ndarray, np.ndarray]:
                    ctx.save_for_backward(t)
                    return np.sin(t.data), t.data * np.cos(t.data)

                @staticmethod
                def backward(ctx: Any, g_sin: Any, g_xcos: Any) -> Any:
                    (t,) = ctx.saved_tensors
                    return g_sin * np.cos(t) + g_xcos * (np.cos(t) - t * np.sin(t))

            cls.fn = _Pair
        return cls.fn.apply(x)


UNARY_STEPS = ["tanh", "sin", "sigmoid", "scale", "square"]
BINARY_STEPS = ["add", "sub", "mul", "matmul", "rowsum_add", "split_col_mul"]
MULTI_STEPS = ["pair_first", "pair_second", "pair_both"]


@dataclass(frozen=True)
class GraphRecipe:
    """Leaves, steps over earlier values, and roots with their gradients."""

    n: int
    leaves: tuple[np.ndarray, ...]
    requires_grad: tuple[bool, ...]
    steps: tuple[tuple[Any, ...], ...]
    roots: tuple[int, ...]
    root_grads: tuple[np.ndarray, ...]

    def build(self, leaves: Sequence[Any], devices: Sequence[str] | None = None) -> list[Any]:
        """Run the steps on ``leaves`` (Tensors) and return the root tensors.

        With ``devices`` (one device name per step), each step runs on its device: its
        operands are moved there first with ``Tensor.to`` (a differentiable copy).
        """
        import pargrad

        values = list(leaves)
        for k, step in enumerate(self.steps):
            kind, i = step[0], step[1]
            on = "cpu" if devices is None else devices[k]
            a = values[i].to(on)
            if kind == "tanh":
                out = pargrad.tanh(a)
            elif kind == "sin":
                out = pargrad.sin(a)
            elif kind == "sigmoid":
                out = pargrad.sigmoid(a)
            elif kind == "scale":
                out = a * step[2] + pargrad.tensor(step[2], device=on)  # constant: no grad
            elif kind == "square":
                out = a * a * 0.5
            elif kind.startswith("pair"):
                first, second = Pair.apply(a)
                out = {"pair_first": first, "pair_second": second,
                       "pair_both": first * second}[kind]
            else:
                b = values[step[2]].to(on)
                if kind == "add":
                    out = a + b
                elif kind == "sub":
                    out = a - b
                elif kind == "mul":
                    out = a * b
                elif kind == "matmul":
                    out = (pargrad.broadcast_to(a, (self.n, self.n))
                           @ pargrad.broadcast_to(b, (self.n, self.n))) * 0.5
                elif kind == "rowsum_add":
                    out = pargrad.broadcast_to(a, (self.n, self.n)).sum(axis=1, keepdims=True) + b
                else:  # split_col_mul: a node with n outputs, only one of them used
                    columns = pargrad.split(pargrad.broadcast_to(a, (self.n, self.n)), self.n,
                                            axis=1)
                    out = columns[step[3]] * b
            values.append(out)
        return [values[r] for r in self.roots]

    def loss(self, leaf_arrays: Sequence[np.ndarray]) -> float:
        """sum_r <root_grad_r, root_r> in float64, without recording: for finite differences."""
        import pargrad

        with pargrad.no_grad():
            roots = self.build([pargrad.tensor(a, dtype=np.float64) for a in leaf_arrays])
        return float(sum(np.sum(g * r.data) for g, r in zip(self.root_grads, roots)))


class Choices(Protocol):
    """Where a recipe's random choices come from (``make_recipe``)."""

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        ...

    def sample(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        ...

    def boolean(self) -> bool:
        ...

    def samples(self, options: Sequence[T], low: int, high: int) -> list[T]:
        """Between ``low`` and ``high`` of ``options``, repeats allowed."""
        ...


class _Drawn:
    """Choices drawn by hypothesis (``graph_recipes``): each one a draw, so they shrink."""

    def __init__(self, draw: st.DrawFn) -> None:
        self._draw = draw

    def integer(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))

    def sample(self, options: Sequence[T]) -> T:
        return self._draw(st.sampled_from(options))

    def boolean(self) -> bool:
        return self._draw(st.booleans())

    def samples(self, options: Sequence[T], low: int, high: int) -> list[T]:
        return self._draw(st.lists(st.sampled_from(options), min_size=low, max_size=high))


class SeededChoices:
    """Choices from numpy's generator seeded with ``seed``: the same recipe for a seed
    whatever the hypothesis version and whatever modules are loaded (hypothesis mixes
    literal constants of the loaded modules into its draws, derandomized or not), with
    one numpy version (numpy keeps a seed's stream stable in practice, but does not
    promise it). The benchmarks' random DAGs use it."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def integer(self, low: int, high: int) -> int:
        return int(self._rng.integers(low, high, endpoint=True))

    def sample(self, options: Sequence[T]) -> T:
        return options[int(self._rng.integers(len(options)))]

    def boolean(self) -> bool:
        return bool(self._rng.integers(2))

    def samples(self, options: Sequence[T], low: int, high: int) -> list[T]:
        return [self.sample(options) for _ in range(self.integer(low, high))]


@st.composite
def graph_recipes(draw: st.DrawFn, max_steps: int = 12,
                  dtypes: Sequence[type] = (np.float64,)) -> GraphRecipe:
    """A random DAG (``make_recipe``), drawn by hypothesis."""
    return make_recipe(_Drawn(draw), max_steps, dtypes)


def make_recipe(choose: Choices, max_steps: int = 12,
                dtypes: Sequence[type] = (np.float64,),
                kinds: Sequence[str] = UNARY_STEPS + BINARY_STEPS + MULTI_STEPS) -> GraphRecipe:
    """A random DAG: fan-out, fan-in, diamonds, multi-output nodes with unused outputs,
    leaves that need no grad, broadcasting, shared leaves and several roots. ``kinds``:
    the steps to draw from (without ``MULTI_STEPS``: no custom Function)."""
    n = choose.integer(1, 3)
    leaf_shapes = [(n, n), (n,), (1, n), (n, 1), ()]
    n_leaves = choose.integer(1, 4)
    leaves, flags = [], []
    for k in range(n_leaves):
        shape = choose.sample(leaf_shapes)
        dtype = choose.sample(list(dtypes))
        leaves.append(_uniform(choose.integer(0, 2**32 - 1), shape, dtype, -1.5, 1.5))
        flags.append(k == 0 or choose.boolean())
    shapes = [a.shape for a in leaves]
    needs = list(flags)
    steps = []
    for _ in range(choose.integer(1, max_steps)):
        kind = choose.sample(kinds)
        # Counted from the newest value, so that shrinking leans to deep graphs.
        i = len(shapes) - 1 - choose.integer(0, len(shapes) - 1)
        if kind in UNARY_STEPS or kind in MULTI_STEPS:
            step: tuple[Any, ...] = (kind, i, 0.5 + choose.integer(0, 3) / 2)
            shape = shapes[i]
            need = needs[i]
        else:
            j = choose.integer(0, len(shapes) - 1)
            if kind == "split_col_mul":
                step = (kind, i, j, choose.integer(0, n - 1))
                shape = np.broadcast_shapes((n, 1), shapes[j])
            elif kind in ("matmul",):
                step, shape = (kind, i, j), (n, n)
            elif kind == "rowsum_add":
                step, shape = (kind, i, j), np.broadcast_shapes((n, 1), shapes[j])
            else:
                step, shape = (kind, i, j), np.broadcast_shapes(shapes[i], shapes[j])
            need = needs[i] or needs[j]
        steps.append(step)
        shapes.append(shape)
        needs.append(need)
    candidates = [k for k in range(n_leaves, len(shapes)) if needs[k]] or [0]
    roots = choose.samples(candidates, 1, 3)
    root_grads = tuple(_uniform(choose.integer(0, 2**32 - 1), shapes[r], np.float64, -2.0, 2.0)
                       for r in roots)
    return GraphRecipe(n, tuple(leaves), tuple(flags), tuple(steps), tuple(roots), root_grads)


# ----- random steps for pargrad.capture -----
# A StepRecipe is a random training step described as data: a function of its arguments
# (a batch ``x``, integer ``labels``, a row order ``rows``) and of outside tensors
# (weights it closes over), built from ops of every family capture records: elementwise
# ops and broadcasting, matmul, reductions, views and indexing by an argument, ops of
# several outputs, comparisons (masks), random draws (dropout), losses on integer labels.

STEP_UNARY = ["tanh", "sin", "sigmoid", "relu", "square", "abs", "softplus", "exp_clip",
              "log1p_square", "scale"]
STEP_OTHER = ["add_weight", "mul_weight", "div_weight", "fan_weight", "matmul", "add", "mul",
              "sub", "fan", "center", "max_scale", "logsumexp", "softmax", "log_softmax",
              "cumsum", "where", "dropout", "reshape", "transpose", "rows", "split", "stack"]


@dataclass(frozen=True)
class StepRecipe:
    """A random step over values of shape ``(batch, n)`` (every step keeps that shape)."""

    batch: int
    n: int
    weights: tuple[tuple[tuple[int, ...], bool], ...]  # per weight: shape, requires_grad
    x_requires_grad: bool
    steps: tuple[tuple[Any, ...], ...]  # (kind, value index, other index or weight, ...)
    loss_values: tuple[int, ...]  # the values summed into the loss
    with_labels: bool  # the loss also takes cross_entropy(last value, labels)
    returns_value: int | None  # a value returned beside the loss (None: the loss alone)

    def weight_arrays(self, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [rng.uniform(-1.0, 1.0, shape) for shape, _ in self.weights]

    def arguments(self, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``x``, ``labels`` and ``rows`` for one call."""
        rng = np.random.default_rng(seed)
        return (rng.uniform(-1.5, 1.5, (self.batch, self.n)),
                rng.integers(0, self.n, self.batch), rng.permutation(self.batch))

    def run(self, x: Any, labels: Any, rows: Any, weights: Sequence[Any]) -> Any:
        """The step: its loss, or ``(loss, value)``."""
        import pargrad

        values = [x]
        for step in self.steps:
            kind, a = step[0], values[step[1]]
            if kind == "tanh":
                out = pargrad.tanh(a)
            elif kind == "sin":
                out = pargrad.sin(a)
            elif kind == "sigmoid":
                out = pargrad.sigmoid(a)
            elif kind == "relu":
                out = pargrad.relu(a)
            elif kind == "square":
                out = pargrad.square(a)
            elif kind == "abs":
                out = pargrad.abs(a)
            elif kind == "softplus":
                out = pargrad.softplus(a)
            elif kind == "exp_clip":
                out = pargrad.exp(pargrad.clip(a, -3.0, 3.0))
            elif kind == "log1p_square":
                out = pargrad.log1p(a * a)
            elif kind == "scale":
                out = a * step[2] + 0.25
            elif kind == "add_weight":
                out = a + weights[step[2]]
            elif kind == "mul_weight":
                out = a * weights[step[2]]
            elif kind == "div_weight":
                out = a / (weights[step[2]] * weights[step[2]] + 1.0)
            elif kind == "fan_weight":  # a weight's gradient summed from four uses
                w = weights[step[2]]
                out = a * w + w * 0.5 + pargrad.tanh(w) * a
            elif kind == "fan":  # a value's gradient summed from four uses
                out = a * 0.5 + a * a + pargrad.sin(a)
            elif kind == "matmul":
                out = a @ weights[step[2]]
            elif kind in ("add", "mul", "sub"):
                b = values[step[2]]
                out = a + b if kind == "add" else a * b if kind == "mul" else a - b
            elif kind == "center":
                out = a - a.mean(axis=1, keepdims=True)
            elif kind == "max_scale":
                out = a * pargrad.max(a, axis=1, keepdims=True)
            elif kind == "logsumexp":
                out = a - pargrad.logsumexp(a, axis=1, keepdims=True)
            elif kind == "softmax":
                out = pargrad.softmax(a, axis=-1)
            elif kind == "log_softmax":
                out = pargrad.log_softmax(a, axis=-1)
            elif kind == "cumsum":
                out = pargrad.cumsum(a, axis=1)
            elif kind == "where":
                out = pargrad.where(a > 0, a, values[step[2]] * 0.5)
            elif kind == "dropout":
                out = pargrad.nn.functional.dropout(a, 0.4)
            elif kind == "reshape":
                out = a.reshape(-1).reshape(self.batch, self.n) * 1.5
            elif kind == "transpose":
                out = a.T.T + a.T.T
            elif kind == "rows":
                out = a[rows]
            elif kind == "split":
                parts = pargrad.split(pargrad.concatenate([a, values[step[2]]], axis=1), 2,
                                      axis=1)
                out = parts[step[3]]
            else:  # stack
                out = pargrad.stack([a, values[step[2]]]).sum(axis=0)
            values.append(out)
        loss = pargrad.sum(values[self.loss_values[0]])
        for i in self.loss_values[1:]:
            loss = loss + pargrad.mean(values[i])
        if self.with_labels:
            loss = loss + pargrad.cross_entropy(values[-1], labels)
        if self.returns_value is None:
            return loss
        return loss, values[self.returns_value]


@st.composite
def step_recipes(draw: st.DrawFn, max_steps: int = 8) -> StepRecipe:
    """A random ``StepRecipe``."""
    batch = draw(st.integers(1, 3))
    n = draw(st.integers(2, 3))
    weights = []
    for _ in range(draw(st.integers(1, 3))):
        shape = draw(st.sampled_from([(n, n), (n,), (1, n)]))
        weights.append((shape, draw(st.booleans()) or not weights))
    steps: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, max_steps))):
        kind = draw(st.sampled_from(STEP_UNARY + STEP_OTHER))
        i = len(steps) - draw(st.integers(0, len(steps)))  # newest first, when shrunk
        j = draw(st.integers(0, len(steps)))
        if kind == "scale":
            steps.append((kind, i, draw(st.sampled_from([0.5, -1.25, 2.0]))))
        elif kind == "matmul":
            squares = [w for w, (shape, _) in enumerate(weights) if shape == (n, n)]
            if not squares:
                weights.append(((n, n), draw(st.booleans())))
                squares = [len(weights) - 1]
            steps.append((kind, i, draw(st.sampled_from(squares))))
        elif kind.endswith("_weight"):  # broadcast along the batch
            rows = [w for w, (shape, _) in enumerate(weights) if shape != (n, n)]
            if not rows:
                weights.append(((n,), draw(st.booleans())))
                rows = [len(weights) - 1]
            steps.append((kind, i, draw(st.sampled_from(rows))))
        elif kind == "split":
            steps.append((kind, i, j, draw(st.integers(0, 1))))
        else:
            steps.append((kind, i, j))
    count = len(steps) + 1
    loss_values = tuple(draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=3)))
    returns = draw(st.one_of(st.none(), st.integers(0, count - 1)))
    return StepRecipe(batch, n, tuple(weights), draw(st.booleans()), tuple(steps), loss_values,
                      draw(st.booleans()), returns)
