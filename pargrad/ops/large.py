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

from typing import Any

import numpy as np

OUT_MIN = 1 << 14
"""Elements from which a rule writes into one buffer. Measured on tanh's rule here:
out= costs 1.14x the operator form at 100 elements, about the same at 1,000-4,000,
0.8x at 16,000 and 0.1-0.4x from 65,536 up (where every temporary is a fresh mapping)."""

_ndarray = np.ndarray


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
