"""Shape ops: reshape, squeeze, expand_dims, broadcast_to, concatenate, stack, split,
indexing. Their rules move gradients back into the input's layout; indexing scatters
with ``np.add.at`` so that repeated indices accumulate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pargrad.numpy_names import numpy_names
from pargrad.ops.core import array_of, defop, implements, ndim_of, normalize_axis
from pargrad.replay import recorder
from pargrad.shapes import sum_to
from pargrad.tensor import Tensor

# Every rule here reads only shapes (needs_values=False): these nodes keep no arrays.
# Ops marked view=True may return views of their input's memory, as numpy's do.
# ----- reshaping -----
_reshape = defop("reshape", lambda x, *, shape: np.reshape(x, shape),
                 lambda g, ans, x, *, shape: np.reshape(g, x.shape), needs_values=False,
                 view=True)
_squeeze = defop("squeeze", lambda x, *, axis: np.squeeze(x, axis),
                 lambda g, ans, x, *, axis: np.reshape(g, x.shape), needs_values=False,
                 view=True)
_expand_dims = defop("expand_dims", lambda x, *, axis: np.expand_dims(x, axis),
                     lambda g, ans, x, *, axis: np.reshape(g, x.shape), needs_values=False,
                     view=True)
_broadcast_to = defop("broadcast_to", lambda x, *, shape: np.broadcast_to(x, shape),
                      lambda g, ans, x, *, shape: sum_to(g, x.shape), needs_values=False,
                      view=True)


def _ints(value: Any) -> tuple[int, ...]:
    """An int or a sequence of ints (numpy integers too) as a tuple of Python ints."""
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(int(v) for v in value)


@implements(np.reshape)
def reshape(x: Any, shape: Any) -> Tensor:
    """Give the data a new shape (one entry may be -1). Gradient: ``g`` reshaped back."""
    return _reshape(x, shape=_ints(shape))


@implements(np.squeeze)
@numpy_names
def squeeze(x: Any, axis: Any = None) -> Tensor:
    """Remove axes of length one (all of them if ``axis`` is None). Gradient: ``g``
    reshaped back."""
    return _squeeze(x, axis=None if axis is None else _ints(axis))


@implements(np.expand_dims)
@numpy_names
def expand_dims(x: Any, axis: Any) -> Tensor:
    """Insert axes of length one at ``axis`` (an int or a tuple). Gradient: ``g`` reshaped
    back."""
    return _expand_dims(x, axis=_ints(axis))


@implements(np.broadcast_to)
def broadcast_to(x: Any, shape: Any) -> Tensor:
    """Broadcast to ``shape``; the gradient is summed back over the broadcast axes."""
    return _broadcast_to(x, shape=_ints(shape))


# ----- joining and splitting -----
def _slice_along(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(start, stop),)


# ``bounds[i]:bounds[i + 1]`` is where input i lies along ``axis`` of the result.
_concatenate = defop("concatenate", lambda *xs, axis, bounds: np.concatenate(xs, axis=axis),
                     argnum_rule=lambda i, g, ans, xs, *, axis, bounds:
                         g[_slice_along(axis, bounds[i], bounds[i + 1])],
                     needs_values=False)
_stack = defop("stack", lambda *xs, axis: np.stack(xs, axis=axis),
               argnum_rule=lambda i, g, ans, xs, *, axis: g[(slice(None),) * axis + (i,)],
               needs_values=False)
_split = defop("split", lambda x, *, sections, axis: np.split(x, sections, axis=axis),
               lambda gs, ans, x, *, sections, axis: np.concatenate(gs, axis=axis),
               multi_output=True, needs_values=False, view=True)


@implements(np.concatenate)
@numpy_names
def concatenate(tensors: Sequence[Any], axis: int | None = 0) -> Tensor:
    """Join tensors along an existing axis (flattened first if ``axis`` is None).
    Gradient: each tensor gets the slice of ``g`` it filled."""
    if len(tensors) == 0:
        raise ValueError("concatenate: need at least one tensor")
    if axis is None:
        return concatenate([reshape(t, -1) for t in tensors], axis=0)
    axis = normalize_axis(axis, ndim_of(tensors[0]), "concatenate")
    # A tensor of another rank has no size along axis; numpy's forward then says so.
    sizes = [np.shape(array_of(t))[axis] if ndim_of(t) > axis else 0 for t in tensors]
    bounds = tuple(int(b) for b in np.cumsum([0, *sizes]))
    return _concatenate(*tensors, axis=axis, bounds=bounds)


@implements(np.stack)
@numpy_names
def stack(tensors: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along a new axis. Gradient: tensor ``i`` gets ``g``'s entry ``i``
    along that axis."""
    if len(tensors) == 0:
        raise ValueError("stack: need at least one tensor")
    return _stack(*tensors, axis=normalize_axis(axis, ndim_of(tensors[0]) + 1, "stack"))


@implements(np.split)
@numpy_names
def split(x: Any, indices_or_sections: Any, axis: int = 0) -> tuple[Tensor, ...]:
    """Split into several tensors along ``axis``: one node with several outputs. Gradient:
    the outputs' gradients joined again (zeros for an output that got none).

    ``indices_or_sections`` is a number of equal pieces or the indices to cut at, as in
    ``np.split``; indices whose pieces would overlap raise ValueError.

    >>> import numpy as np, pargrad
    >>> x = pargrad.tensor(np.arange(4.0), requires_grad=True)
    >>> first, rest = pargrad.split(x, [1])
    >>> (rest * 2).sum().backward()   # first is unused: its part of x gets zeros
    >>> x.grad
    tensor([0., 2., 2., 2.], dtype=float64)
    """
    axis = normalize_axis(axis, ndim_of(x), "split")
    if isinstance(indices_or_sections, (int, np.integer)):
        sections: int | tuple[int, ...] = int(indices_or_sections)
    else:
        # As numpy reads them: negative indices count from the end, all clamp to [0, n].
        n = np.shape(array_of(x))[axis]
        sections = tuple(min(max(i + n if i < 0 else i, 0), n)
                         for i in _ints(indices_or_sections))
        if list(sections) != sorted(sections):
            raise ValueError(f"split: indices {_ints(indices_or_sections)} must not decrease "
                             f"(pieces may not overlap)")
    return _split.outputs(x, sections=sections, axis=axis)


# ----- indexing -----
def _is_basic(index: tuple[Any, ...]) -> bool:
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis
               for i in index)


def _untake_array(g: np.ndarray, index: tuple[Any, ...], shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=g.dtype)
    if _is_basic(index):
        out[index] = g  # a basic index never repeats an element
    else:
        np.add.at(out, index, g)
    return out


# untake is getitem's adjoint: it scatters g into zeros, adding at repeated indices.
_untake = defop("untake", lambda g, *, index, shape: _untake_array(g, index, shape),
                lambda gg, ans, g, *, index, shape: gg[index], needs_values=False)
_getitem = defop("getitem", lambda x, *, index: x[index],
                 lambda g, ans, x, *, index:
                     _untake(g, index=index, shape=x.shape) if isinstance(g, Tensor)
                     else _untake_array(g, index, x.shape),
                 needs_values=False, view=True)


def _normalize_index(index: Any) -> tuple[Any, ...]:
    items = index if isinstance(index, tuple) else (index,)
    out: list[Any] = []
    for item in items:
        source = item
        if isinstance(item, Tensor):
            item = item.data
        elif isinstance(item, list):
            item = np.asarray(item)
            if item.size == 0:
                item = item.astype(np.intp)  # [] selects nothing, as in numpy
        if isinstance(item, np.ndarray) and item.dtype == bool and item.ndim > 0:
            out.extend(np.nonzero(item))  # add.at needs integer indices
            if recorder.active and recorder.depends(source):
                recorder.fail("indexing by a boolean mask made from values: the result's "
                              "shape depends on them")
        elif isinstance(item, np.ndarray):
            copy = item.copy()  # the node keeps it: a later change must not reach it
            out.append(copy)
            if recorder.active:  # pargrad.capture: a replay copies its own index
                recorder.derived(np.array, (source,), copy)
        else:
            out.append(item)
    return tuple(out)


def getitem(x: Any, index: Any) -> Tensor:
    """``x[index]`` with numpy's basic and advanced indexing."""
    return _getitem(x, index=_normalize_index(index))
