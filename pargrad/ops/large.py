"""When a gradient rule writes into one fresh buffer instead of a temporary per operator.

A rule written with operators (``g * (1 - ans * ans)``) allocates one array per
operator; on large arrays each is a fresh mapping whose pages fault in on first touch,
and that, not the arithmetic, is most of the rule's time. So above ``OUT_MIN`` elements
the rules of the elementwise ops, softmax, log_softmax and the reductions allocate one
fresh array (their result) and do every step in it with numpy's ``out=``. They never
write into an array they did not allocate: the incoming gradient may be the caller's
``grad_output``, a retained or hooked gradient, or a ``.grad``. A new buffer per call
(none kept by a node) keeps ``retain_graph``'s second backward from overwriting the
first one's result.

Below ``OUT_MIN`` the operator form is cheaper (each ``out=`` step is one more Python
call) and runs unchanged. With ``create_graph`` the rules get Tensors and take the
operator form too (numpy cannot write into a Tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pargrad import memory

OUT_MIN = 1 << 14
"""Elements from which a rule writes into one buffer. Measured on tanh's rule here:
out= costs 1.14x the operator form at 100 elements, about the same at 1,000-4,000,
0.8x at 16,000 and 0.1-0.4x from 65,536 up (where every temporary is a fresh mapping)."""

_ndarray = np.ndarray
_SCALARS = (float, int)


def plain(*arrays: Any) -> bool:
    """Whether every one of ``arrays`` is a plain array (not a Tensor recording a graph).

    A rule takes its one-buffer form where ``g.size >= large.OUT_MIN and
    large.plain(g, ...)``: the size first, as it is all that small arrays pay for
    (an attribute and a comparison; a call to this function would cost more).
    """
    return all(type(array) is _ndarray for array in arrays)


def uniform(g: np.ndarray) -> Any:
    """The one value of ``g`` (a numpy scalar) where ``g`` is a broadcast of it (every
    stride 0, as ``sum``'s rule returns its gradient), else None.

    A rule can then fold that value in as a scalar instead of reading an array: every
    element gets the same arithmetic on the same numbers, so the same bits.
    """
    if g.size == 0 or any(g.strides):
        return None
    return g[(0,) * g.ndim]


def scalar(value: Any) -> bool:
    """Whether ``value`` is a number or a 0-d array (a rule may fold it as a scalar)."""
    return type(value) in (float, int) or (
        isinstance(value, (_ndarray, np.generic)) and value.ndim == 0)


def times_into(g: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``g * out`` written into ``out`` (a buffer the rule made); ``out`` as it is where
    ``g`` is a broadcast of 1 of ``out``'s real dtype (a loss's ``sum``): ``v * 1`` is
    ``v`` exactly (NaNs and signed zeros included; not so for complex numbers), so one
    pass fewer, the same bits."""
    if (g.dtype == out.dtype and out.dtype.kind == "f" and (value := uniform(g)) is not None
            and value == 1):
        return out
    return np.multiply(g, out, out=out)


def fresh(ufunc: Callable[..., Any], *args: Any) -> Any:
    """``ufunc(*args)`` into a new array from pargrad's pool (pargrad/memory.py): its
    memory comes back to the pool once nothing can see it, instead of being given back
    to the system and faulted in again. The same bits as ``ufunc(*args)``. Where the
    arguments are not plain arrays of one real floating dtype in native byte order (with
    Python numbers and boolean masks beside them), the plain call: numpy allocates."""
    found = _result(args)
    if found is None:
        return ufunc(*args)
    return ufunc(*args, out=memory.empty(*found))


def _result(args: tuple[Any, ...]) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """The shape and dtype of a ufunc's result on ``args``, where ``fresh`` can tell."""
    shapes = []
    dtypes = set()
    for a in args:
        if type(a) is _ndarray:
            shapes.append(a.shape)
            if a.dtype.kind != "b":  # a mask leaves the result's dtype as it is
                dtypes.add(a.dtype)
        elif isinstance(a, np.generic):  # a numpy scalar: its dtype counts (NEP 50)
            dtypes.add(a.dtype)
        elif type(a) not in _SCALARS:
            return None
    if len(dtypes) != 1 or (dtype := dtypes.pop()).kind != "f" or not dtype.isnative:
        return None  # (complex: abs gives a real result; a swapped byte order: native)
    if len(set(shapes)) == 1:
        return shapes[0], dtype
    try:
        return np.broadcast_shapes(*shapes), dtype
    except ValueError:
        return None  # numpy's own call raises the error


# The one-operator rules (``g * ans``, ``g / x``, ``-g``): the same operator, into a buffer
# of the pool on large plain arrays (where numpy's own would be a fresh mapping).
def times(a: Any, b: Any) -> Any:
    """``a * b``."""
    if type(a) is _ndarray and a.size >= OUT_MIN:
        return fresh(np.multiply, a, b)
    return a * b


def over(a: Any, b: Any) -> Any:
    """``a / b``."""
    if type(a) is _ndarray and a.size >= OUT_MIN:
        return fresh(np.divide, a, b)
    return a / b


def neg(a: Any) -> Any:
    """``-a``."""
    if type(a) is _ndarray and a.size >= OUT_MIN:
        return fresh(np.negative, a)
    return -a


def mask(ufunc: Callable[..., Any], *args: Any) -> Any:
    """``ufunc(*args)`` (a comparison: a boolean array), into a buffer of the pool
    where the result is large."""
    x = args[0]
    if type(x) is _ndarray and x.size >= OUT_MIN:
        return ufunc(*args, out=memory.empty(x.shape, np.bool_))
    return ufunc(*args)
