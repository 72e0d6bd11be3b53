"""Tensor: a numpy array that can record the operations applied to it.

Operators and methods delegate to ``pargrad.ops``; numpy functions and ufuncs called on
Tensors (``np.exp(t)``, ``np.sum(t, axis=0)``) dispatch to the same ops through numpy's
``__array_ufunc__`` / ``__array_function__`` protocols, which is also what lets every
gradient rule run unchanged on Tensors when a backward records its own graph.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from pargrad.devices import CPU, Device
from pargrad.devices import device as as_device
from pargrad.graph import AccumulateGrad, Edge, Meta, Node, set_gradient_view
from pargrad.hooks import Hook, NodeHooks, RemovableHandle
from pargrad.numpy_names import numpy_names
from pargrad.replay import recorder as _recorder
from pargrad.versions import Saved, SavedVersion, VersionCounter, counter_of
from pargrad.views import View, refresh

if TYPE_CHECKING:
    from pargrad import ops as _ops
    from pargrad.autograd import tensor_backward as _backward
    from pargrad.engine.base import Engine
    from pargrad.ops import inplace as _inplace

# Guards every tensor's _accumulator (the creation of a leaf's AccumulateGrad), so that
# two threads recording graphs on one leaf share one accumulator instead of making two.
_accumulator_lock = threading.Lock()
# Guards every tensor's _grad: the .grad setter, and a backward's commit (which reads
# the old gradient and writes the sum), so that no concurrent contribution is lost.
grad_lock = threading.Lock()


# Array kinds a Tensor may hold: bool, signed and unsigned integers, floats, complex.
NUMERIC_KINDS = frozenset("biufc")


def _leaf_data(data: Any) -> Any:
    """What ``Tensor(data)`` copies: a Tensor's array. A Tensor that requires grad is
    copied without its graph, with a warning (as torch's); Tensors that require grad
    inside a list are refused, since their gradients would be lost silently."""
    if isinstance(data, Tensor):
        if data.requires_grad:
            warnings.warn(
                "pargrad.tensor(t) copies t's values into a new leaf, cut off from t's graph "
                "(no gradient reaches t); write t.detach().copy() to say so, or pargrad.copy(t) "
                "for a differentiable copy", UserWarning, stacklevel=4)
        return data.data
    if isinstance(data, (list, tuple)) and _holds_tensor_requiring_grad(data):
        raise TypeError(
            "pargrad.tensor got a list holding Tensors that require grad: it would copy their "
            "values and lose their gradients; use pargrad.stack(list) (or "
            "pargrad.concatenate) to combine them differentiably"
        )
    return data


def _holds_tensor_requiring_grad(items: list[Any] | tuple[Any, ...]) -> bool:
    for item in items:
        if isinstance(item, Tensor):
            if item.requires_grad:
                return True
        elif isinstance(item, (list, tuple)) and _holds_tensor_requiring_grad(item):
            return True
    return False


def _check_can_require_grad(dtype: np.dtype) -> None:
    if dtype.kind != "f":
        raise TypeError(
            f"only floating-point tensors can require gradients, but this tensor has dtype "
            f"{dtype}; create it with a float dtype, e.g. pargrad.tensor(data, "
            f"dtype=np.float64, requires_grad=True)"
        )


class Tensor:
    """A numpy array with an optional gradient and the graph node that produced it.

    Attributes:
        data: the numpy array (read it, or replace it under ``no_grad`` to update weights;
            on a tensor an op made, only with an array of the same shape and dtype).
        requires_grad: whether gradients flow to this tensor.
        grad: accumulated gradient of a leaf (a Tensor or None; set to None to reset).
        grad_fn: the Node that produced this tensor, ``None`` for leaves.
        output_nr: which output of ``grad_fn`` this tensor is.
        device: the Device its data lives on (``pargrad.device("cpu")`` by default).

    Not thread-safe for concurrent mutation of the same tensor; concurrent reads and
    graph building from several threads are fine.
    """

    __slots__ = ("__weakref__", "_accumulator", "_counter", "_device", "_grad", "_hooks",
                 "_requires_grad", "_view", "data", "grad_fn", "output_nr")

    data: np.ndarray
    grad_fn: Node | None
    _device: Device  # set when the tensor is made, never changed
    _grad: Tensor | None  # guarded by grad_lock
    _accumulator: weakref.ref[AccumulateGrad] | None  # guarded by _accumulator_lock
    _hooks: NodeHooks | None  # a leaf's hooks, shared with its accumulator; same lock
    # Shared with every tensor viewing the same memory; made on first use (counter_of).
    _counter: VersionCounter | None
    _view: View | None  # set on a view of another tensor's memory (pargrad/views.py)

    def __init__(
        self, data: Any, requires_grad: bool = False, dtype: Any = None, device: Any = None
    ) -> None:
        array = np.array(_leaf_data(data), dtype=dtype)
        if array.dtype.kind not in NUMERIC_KINDS:
            raise TypeError(
                f"pargrad.tensor takes numbers (bool, integer, float or complex), but this "
                f"data makes a numpy array of dtype {array.dtype}"
                f"{' (objects of mixed or non-numeric types)' if array.dtype.kind == 'O' else ''}"
                f"; convert it to numbers first"
            )
        if requires_grad:
            _check_can_require_grad(array.dtype)
        self.data = array
        self._device = CPU if device is None else as_device(device)
        self._requires_grad = bool(requires_grad)
        self.grad_fn = None
        self.output_nr = 0
        self._grad = None
        self._accumulator = None
        self._hooks = None
        self._counter = None
        self._view = None
        if _recorder.active and (found := _recorder.current()) is not None:
            found.note_constant(self, data)  # pargrad.capture: a constant of the recording

    @classmethod
    def _make(
        cls, data: np.ndarray, grad_fn: Node | None = None, output_nr: int = 0,
        device: Device | None = None,
    ) -> Tensor:
        """Wrap an array without copying (internal fast path).

        The tensor is on ``device`` if given, else on its ``grad_fn``'s device, else CPU.
        """
        t = object.__new__(cls)
        t.data = data
        if device is None:
            device = CPU if grad_fn is None else grad_fn.device
        t._device = device
        t._requires_grad = grad_fn is not None
        t.grad_fn = grad_fn
        t.output_nr = output_nr
        t._grad = None
        t._accumulator = None
        t._hooks = None
        t._counter = None
        t._view = None
        if _recorder.active:  # pargrad.capture: made by a call no recording noted (yet)
            _recorder.note_made(t)
        return t

    # ----- autograd state -----

    @property
    def requires_grad(self) -> bool:
        """Whether gradients flow to this tensor; settable on float leaves only."""
        if self._view is not None:
            refresh(self)
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    @property
    def is_leaf(self) -> bool:
        """True for tensors made by the user (no ``grad_fn``)."""
        if self._view is not None:
            refresh(self)
        return self.grad_fn is None

    @property
    def grad(self) -> Tensor | None:
        """The gradient accumulated into this leaf by backward calls, or None.

        A non-leaf tensor gets one only if ``retain_grad()`` was called on it; reading
        ``.grad`` of one that did not warns (as in PyTorch), since it stays None.
        """
        if _recorder.active:
            _recorder.fail("tensor.grad is read (it is a new tensor after each zero_grad)")
        if self._grad is None and self.grad_fn is not None and not self.retains_grad:
            warnings.warn(
                "reading .grad of a non-leaf tensor (one made by an op, with a grad_fn): "
                "backward does not fill it, so it is None; call .retain_grad() on it before "
                "the backward to keep its gradient, or read .grad of the leaf you made "
                "with requires_grad=True", UserWarning, stacklevel=2)
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if _recorder.active:
            _recorder.fail("tensor.grad is set (zero_grad) inside the function")
        if value is not None:
            if not isinstance(value, Tensor):
                raise TypeError(f"grad must be a Tensor or None, got {type(value).__name__}")
            if value.shape != self.shape:
                raise ValueError(
                    f"assigned grad has shape {value.shape}, but the tensor has shape "
                    f"{self.shape}"
                )
            if value.dtype != self.dtype:
                raise TypeError(
                    f"assigned grad has dtype {value.dtype}, but the tensor has dtype "
                    f"{self.dtype}"
                )
            if value.device is not self._device:
                raise ValueError(
                    f"assigned grad is on {value.device}, but the tensor is on "
                    f"{self._device}; move it with .to()"
                )
        with grad_lock:
            self._grad = value

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Set ``requires_grad`` in place on a leaf and return the tensor."""
        if _recorder.active and bool(requires_grad) != self._requires_grad:
            _recorder.fail("requires_grad_ changes a tensor inside the function")
        if not self.is_leaf:
            if bool(requires_grad) == self._requires_grad:
                return self
            raise RuntimeError(
                "requires_grad can only be changed on leaf tensors; use .detach() to get a "
                "leaf that shares this tensor's data"
            )
        if requires_grad:
            _check_can_require_grad(self.data.dtype)
        self._requires_grad = bool(requires_grad)
        return self

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's data, device and version counter, cut off from
        the graph (an in-place change to either is seen by both, and by the checks of
        nodes that saved this tensor)."""
        leaf = Tensor._make(self.data, device=self._device)
        leaf._counter = counter_of(self)
        if _recorder.active and (found := _recorder.current()) is not None:
            found.note_detach(self, leaf)
        return leaf

    def detach_(self) -> Tensor:
        """Make this tensor a leaf that does not require grad, in place (its data, device
        and version counter stay); returns it. A ``retain_grad`` mark is dropped.

        Raises RuntimeError on a view (its history belongs to its base): use ``detach()``.
        """
        if _recorder.active:
            _recorder.fail("detach_ changes a tensor inside the function")
        if self._view is not None:
            raise RuntimeError("detach_: cannot detach a view of another tensor in place; "
                               "use .detach() to get a new leaf instead")
        hooks = None if self.grad_fn is None else self.grad_fn._hooks
        if hooks is not None and self.output_nr in hooks.retains:
            hooks.release(self.output_nr)
        counter_of(self)  # the counter of the history it leaves, shared with its node
        self.grad_fn, self.output_nr = None, 0
        self._requires_grad = False
        return self

    @property
    def _version(self) -> int:
        """How many times this tensor's memory was changed in place (as PyTorch's
        ``Tensor._version``); shared by the tensors that view the same memory."""
        return counter_of(self).value

    @property
    def device(self) -> Device:
        """The device this tensor's data lives on; its backward nodes run there."""
        return self._device

    def to(self, device: str | Device) -> Tensor:
        """This tensor on ``device``: itself if it is already there, else a copy there.

        The copy is differentiable: its gradient flows back to this tensor's device.

        >>> import pargrad
        >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
        >>> y = x.to("cpu:1")
        >>> y.device, y.grad_fn.name()
        (device('cpu:1'), 'ToBackward')
        >>> (y * 3).sum().backward()
        >>> x.grad
        tensor([3., 3.], dtype=float64)
        """
        return _ops.to(self, device)

    def _edge(self) -> Edge:
        """The edge a new node should hold to send this tensor its gradient."""
        if self._view is not None:
            refresh(self, recording=True)
        if self.grad_fn is not None:
            return (self.grad_fn, self.output_nr)
        if self._requires_grad:
            return (self._grad_accumulator(), 0)
        return (None, 0)

    def _rebase(self, grad_fn: Node | None, output_nr: int) -> None:
        """Give this non-leaf (or constant) tensor the history ``(grad_fn, output_nr)``,
        after an in-place change: a ``retain_grad`` mark moves along; tensor hooks stay
        where they were (they see the gradient of the old value, as in PyTorch)."""
        old, old_nr = self.grad_fn, self.output_nr
        counter_of(self)  # the counter of the old history, shared with its node (if made)
        self.grad_fn, self.output_nr = grad_fn, output_nr
        self._requires_grad = grad_fn is not None
        hooks = None if old is None else old._hooks
        if hooks is not None and old_nr in hooks.retains and grad_fn is not None:
            hooks.release(old_nr)
            grad_fn._hooks_made().retain(output_nr, self)

    def _grad_accumulator(self) -> AccumulateGrad:
        # The graph holds the accumulator strongly and the leaf only weakly (as in
        # PyTorch), so a leaf never keeps a dead graph alive. A live one is found
        # without the lock (every op on a weight asks): once set, the reference only
        # ever points at an accumulator, alive or dead.
        ref = self._accumulator
        acc = None if ref is None else ref()
        if acc is not None:
            return acc
        with _accumulator_lock:
            acc = self._accumulator() if self._accumulator is not None else None
            if acc is None:
                acc = AccumulateGrad(self)
                self._accumulator = weakref.ref(acc)
            return acc

    # ----- hooks -----

    def register_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(grad)`` whenever a backward computes this tensor's gradient.

        ``grad`` is a Tensor; the hook may return a Tensor (same shape and dtype) that
        replaces it, for the rest of the backward and for ``.grad``. It must not modify
        ``grad`` in place (its memory may be shared). It runs on the thread that runs the
        node receiving the gradient (docs/autograd.md). Returns a handle with ``remove()``.

        >>> import pargrad
        >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
        >>> handle = x.register_hook(lambda g: g * 10)
        >>> (x * x).sum().backward()
        >>> x.grad
        tensor([20., 40.], dtype=float64)
        >>> handle.remove()
        """
        self._check_requires_grad("register a hook on")  # (remakes a stale view first)
        if self.grad_fn is not None:
            return self.grad_fn._hooks_made().add("tensor", hook, self.output_nr)
        return self._leaf_hooks().add("tensor", hook)

    def register_post_accumulate_grad_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(tensor)`` on this leaf right after a backward updated its ``.grad``.

        It fires as soon as the leaf's gradient is final (every edge into it delivered),
        while the rest of the backward may still run, on the thread that delivered the
        last contribution. It may read ``.grad`` and update the tensor's data in place
        (under ``no_grad``); it must not start a backward through the same graph. If the
        backward then fails, ``.grad`` is restored, but what the hook did is not undone,
        unless it queued its own undo (``pargrad.autograd.queue_undo``). Returns a
        handle with ``remove()``.
        """
        self._check_requires_grad("register a post-accumulate-grad hook on")
        if self.grad_fn is not None:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf "
                               "tensors; use register_hook on a non-leaf")
        return self._leaf_hooks().add("post_accumulate", hook)

    def retain_grad(self) -> None:
        """Keep this non-leaf tensor's gradient in ``.grad`` after a backward (a no-op on
        leaves, which keep theirs anyway)."""
        self._check_requires_grad("retain_grad on")
        if self.grad_fn is not None:
            self.grad_fn._hooks_made().retain(self.output_nr, self)

    @property
    def retains_grad(self) -> bool:
        """Whether ``retain_grad()`` was called on this non-leaf tensor."""
        if self._view is not None:
            refresh(self)
        hooks = None if self.grad_fn is None else self.grad_fn._hooks
        return hooks is not None and self.output_nr in hooks.retains

    def _check_requires_grad(self, what: str) -> None:
        if not self.requires_grad:
            raise RuntimeError(f"cannot {what} a tensor that does not require grad; make it "
                               f"with requires_grad=True")

    def _leaf_hooks(self) -> NodeHooks:
        if _recorder.active:
            _recorder.fail("a hook is registered on a tensor")
        with _accumulator_lock:
            if self._hooks is None:
                self._hooks = NodeHooks()
                acc = self._accumulator() if self._accumulator is not None else None
                if acc is not None:
                    acc._hooks = self._hooks
            return self._hooks

    def backward(
        self,
        gradient: Any = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Tensor | Sequence[Tensor] | None = None,
        *,
        engine: Engine | None = None,
    ) -> None:
        """Accumulate d(self)/d(leaf) into ``.grad`` of every leaf that requires grad.

        Blocks until the backward is done. ``gradient`` is required unless the tensor
        has one element. See ``pargrad.backward`` for the full contract.

        >>> import pargrad
        >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
        >>> (x * x).sum().backward()
        >>> x.grad
        tensor([2., 4.], dtype=float64)
        """
        _backward(self, gradient, retain_graph, create_graph, inputs, engine)

    # ----- array facts -----

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def size(self) -> int:
        return self.data.size

    def numpy(self) -> np.ndarray:
        """The underlying array (shared, not copied; not tracked by autograd)."""
        if _recorder.active:
            _recorder.fail("tensor.numpy() reads a value back into Python")
        return self.data

    def item(self) -> Any:
        """The value of a one-element tensor as a Python scalar."""
        if _recorder.active:
            _recorder.fail("tensor.item() reads a value back into Python")
        return self.data.item()

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Tensor]:
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        if _recorder.active:
            _recorder.fail("bool(tensor) reads a value back into Python")
        return bool(self.data)

    def __float__(self) -> float:
        if _recorder.active:
            _recorder.fail("float(tensor) reads a value back into Python")
        return float(self.data)

    def __int__(self) -> int:
        if _recorder.active:
            _recorder.fail("int(tensor) reads a value back into Python")
        return int(self.data)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if _recorder.active:
            _recorder.fail("numpy.asarray(tensor) reads a value back into numpy")
        if dtype is not None and dtype != self.data.dtype:
            if copy is False:
                raise ValueError(f"cannot convert a {self.dtype} tensor to {dtype} without a copy")
            return self.data.astype(dtype)
        return self.data.copy() if copy else self.data

    def __repr__(self) -> str:
        body = np.array2string(self.data, separator=", ", prefix="tensor(")
        extra = f", dtype={self.data.dtype}"
        if self._device is not CPU:
            extra += f", device='{self._device}'"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{self.grad_fn.name()}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"

    __hash__ = object.__hash__

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickling and deepcopy make a new leaf: the graph is not part of a tensor's value.
        if not self.is_leaf:
            raise TypeError(
                "cannot pickle or copy a non-leaf tensor (it belongs to a graph); "
                "detach() it first"
            )
        grad = None if self._grad is None else self._grad.detach()
        return (_rebuild_leaf, (self.data, self._requires_grad, grad, self._device))

    # ----- numpy interoperability -----

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if method == "__call__" and not kwargs:  # a rule's np.cos(t): the op's Op.call
            call = _ufunc_calls.get(ufunc)
            if call is not None:
                return call(inputs, _NO_PARAMS)
        return _ops.dispatch_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(
        self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        return _ops.dispatch_function(func, args, kwargs)

    # ----- operators -----
    # On the hot path: they call ``Op.call`` (no keyword dict, no ``__call__`` lookup).

    def __add__(self, other: Any) -> Tensor:
        return _ops.add.call((self, other), _NO_PARAMS)

    def __radd__(self, other: Any) -> Tensor:
        return _ops.add.call((other, self), _NO_PARAMS)

    def __sub__(self, other: Any) -> Tensor:
        return _ops.subtract.call((self, other), _NO_PARAMS)

    def __rsub__(self, other: Any) -> Tensor:
        return _ops.subtract.call((other, self), _NO_PARAMS)

    def __mul__(self, other: Any) -> Tensor:
        return _ops.multiply.call((self, other), _NO_PARAMS)

    def __rmul__(self, other: Any) -> Tensor:
        return _ops.multiply.call((other, self), _NO_PARAMS)

    def __truediv__(self, other: Any) -> Tensor:
        return _ops.divide.call((self, other), _NO_PARAMS)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _ops.divide.call((other, self), _NO_PARAMS)

    def __pow__(self, other: Any) -> Tensor:
        return _ops.power.call((self, other), _NO_PARAMS)

    def __rpow__(self, other: Any) -> Tensor:
        return _ops.power.call((other, self), _NO_PARAMS)

    # In-place operators (``w -= lr * g``) and methods (``w.sub_(lr * g)``) write into
    # the tensor's memory and bump its version; see pargrad/ops/inplace.py.
    def __iadd__(self, other: Any) -> Tensor:
        return _inplace.update(self, "add_", _ops.add, other)

    def __isub__(self, other: Any) -> Tensor:
        return _inplace.update(self, "sub_", _ops.subtract, other)

    def __imul__(self, other: Any) -> Tensor:
        return _inplace.update(self, "mul_", _ops.multiply, other)

    def __itruediv__(self, other: Any) -> Tensor:
        return _inplace.update(self, "div_", _ops.divide, other)

    def __ipow__(self, other: Any) -> Tensor:
        return _inplace.update(self, "**=", _ops.power, other)

    def __imatmul__(self, other: Any) -> Tensor:
        return _inplace.update(self, "@=", _ops.matmul, other)

    def add_(self, other: Any) -> Tensor:
        """``self += other`` in place (differentiable; see docs/autograd.md); returns self.

        >>> import pargrad
        >>> x = pargrad.tensor([1.0, 2.0])
        >>> x.add_(1.0)
        tensor([2., 3.], dtype=float64)
        >>> x._version
        1
        """
        return _inplace.update(self, "add_", _ops.add, other)

    def sub_(self, other: Any) -> Tensor:
        """``self -= other`` in place; returns self."""
        return _inplace.update(self, "sub_", _ops.subtract, other)

    def mul_(self, other: Any) -> Tensor:
        """``self *= other`` in place; returns self."""
        return _inplace.update(self, "mul_", _ops.multiply, other)

    def div_(self, other: Any) -> Tensor:
        """``self /= other`` in place; returns self."""
        return _inplace.update(self, "div_", _ops.divide, other)

    # In-place versions of the unary ops: ``x.exp_()`` is ``x <- exp(x)`` in place.
    def exp_(self) -> Tensor:
        """``self <- exp(self)`` in place; returns self."""
        return _inplace.update_unary(self, "exp_", _ops.exp)

    def log_(self) -> Tensor:
        """``self <- log(self)`` in place; returns self."""
        return _inplace.update_unary(self, "log_", _ops.log)

    def sqrt_(self) -> Tensor:
        """``self <- sqrt(self)`` in place; returns self."""
        return _inplace.update_unary(self, "sqrt_", _ops.sqrt)

    def abs_(self) -> Tensor:
        """``self <- abs(self)`` in place; returns self."""
        return _inplace.update_unary(self, "abs_", _ops.abs)

    def neg_(self) -> Tensor:
        """``self <- -self`` in place; returns self."""
        return _inplace.update_unary(self, "neg_", _ops.negative)

    def tanh_(self) -> Tensor:
        """``self <- tanh(self)`` in place; returns self."""
        return _inplace.update_unary(self, "tanh_", _ops.tanh)

    def sigmoid_(self) -> Tensor:
        """``self <- sigmoid(self)`` in place; returns self."""
        return _inplace.update_unary(self, "sigmoid_", _ops.sigmoid)

    def relu_(self) -> Tensor:
        """``self <- relu(self)`` in place; returns self."""
        return _inplace.update_unary(self, "relu_", _ops.relu)

    def sin_(self) -> Tensor:
        """``self <- sin(self)`` in place; returns self."""
        return _inplace.update_unary(self, "sin_", _ops.sin)

    def cos_(self) -> Tensor:
        """``self <- cos(self)`` in place; returns self."""
        return _inplace.update_unary(self, "cos_", _ops.cos)

    def clip_(self, a_min: Any = None, a_max: Any = None) -> Tensor:
        """``self <- clip(self, a_min, a_max)`` in place; returns self (``clamp_`` too)."""
        return _inplace.update_unary(self, "clip_", lambda t: _ops.clip(t, a_min, a_max))

    clamp_ = clip_

    def fill_(self, value: Any) -> Tensor:
        """Set every element to ``value`` (a number, or a one-element Tensor, which then
        gets the summed gradient); returns self."""
        _inplace.setitem(self, Ellipsis, value, "fill_")
        return self

    def zero_(self) -> Tensor:
        """Set every element to zero; returns self."""
        _inplace.setitem(self, Ellipsis, 0, "zero_")
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        """``self[index] = value`` in place, with numpy's indexing (differentiable in
        ``value`` and in the rest of ``self``)."""
        _inplace.setitem(self, index, value, "setitem")

    def __matmul__(self, other: Any) -> Tensor:
        return _ops.matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return _ops.matmul(other, self)

    def __neg__(self) -> Tensor:
        return _ops.negative(self)

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return _ops.abs(self)

    def __getitem__(self, index: Any) -> Tensor:
        return _ops.getitem(self, index)

    # Comparisons and bitwise operators (on bool or int tensors, as in numpy) give tensors
    # that never require grad.
    def __lt__(self, other: Any) -> Tensor:
        return _ops.constant(np.less, self, other)

    def __le__(self, other: Any) -> Tensor:
        return _ops.constant(np.less_equal, self, other)

    def __gt__(self, other: Any) -> Tensor:
        return _ops.constant(np.greater, self, other)

    def __ge__(self, other: Any) -> Tensor:
        return _ops.constant(np.greater_equal, self, other)

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return _ops.constant(np.equal, self, other)

    def __ne__(self, other: Any) -> Tensor:  # type: ignore[override]
        return _ops.constant(np.not_equal, self, other)

    def __and__(self, other: Any) -> Tensor:
        return _ops.constant(np.bitwise_and, self, other)

    def __or__(self, other: Any) -> Tensor:
        return _ops.constant(np.bitwise_or, self, other)

    def __invert__(self) -> Tensor:
        return _ops.constant(np.invert, self)

    # ----- methods (numpy's names and keywords) -----

    def exp(self) -> Tensor:
        return _ops.exp(self)

    def log(self) -> Tensor:
        return _ops.log(self)

    def sqrt(self) -> Tensor:
        return _ops.sqrt(self)

    def abs(self) -> Tensor:
        return _ops.abs(self)

    def tanh(self) -> Tensor:
        return _ops.tanh(self)

    def sigmoid(self) -> Tensor:
        return _ops.sigmoid(self)

    def relu(self) -> Tensor:
        return _ops.relu(self)

    def sin(self) -> Tensor:
        return _ops.sin(self)

    def cos(self) -> Tensor:
        return _ops.cos(self)

    def clip(self, a_min: Any = None, a_max: Any = None) -> Tensor:
        return _ops.clip(self, a_min, a_max)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.sum(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.mean(self, axis=axis, keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.max(self, axis=axis, keepdims=keepdims)

    def min(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.min(self, axis=axis, keepdims=keepdims)

    def logsumexp(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.logsumexp(self, axis=axis, keepdims=keepdims)

    def softmax(self, axis: int = -1) -> Tensor:
        return _ops.softmax(self, axis=axis)

    def log_softmax(self, axis: int = -1) -> Tensor:
        return _ops.log_softmax(self, axis=axis)

    def matmul(self, other: Any) -> Tensor:
        return _ops.matmul(self, other)

    def reshape(self, *shape: Any) -> Tensor:
        return _ops.reshape(self, shape[0] if len(shape) == 1 else shape)

    def transpose(self, *axes: Any) -> Tensor:
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            return _ops.transpose(self, axes[0])
        return _ops.transpose(self, axes if axes else None)

    @property
    def T(self) -> Tensor:
        return _ops.transpose(self)

    def squeeze(self, axis: Any = None) -> Tensor:
        return _ops.squeeze(self, axis)

    def expand_dims(self, axis: Any) -> Tensor:
        return _ops.expand_dims(self, axis)

    def broadcast_to(self, shape: Any) -> Tensor:
        return _ops.broadcast_to(self, shape)

    def split(self, indices_or_sections: Any, axis: int = 0) -> tuple[Tensor, ...]:
        return _ops.split(self, indices_or_sections, axis)

    def astype(self, dtype: Any) -> Tensor:
        return _ops.astype(self, dtype)

    def copy(self) -> Tensor:
        return _ops.copy(self)

    def swapaxes(self, axis1: int, axis2: int) -> Tensor:
        return _ops.swapaxes(self, axis1, axis2)

    # ----- more methods: numpy's, and torch's names a newcomer tries -----

    def tolist(self) -> Any:
        """The values as (nested) Python lists, as ``ndarray.tolist``."""
        if _recorder.active:
            _recorder.fail("tensor.tolist() reads values back into Python")
        return self.data.tolist()

    def clone(self) -> Tensor:
        """A differentiable copy with its own memory (torch's name for ``copy()``)."""
        return _ops.copy(self)

    @property
    def mT(self) -> Tensor:
        """The last two axes swapped (the transpose of each matrix in a stack)."""
        return _ops.swapaxes(self, -1, -2)

    def square(self) -> Tensor:
        return _ops.square(self)

    def pow(self, exponent: Any) -> Tensor:
        """``self ** exponent``."""
        return _ops.power(self, exponent)

    def log1p(self) -> Tensor:
        return _ops.log1p(self)

    def expm1(self) -> Tensor:
        return _ops.expm1(self)

    def softplus(self) -> Tensor:
        return _ops.softplus(self)

    def dot(self, other: Any) -> Tensor:
        return _ops.dot(self, other)

    def prod(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        return _ops.prod(self, axis=axis, keepdims=keepdims)

    def cumsum(self, axis: int | None = None) -> Tensor:
        return _ops.cumsum(self, axis=axis)

    def var(self, axis: Any = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
        return _ops.var(self, axis=axis, keepdims=keepdims, ddof=ddof)

    def std(self, axis: Any = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
        return _ops.std(self, axis=axis, keepdims=keepdims, ddof=ddof)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Any:
        """Indices of the maxima, as ``np.argmax`` returns them (no gradient)."""
        return _ops.argmax(self, axis=axis, keepdims=keepdims)

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Any:
        """Indices of the minima, as ``np.argmin`` returns them (no gradient)."""
        return _ops.argmin(self, axis=axis, keepdims=keepdims)

    def all(self, axis: Any = None) -> Any:
        """Whether every element is true, as ``np.all`` (no gradient)."""
        if _recorder.active:
            _recorder.fail("tensor.all() reads values back into numpy")
        return np.all(self.data, axis=axis)

    def any(self, axis: Any = None) -> Any:
        """Whether any element is true, as ``np.any`` (no gradient)."""
        if _recorder.active:
            _recorder.fail("tensor.any() reads values back into numpy")
        return np.any(self.data, axis=axis)

    # torch's casts: differentiable, as astype (last in the class: ``float`` and ``half``
    # would shadow the builtin names in the annotations of methods after them).
    def double(self) -> Tensor:
        """``astype(np.float64)``."""
        return _ops.astype(self, np.float64)

    def half(self) -> Tensor:
        """``astype(np.float16)``."""
        return _ops.astype(self, np.float16)

    def long(self) -> Tensor:
        """``astype(np.int64)`` (no gradient: an integer result)."""
        return _ops.astype(self, np.int64)

    def float(self) -> Tensor:
        """``astype(np.float32)`` (torch's ``float`` is 32 bits; ``float(t)`` of a
        one-element tensor still gives a Python float)."""
        return _ops.astype(self, np.float32)


def input_edges(args: Sequence[Any]) -> tuple[tuple[Edge, ...], tuple[Meta | None, ...]]:
    """The edges a new node holds to its positional arguments, and their (shape, dtype).

    An argument that is not a Tensor requiring grad gets the edge ``(None, 0)`` and no
    metadata.
    """
    edges: list[Edge] = []
    metas: list[Meta | None] = []
    for a in args:
        if isinstance(a, Tensor):
            if a._view is not None:
                refresh(a, recording=True)  # a view whose base changed may require grad now
            if a._requires_grad:
                edges.append(a._edge())
                metas.append((a.data.shape, a.data.dtype))
                continue
        edges.append((None, 0))
        metas.append(None)
    return tuple(edges), tuple(metas)


_new = object.__new__


def saved_versions(tensors: Sequence[Any], which: Iterable[int] | None = None, *,
                   outputs: bool = False) -> Saved:
    """The versions of the Tensors among ``tensors`` (those at ``which``, or all) now, as
    ``versions.check`` reads them: by index, as outputs with ``outputs=True``."""
    saved: list[SavedVersion] = []
    for i in range(len(tensors)) if which is None else which:
        t = tensors[i]
        if isinstance(t, Tensor):
            counter = t._counter or counter_of(t)  # made on first use, then never replaced
            record = _new(SavedVersion)  # SavedVersion(...) without a call per record
            record.where = -1 - i if outputs else i
            record.counter = counter
            record.version = counter.value
            record.array = t.data
            saved.append(record)
    return tuple(saved)


def check_saved_data(saved: Sequence[Any], arrays: Sequence[Any], what: str) -> None:
    """Raise RuntimeError if a saved Tensor no longer holds the array saved with it.

    A node saves the arrays its backward needs; a tensor given new ``.data`` since
    (a weight update) can no longer stand for the value the forward used.
    """
    for i, (t, array) in enumerate(zip(saved, arrays)):
        if isinstance(t, Tensor) and t.data is not array:
            raise RuntimeError(
                f"{what} {i} was given new .data after it was saved for backward; update "
                f"tensors only after the backward that needs them"
            )


def _rebuild_leaf(data: np.ndarray, requires_grad: bool, grad: Tensor | None,
                  device: Device = CPU) -> Tensor:
    leaf = Tensor._make(data, device=device)
    leaf._requires_grad = requires_grad
    leaf._grad = grad
    return leaf


def tensor(
    data: Any, requires_grad: bool = False, dtype: Any = None, device: Any = None
) -> Tensor:
    """Make a leaf Tensor from array-like ``data`` (always copied), on ``device``.

    Python floats become float64 as in numpy. Only floating dtypes may require grad.
    ``device`` is a name such as ``"cpu:1"`` or a Device; the default is ``"cpu"``.

    >>> import pargrad
    >>> pargrad.tensor([1.0, 2.0], requires_grad=True)
    tensor([1., 2.], dtype=float64, requires_grad=True)
    """
    return Tensor(data, requires_grad=requires_grad, dtype=dtype, device=device)


# Hooks get array gradients as Tensors sharing the array (the graph cannot import Tensor).
set_gradient_view(lambda array, device: Tensor._make(array, device=device))

# Tensor's operators call the ops, and the ops build Tensors: the ops package, which
# imports this module, binds these three names when it is imported (``bind_ops``);
# likewise ``Tensor.backward`` is autograd's, bound by it (``bind_backward``).
if not TYPE_CHECKING:
    _ops = _inplace = _backward = None
_ufunc_calls: dict[np.ufunc, Callable[[tuple[Any, ...], dict[str, Any]], Tensor]] = {}
"""The ``Op.call`` of each op that serves a ufunc on Tensors (``ops.core.UFUNC_CALLS``)."""
_NO_PARAMS: dict[str, Any] = {}
"""The parameters the operators pass to ``Op.call``: none (shared, never written)."""


def bind_ops(ops: ModuleType, inplace: ModuleType) -> None:
    """Give Tensor's operators the ops they delegate to.

    Called once by ``pargrad/ops/__init__.py`` at import (under the import lock); the
    names are read-only after.
    """
    globals().update(_ops=ops, _inplace=inplace, _ufunc_calls=ops.core.UFUNC_CALLS)


def bind_backward(backward: Callable[..., None]) -> None:
    """Give ``Tensor.backward`` the function it delegates to: called once by
    ``pargrad/autograd.py`` at import (which ``import pargrad`` always runs); read-only
    after."""
    globals().update(_backward=backward)


# Methods with an axis: torch's dim= / keepdim= get a message naming numpy's keywords.
for _name in ("sum", "mean", "max", "min", "logsumexp", "softmax", "log_softmax", "squeeze",
              "expand_dims", "split", "prod", "cumsum", "var", "std", "argmax", "argmin"):
    setattr(Tensor, _name, numpy_names(getattr(Tensor, _name)))


_recorder.bind_tensor(Tensor)  # pargrad.capture's recorder tells tensors apart
