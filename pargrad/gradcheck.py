"""Gradient checking: compare backward with central finite differences.

``gradcheck`` works on fresh leaf copies of the inputs, so it never touches the
caller's tensors or their ``.grad``. Finite differences are taken in float64 whatever
the inputs' dtype; analytical gradients are computed in the inputs' own dtype, so
float32 inputs need tolerances to match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pargrad.autograd import backward
from pargrad.engine.base import Engine
from pargrad.grad_mode import no_grad
from pargrad.tensor import Tensor


class GradcheckError(RuntimeError):
    """Backward disagrees with finite differences; the message says where and by how much."""


def gradcheck(
    fn: Callable[..., Any],
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    full_jacobian_limit: int = 4096,
    directions: int = 8,
    seed: int = 0,
    engine: Engine | None = None,
) -> bool:
    """Check ``fn``'s gradients at ``inputs`` against central differences; return True.

    ``inputs`` is a Tensor or a sequence; Tensors that require grad are checked, other
    values are passed through. ``fn`` returns a Tensor or a tuple of Tensors. When the
    Jacobian has at most ``full_jacobian_limit`` entries every entry is compared;
    otherwise each input is checked along ``directions`` random directions (u, v),
    comparing u . J v. An entry passes if ``|analytical - numerical| <= atol + rtol *
    |numerical|``. Raises ``GradcheckError`` naming the input, the index and both values.

    >>> import pargrad
    >>> x = pargrad.tensor([0.5, 1.5], requires_grad=True)
    >>> pargrad.gradcheck(lambda t: (t.sin() * t).sum(), x)
    True
    """
    args = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    checked = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
    leaves = [Tensor(a.data, requires_grad=True) if i in checked else a
              for i, a in enumerate(args)]
    outputs = _outputs(fn(*leaves))
    out_size = sum(o.size for o in outputs)
    rng = np.random.default_rng(seed)
    for i in checked:
        size = args[i].size
        if size == 0 or out_size == 0:
            continue
        if size * out_size <= full_jacobian_limit:
            _check_full(fn, leaves, outputs, i, eps, atol, rtol, engine)
        else:
            _check_directions(fn, leaves, outputs, i, eps, atol, rtol, engine, rng, directions)
    return True


def _outputs(result: Any) -> list[Tensor]:
    outs = list(result) if isinstance(result, (list, tuple)) else [result]
    for o in outs:
        if not isinstance(o, Tensor):
            raise TypeError(f"gradcheck: fn must return Tensors, got {type(o).__name__}")
    return outs


def _vjp(outputs: list[Tensor], cotangents: list[np.ndarray], leaf: Tensor,
         engine: Engine | None) -> np.ndarray:
    """d(sum(cotangent * output))/d(leaf) by backward, without leaving .grad set."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    leaf.grad = None
    if pairs:
        backward([o for o, _ in pairs], [c.astype(o.dtype) for o, c in pairs],
                 retain_graph=True, engine=engine)
    grad = leaf.grad
    leaf.grad = None
    return np.zeros(leaf.shape) if grad is None else grad.data.astype(np.float64)


def _evaluate(fn: Callable[..., Any], leaves: list[Any], i: int, value: np.ndarray) -> np.ndarray:
    """fn's outputs, flattened to one float64 vector, with input i replaced by ``value``."""
    args = [Tensor(value) if j == i else (a.detach().astype(np.float64)
            if isinstance(a, Tensor) and np.issubdtype(a.dtype, np.floating) else a)
            for j, a in enumerate(leaves)]
    with no_grad():
        outs = _outputs(fn(*args))
    return np.concatenate([np.asarray(o.data, dtype=np.float64).ravel() for o in outs])


def _numerical_column(fn: Callable[..., Any], leaves: list[Any], i: int,
                      direction: np.ndarray, eps: float) -> np.ndarray:
    x = leaves[i].data.astype(np.float64)
    plus = _evaluate(fn, leaves, i, x + eps * direction)
    minus = _evaluate(fn, leaves, i, x - eps * direction)
    return (plus - minus) / (2 * eps)


def _fail(i: int, where: str, analytical: float, numerical: float) -> GradcheckError:
    return GradcheckError(
        f"gradcheck: gradient of input {i} at {where}: backward gives {analytical!r}, "
        f"finite differences give {numerical!r}"
    )


def _check_full(fn: Callable[..., Any], leaves: list[Any], outputs: list[Tensor], i: int,
                eps: float, atol: float, rtol: float, engine: Engine | None) -> None:
    leaf = leaves[i]
    sizes = [o.size for o in outputs]
    out_total = sum(sizes)
    numerical = np.empty((leaf.size, out_total))
    for k in range(leaf.size):
        direction = np.zeros(leaf.size)
        direction[k] = 1.0
        numerical[k] = _numerical_column(fn, leaves, i, direction.reshape(leaf.shape), eps)
    for j in range(out_total):
        onehot = np.zeros(out_total)
        onehot[j] = 1.0
        cotangents = [c.reshape(o.shape) for c, o in
                      zip(np.split(onehot, np.cumsum(sizes)[:-1]), outputs)]
        analytical = _vjp(outputs, cotangents, leaf, engine).ravel()
        bad = np.abs(analytical - numerical[:, j]) > atol + rtol * np.abs(numerical[:, j])
        if bad.any():
            k = int(np.argmax(bad))
            index = tuple(int(n) for n in np.unravel_index(k, leaf.shape))
            where = f"index {index} for output element {j}"
            raise _fail(i, where, float(analytical[k]), float(numerical[k, j]))


def _check_directions(fn: Callable[..., Any], leaves: list[Any], outputs: list[Tensor],
                      i: int, eps: float, atol: float, rtol: float, engine: Engine | None,
                      rng: np.random.Generator, directions: int) -> None:
    leaf = leaves[i]
    for d in range(directions):
        v = rng.standard_normal(leaf.shape)
        us = [rng.standard_normal(o.shape) for o in outputs]
        analytical = float(np.sum(_vjp(outputs, us, leaf, engine) * v))
        column = _numerical_column(fn, leaves, i, v, eps)
        numerical = float(np.dot(np.concatenate([u.ravel() for u in us]), column))
        if abs(analytical - numerical) > atol + rtol * abs(numerical):
            raise _fail(i, f"random direction {d} (u . J v)", analytical, numerical)


