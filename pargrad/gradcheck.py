"""Gradient checking: compare backward with central finite differences.

``gradcheck`` checks first derivatives; ``gradgradcheck`` checks second derivatives: the
gradient that a ``create_graph=True`` backward records is itself checked by
``gradcheck``, against finite differences of first-order backward calls (as
``torch.autograd.gradgradcheck`` does).

Both work on fresh leaf copies of the inputs and take gradients with ``pargrad.grad``,
so they never touch the caller's tensors or any ``.grad``. Finite differences
are taken in float64 whatever the inputs' dtype; analytical gradients are computed in
the inputs' own dtype, so float32 inputs need tolerances to match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pargrad.autograd import _fn_outputs, _requires_grad, _vjp
from pargrad.engine.base import Engine
from pargrad.grad_mode import enable_grad, no_grad
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
    args = _as_list(inputs)
    check = _Check("gradcheck", "backward", fn, args, eps, atol, rtol, engine,
                   full="gradient of {input} at index {index} for {output}",
                   directional="gradient of {input} at random direction {d} (u . J v)")
    check.run(full_jacobian_limit, directions, seed)
    return True


def gradgradcheck(
    fn: Callable[..., Any],
    inputs: Any,
    grad_outputs: Any = None,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    full_jacobian_limit: int = 4096,
    directions: int = 8,
    seed: int = 0,
    engine: Engine | None = None,
) -> bool:
    """Check ``fn``'s second derivatives at ``inputs`` against finite differences.

    The function checked is the vector-Jacobian product ``(x, u) -> d(u . fn(x))/dx``
    for the inputs ``x`` that require grad, computed by a ``create_graph=True`` backward:
    ``gradcheck`` compares the backward through that recorded graph (double backward)
    with central differences of first-order backward calls. ``grad_outputs`` gives
    ``u``, one per output of ``fn`` (a Tensor or a sequence); by default they are
    random (from ``seed``) and require grad, so the check covers the derivative in
    ``u`` too. Arguments are those of ``gradcheck``; raises ``GradcheckError`` naming
    the gradient entry and the input entry whose derivative disagrees.

    >>> import pargrad
    >>> x = pargrad.tensor([0.5, 1.5], requires_grad=True)
    >>> pargrad.gradgradcheck(lambda t: (t.sin() * t).sum(), x)
    True
    """
    args = _as_list(inputs)
    wrt = [i for i, a in enumerate(args) if _requires_grad(a)]
    outputs = _outputs(fn(*_fresh_leaves(args)), "gradgradcheck")  # their shapes and dtypes
    rng = np.random.default_rng(seed)
    if grad_outputs is None:
        us: list[Any] = [Tensor(rng.standard_normal(o.shape), dtype=o.dtype,
                                requires_grad=o.dtype.kind == "f") for o in outputs]
    else:
        us = _as_list(grad_outputs)
        if len(us) != len(outputs):
            raise ValueError(f"gradgradcheck: got {len(us)} grad_outputs for {len(outputs)} "
                             f"outputs of fn")
    n = len(args)
    shapes = [args[i].shape for i in wrt]

    def first_derivatives(*values: Any) -> tuple[Tensor, ...]:
        return _first_derivatives(fn, list(values[:n]), list(values[n:]), wrt, engine)

    def input_name(i: int) -> str:
        return f"input {i}" if i < n else f"grad_outputs[{i - n}]"

    def output_name(j: int) -> str:
        for k, shape in zip(wrt, shapes):
            size = int(np.prod(shape))
            if j < size:
                index = tuple(int(m) for m in np.unravel_index(j, shape))
                return f"the gradient of input {k} at index {index}"
            j -= size
        raise AssertionError("output element out of range")

    check = _Check("gradgradcheck", "double backward", first_derivatives, [*args, *us], eps,
                   atol, rtol, engine, input_name=input_name, output_name=output_name,
                   full="derivative of {output} with respect to {input} at index {index}",
                   directional="derivative of the gradients with respect to {input} along "
                               "random direction {d} (u . J v)")
    check.run(full_jacobian_limit, directions, seed)
    return True


def _first_derivatives(fn: Callable[..., Any], xs: list[Any], us: list[Any], wrt: list[int],
                       engine: Engine | None) -> tuple[Tensor, ...]:
    """d(u . fn(x))/dx for the inputs ``wrt``, recorded so that it can be differentiated.

    Called by ``gradcheck`` both with leaves that require grad (its analytical pass: the
    result then depends on them) and with plain Tensors under no_grad (its finite
    differences: they become leaves here, to take the first derivative).
    """
    with enable_grad():
        xs = [Tensor(x.data, requires_grad=True, device=x.device)
              if i in wrt and not x.requires_grad else x for i, x in enumerate(xs)]
        outputs = _outputs(fn(*xs), "gradgradcheck")
        leaves = [xs[i] for i in wrt]
        grads = _vjp(outputs, us, leaves, create_graph=True, retain_graph=True, engine=engine)
    return tuple(Tensor(np.zeros(x.shape, x.dtype)) if g is None else g
                 for g, x in zip(grads, leaves))


def _as_list(inputs: Any) -> list[Any]:
    return list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]


def _fresh_leaves(args: list[Any]) -> list[Any]:
    """New leaves (same data and device) for the arguments that require grad."""
    return [Tensor(a.data, requires_grad=True, device=a.device) if _requires_grad(a) else a
            for a in args]


def _outputs(result: Any, name: str = "gradcheck") -> list[Tensor]:
    return _fn_outputs(result, name, (list, tuple))


class _Check:
    """One check of ``fn``'s backward at ``args`` against finite differences.

    ``name`` and ``analytical`` (what computed the analytical value) start the messages;
    ``full`` and ``directional`` say where a check failed, from ``input_name(i)`` (the
    name of argument i), the index, ``output_name(j)`` (the j-th element of the flattened
    outputs) and the direction ``d``.
    """

    def __init__(self, name: str, analytical: str, fn: Callable[..., Any], args: list[Any],
                 eps: float, atol: float, rtol: float, engine: Engine | None, *, full: str,
                 directional: str, input_name: Callable[[int], str] = lambda i: f"input {i}",
                 output_name: Callable[[int], str] = lambda j: f"output element {j}") -> None:
        self.name, self.analytical = name, analytical
        self.fn, self.eps, self.atol, self.rtol, self.engine = fn, eps, atol, rtol, engine
        self.full, self.directional = full, directional
        self.input_name, self.output_name = input_name, output_name
        self.checked = [i for i, a in enumerate(args) if _requires_grad(a)]
        self.leaves = _fresh_leaves(args)
        self.outputs = _outputs(fn(*self.leaves), name)

    def run(self, full_jacobian_limit: int, directions: int, seed: int) -> None:
        out_size = sum(o.size for o in self.outputs)
        rng = np.random.default_rng(seed)
        for i in self.checked:
            size = self.leaves[i].size
            if size == 0 or out_size == 0:
                continue
            if size * out_size <= full_jacobian_limit:
                self._check_full(i)
            else:
                self._check_directions(i, rng, directions)

    def _vjp(self, cotangents: list[np.ndarray], i: int) -> np.ndarray:
        leaf = self.leaves[i]
        (grad,) = _vjp(self.outputs, cotangents, [leaf], create_graph=False,
                       retain_graph=True, engine=self.engine)
        return np.zeros(leaf.shape) if grad is None else np.asarray(grad, dtype=np.float64)

    def _evaluate(self, i: int, value: np.ndarray) -> np.ndarray:
        """fn's outputs, flattened to one float64 vector, with input i replaced by ``value``."""
        args = [Tensor(value) if j == i else (a.detach().astype(np.float64)
                if isinstance(a, Tensor) and np.issubdtype(a.dtype, np.floating) else a)
                for j, a in enumerate(self.leaves)]
        with no_grad():
            outs = _outputs(self.fn(*args), self.name)
        return np.concatenate([np.asarray(o.data, dtype=np.float64).ravel() for o in outs])

    def _numerical_column(self, i: int, direction: np.ndarray) -> np.ndarray:
        x = self.leaves[i].data.astype(np.float64)
        plus = self._evaluate(i, x + self.eps * direction)
        minus = self._evaluate(i, x - self.eps * direction)
        return (plus - minus) / (2 * self.eps)

    def _fail(self, what: str, analytical: float, numerical: float) -> GradcheckError:
        return GradcheckError(
            f"{self.name}: {what}: {self.analytical} gives {analytical!r}, finite differences "
            f"give {numerical!r}"
        )

    def _check_full(self, i: int) -> None:
        leaf = self.leaves[i]
        sizes = [o.size for o in self.outputs]
        out_total = sum(sizes)
        numerical = np.empty((leaf.size, out_total))
        for k in range(leaf.size):
            direction = np.zeros(leaf.size)
            direction[k] = 1.0
            numerical[k] = self._numerical_column(i, direction.reshape(leaf.shape))
        for j in range(out_total):
            onehot = np.zeros(out_total)
            onehot[j] = 1.0
            cotangents = [c.reshape(o.shape) for c, o in
                          zip(np.split(onehot, np.cumsum(sizes)[:-1]), self.outputs)]
            analytical = self._vjp(cotangents, i).ravel()
            bad = np.abs(analytical - numerical[:, j]) > self.atol + self.rtol * np.abs(
                numerical[:, j])
            if bad.any():
                k = int(np.argmax(bad))
                index = tuple(int(n) for n in np.unravel_index(k, leaf.shape))
                what = self.full.format(input=self.input_name(i), index=index,
                                        output=self.output_name(j))
                raise self._fail(what, float(analytical[k]), float(numerical[k, j]))

    def _check_directions(self, i: int, rng: np.random.Generator, directions: int) -> None:
        leaf = self.leaves[i]
        for d in range(directions):
            v = rng.standard_normal(leaf.shape)
            us = [rng.standard_normal(o.shape) for o in self.outputs]
            analytical = float(np.sum(self._vjp(us, i) * v))
            column = self._numerical_column(i, v)
            numerical = float(np.dot(np.concatenate([u.ravel() for u in us]), column))
            if abs(analytical - numerical) > self.atol + self.rtol * abs(numerical):
                what = self.directional.format(input=self.input_name(i), d=d)
                raise self._fail(what, analytical, numerical)
