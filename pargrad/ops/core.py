"""The machinery behind every differentiable op: ``Op``, its graph node, numpy dispatch.

An ``Op`` pairs a numpy forward with its gradient rules, one rule per positional
argument (HIPS autograd's ``defvjp``). Positional arguments are data (Tensors, arrays or
scalars) and each gets an edge; keyword arguments are static parameters (``axis``...).

A rule has the signature ``rule(g, ans, *args, **params)`` and returns the gradient for
its argument; it may return a broadcast shape, which ``Node.apply`` sums back. Rules are
written with numpy functions and operators only. When no graph of the backward is
recorded they run on plain arrays and cost exactly the numpy calls they make; with
``create_graph=True`` they receive Tensors and the same numpy calls dispatch back to
pargrad's ops through ``__array_ufunc__`` / ``__array_function__``.
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pargrad import anomaly, grad_mode, memory, parallel
from pargrad.devices import CPU, Device, common_device
from pargrad.grad_mode import is_grad_enabled
from pargrad.graph import (
    NR_AND_ZERO,
    ONE_NR,
    SHARED_NRS,
    BackwardError,
    Grad,
    Meta,
    Node,
    next_sequence_nr,
)
from pargrad.ops import large as buffers
from pargrad.parallel import elementwise, large
from pargrad.replay import recorder
from pargrad.shapes import sum_to
from pargrad.tensor import Tensor, check_saved_data, saved_versions
from pargrad.versions import Saved, SavedVersion, VersionCounter, changed, check, counter_of
from pargrad.views import refresh, view_of

Rule = Callable[..., Any]


def nondifferentiable(g: Grad, ans: Any, *args: Any, **params: Any) -> None:
    """Rule for an argument that gets no gradient (e.g. ``where``'s condition)."""
    return None


# ----- numpy dispatch -----
# Filled by the op modules: which op or function serves a numpy ufunc / function when it
# is called with Tensors.
UFUNC_OPS: dict[np.ufunc, Callable[..., Any]] = {}
UFUNC_CALLS: dict[np.ufunc, Callable[[tuple[Any, ...], dict[str, Any]], Tensor]] = {}
"""``UFUNC_OPS``' ops as their ``Op.call`` (what ``Tensor.__array_ufunc__`` calls)."""
FUNCTION_OPS: dict[Callable[..., Any], Callable[..., Any]] = {}


class Plan(NamedTuple):
    """What the gradient rules that will run for one node read."""

    args: tuple[int, ...] | None
    """The arguments whose values they read, in order (None: maybe any)."""
    mask: int
    """The same arguments as bits (bit ``i``: argument ``i``; -1: maybe any)."""
    output: bool
    """Whether they read the output."""


class Op:
    """A differentiable primitive: a numpy ``forward`` and its gradient rules.

    ``rules[i]`` is the rule for positional argument ``i``. Variadic ops (``concatenate``)
    give ``argnum_rule(i, g, ans, args, **params)`` instead, ``args`` being one tuple.
    An op with several outputs (``multi_output=True``) gets the tuple of output
    gradients as ``g``.

    ``needs_values=False`` declares that the rules read only the shapes and dtypes of the
    arguments, never their values or the output's: the node then keeps no arrays alive,
    and its graph can be run backward again without ``retain_graph`` (as in PyTorch).

    Outputs are on the device of the Tensor operands, which must agree; an op made with
    ``moves_device=True`` (``to``) puts them on its ``device=`` parameter instead.

    ``calls_blas=True`` (matmul) says that the rules run BLAS, which uses threads of its
    own; its nodes tell the engine so (``Node.calls_blas``).

    ``cut`` names the parts of the op (``"forward"``, rule indices) that compute each
    element of their result from the same element of each array argument (and from
    scalars), and cost enough per element (transcendental functions, divisions) to be
    worth cutting: on large arrays of one shape they run in chunks that idle engine
    threads help with (pargrad/parallel.py), with bitwise the same result. Arithmetic
    that only streams memory (``g * y``, ``x + y``) is left whole: cut, it measured
    0.4-1.0x (docs/performance.md).

    ``view=True`` (reshape, basic indexing, transpose...) says that the forward may
    return a view of its first argument's memory: an output that is one shares that
    tensor's version counter and becomes a view of it (pargrad/views.py).

    Calling an op returns a Tensor (``outputs`` returns the tuple of a multi-output op).
    ``doc`` becomes the op's ``__doc__``.
    """

    def __init__(
        self,
        name: str,
        forward: Callable[..., Any],
        rules: Sequence[Rule] = (),
        *,
        argnum_rule: Callable[..., Any] | None = None,
        multi_output: bool = False,
        needs_values: bool = True,
        moves_device: bool = False,
        calls_blas: bool = False,
        view: bool = False,
        cut: tuple[str | int, ...] = (),
        doc: str | None = None,
    ) -> None:
        self.__doc__ = doc or f"The differentiable numpy ``{name}``."
        self.name = name
        self.node_name = "".join(p.capitalize() for p in name.split("_")) + "Backward"
        self.forward = forward
        self.rules = tuple(rules)
        self.argnum_rule = argnum_rule
        self.multi_output = multi_output
        self.needs_values = needs_values
        self.moves_device = moves_device
        self.node_type = BlasOpNode if calls_blas else OpNode
        self.view = view
        # Calls of a single-output op that neither views nor moves take ``__call__``'s
        # lean path; the others (and unusual operands) take ``outputs``.
        self.lean = not (multi_output or view or moves_device or argnum_rule is not None)
        # The rules ``OpNode.apply``'s lean path calls directly (None: it takes Node.apply).
        self.direct_rules = None if multi_output or argnum_rule is not None else self.rules
        # The parts that run in chunks on large arrays of one shape (pargrad/parallel.py).
        self.cut_forward = "forward" in cut and self.lean
        self.cut_rules = frozenset(i for i in cut if isinstance(i, int)) if self.lean else (
            frozenset())
        # The other rules, with ``"rules"``: cut only while a thread is idle to help.
        self.stream_rules = frozenset(range(len(self.rules))) - self.cut_rules if (
            "rules" in cut and self.lean) else frozenset()
        # Arguments from this index on have no rule (none for variadic ops).
        self.ruled = len(self.rules) if argnum_rule is None else 1 << 30
        # Per rule: whether it reads the output, and which arguments' values it reads.
        self.reads = tuple(_reads(rule) for rule in self.rules)
        self._plans: dict[int, Plan] = {}
        # The plan of a call whose argument 0 alone has an edge (Op.call's one-Tensor path).
        self.plan_one = self.plan(1)
        # A ufunc of one array and scalars gives an array of that array's shape.
        self.ufunc = isinstance(forward, np.ufunc)

    def __repr__(self) -> str:
        return f"<pargrad op {self.name}>"

    def plan(self, live: int) -> Plan:
        """What the rules of a node will read, the node's arguments with edges being the
        bits of ``live`` (bit ``i``: argument ``i``; a bitmask is the cheapest key to
        build while the edges are made). Cached per ``live``; a race only computes one
        twice."""
        plan = self._plans.get(live)
        if plan is None:
            plan = self._plans[live] = self._make_plan(live)
        return plan

    def _make_plan(self, live: int) -> Plan:
        if self.argnum_rule is not None:
            return Plan(None, -1, True)
        read: set[int] = set()
        output = False
        for i, (reads_output, reads_args) in enumerate(self.reads):
            if live >> i & 1:
                if reads_args is None:
                    return Plan(None, -1, True)
                read |= reads_args
                output = output or reads_output
        return Plan(tuple(sorted(read)), sum(1 << i for i in read), output)

    def vjp(self, i: int, g: Any, ans: Any, args: tuple[Any, ...], params: dict[str, Any]) -> Any:
        """The gradient for argument ``i``, by its rule."""
        if self.argnum_rule is not None:
            return self.argnum_rule(i, g, ans, args, **params)
        return self.rules[i](g, ans, *args, **params)

    def __call__(self, *args: Any, **params: Any) -> Tensor:
        """Run the forward on the arguments' arrays; record a node if a gradient is needed
        (``call``)."""
        return self.call(args, params)

    # The forward's hot path, run for every op: one frame, since a call costs each op.
    def call(self, args: tuple[Any, ...], params: dict[str, Any]) -> Tensor:  # noqa: C901, PLR0912, PLR0915
        """``self(*args, **params)``, for callers on the hot path (pargrad's functions and
        Tensor's operators): a method call with the arguments as they are costs ~140 ns
        less than calling the op (no keyword dict, no ``__call__`` slot lookup). The node
        recorded keeps ``params`` unless it is empty: pass a dict nothing changes later
        (an empty one may be shared).

        The lean path of the common case: operands that are Tensors (not views), arrays
        or scalars, one output. It does what ``outputs`` does in one pass; for one Tensor
        alone or beside a Python scalar it also records the node and makes the result
        Tensor in this frame, without a loop or a call; anything it does not handle goes
        to ``outputs``, which also raises the errors.
        """
        if not self.lean:
            return self.outputs(*args, **params)[0]
        x: Any = args[0] if args else None
        n = len(args)
        # The most common call: one Tensor, alone or followed by a Python scalar.
        one = type(x) is Tensor and (n == 1 or (
            n == 2 and (type(args[1]) is float or type(args[1]) is int)))
        arrays: Sequence[Any]
        held: tuple[Any, ...]  # arrays, when it is a tuple (the one-Tensor call)
        if one:
            if x._view is not None:
                return self.outputs(*args, **params)[0]
            device: Device | None = x._device
            grad = x._requires_grad
            array = x.data
            arrays = held = (array,) if n == 1 else (array, args[1])
            size = array.size
            # Large: from pargrad's pool (memory.py), or cut into chunks.
            big = size >= buffers.OUT_MIN or (
                self.cut_forward and size >= parallel.min_elements_)
        else:
            arrays = []
            device = None
            grad = False
            for a in args:
                if isinstance(a, Tensor):
                    if a._view is not None or (device is not None and a._device is not device):
                        return self.outputs(*args, **params)[0]
                    device = a._device
                    if a._requires_grad:
                        grad = True
                    arrays.append(a.data)
                elif isinstance(a, (list, tuple)):
                    return self.outputs(*args, **params)[0]
                else:
                    arrays.append(a)
            size = 0
            big = (self.cut_forward and large(arrays)) or (
                self.ufunc and large(arrays, buffers.OUT_MIN))
        try:
            if big:
                out = None
                if self.cut_forward and (size >= parallel.min_elements_ if one
                                         else large(arrays)):
                    out = elementwise(self.forward, arrays, params)  # helped by idle threads
                if out is None:
                    out = (buffers.fresh(self.forward, *arrays) if self.ufunc and not params
                           else self.forward(*arrays, **params))
            else:
                out = self.forward(*arrays, **params) if params else self.forward(*arrays)
        except (ValueError, IndexError, TypeError) as exc:
            raise _forward_error(self.name, exc, arrays, params) from exc
        raw = type(out) is not np.ndarray
        if raw:
            out = np.asarray(out)
        if device is None:
            device = CPU
        node: OpNode | None = None
        kind = ((dtype := out.dtype).kind if grad and (not grad_mode.off or grad_mode.mode.enabled)
                else "")
        if kind == "f":
            node = _new(self.node_type)  # OpNode(...) without type.__call__'s dispatch
            if not one:
                node.record(self, args, arrays, params or NO_PARAMS, (out,), device)
            else:
                # One Tensor ``x`` that requires grad, alone or beside a scalar: OpNode.record
                # written out for argument 0 alone having an edge (``live`` and ``tensors``
                # 1), in this frame, since every op pays each call made here.
                if not self.ruled:  # fail in the forward, where the call is visible
                    raise TypeError(f"{self.name}: no gradient rule for argument 0")
                fn = x.grad_fn
                if fn is not None:
                    nr = x.output_nr
                    # x's shape and dtype: those its node recorded for it, when it is that
                    # node's only output (x.data replaced on a non-leaf is not supported)
                    found = fn._output_meta
                    if nr or len(found) != 1:
                        found = _metas.get((array.shape, array.dtype)) or meta_of(array)
                else:  # a leaf: its data may have been replaced (weights), so read it
                    fn, nr = x._edge()
                    found = _metas.get((array.shape, array.dtype)) or meta_of(array)
                if n == 1:
                    node.next_nodes = (fn,)
                    node.input_nrs = ONE_NR[nr] if nr < 16 else (nr,)
                    node._input_meta = found
                else:
                    node.next_nodes = (fn, None)
                    node.input_nrs = NR_AND_ZERO[nr] if nr < 16 else (nr, 0)
                    node._input_meta = _and_none.get(found) or meta_and_none(found)
                if self.ufunc and dtype is found[0][1]:  # x's shape and dtype, so x's meta
                    node._output_meta = found
                    node.cost = 2 * array.size
                else:
                    node._output_meta = _metas.get((out.shape, dtype)) or meta_of(out)
                    node.cost = array.size + out.size
                node._released = False
                node.device = device
                node.sequence_nr = next_sequence_nr()
                node._hooks = None
                node._forward_trace = (anomaly.forward_trace()
                                       if anomaly.on and anomaly.mode.enabled else None)
                node.op = self
                node.params = params or NO_PARAMS
                node.output_counter = None
                if self.needs_values:
                    plan = self.plan_one
                    node.reads_output = plan.output
                    node.saved_ans = out if plan.output else None
                    if plan.mask & 1:  # x's values: the Tensor and its array apart, its version
                        node.saved_args = args
                        node.saved_arrays = held
                        node.saved_versions = saved_versions(args, plan.args)
                    else:  # the scalar's at most (not x's array: the node would keep it)
                        node.saved_args = node.saved_arrays = ((None, args[1]) if plan.mask
                                                               else _UNREAD[n])
                        node.saved_versions = ()
                else:
                    node.saved_args = node.saved_ans = None
                    node.saved_arrays = (ShapeOf(array),) if n == 1 else (ShapeOf(array), args[1])
                    node.saved_versions = ()
                    node.reads_output = False
        elif kind in LOSSY_KINDS:
            _refuse_lossy_mix(self.name, args, out.dtype)
        result = _new(Tensor)  # Tensor._make written out
        result.data = out
        result._device = device
        result._requires_grad = node is not None
        result.grad_fn = node
        result.output_nr = 0
        result._grad = result._accumulator = result._hooks = None
        result._view = None
        result._counter = None  # the node's output_counter once made (counter_of)
        if recorder.active:  # pargrad.capture records this thread or another
            _note(self, args, params, (result,), raw, "one" if one else "lean")
        return result

    # Every unusual operand's case in one place (views, devices, several outputs).
    def outputs(self, *args: Any, **params: Any) -> tuple[Tensor, ...]:  # noqa: C901
        """Like calling the op, but return every output (for ``multi_output`` ops)."""
        operands = tuple(_operand(a) for a in args)
        arrays = [array_of(a) for a in operands]
        try:
            out = self.forward(*arrays, **params)
        except (ValueError, IndexError, TypeError) as exc:
            raise _forward_error(self.name, exc, arrays, params) from exc
        outs = tuple(np.asarray(o) for o in out) if self.multi_output else (np.asarray(out),)
        on = params["device"] if self.moves_device else common_device(operands, self.name)
        node: OpNode | None = None
        if outs[0].dtype.kind == "f" and is_grad_enabled():
            for a in operands:
                if isinstance(a, Tensor) and a.requires_grad:
                    for b in operands:  # a view whose base changed may require grad now
                        if isinstance(b, Tensor) and b._view is not None:
                            refresh(b, recording=True)
                    node = self.node_type(self, operands, arrays, params, outs, on)
                    break
        elif outs[0].dtype.kind in LOSSY_KINDS and is_grad_enabled():
            _refuse_lossy_mix(self.name, operands, outs[0].dtype)
        tensors = tuple(Tensor._make(o, node, i, on) for i, o in enumerate(outs))
        if self.view and operands and isinstance(operands[0], Tensor):
            source = operands[0]
            owner = memory.owner(source.data)
            for i, t in enumerate(tensors):
                if memory.owner(t.data) is owner:  # a view of the source's memory
                    t._counter = counter_of(source)
                    t._view = view_of(source, (self, params, i))
        if node is not None and node.reads_output and len(tensors) > 1:
            # Output 0's counter is the node's output_counter, made on first use.
            node.saved_versions += saved_versions(tensors, range(1, len(tensors)),
                                                  outputs=True)
        if recorder.active:  # pargrad.capture records this thread or another
            _note(self, operands, params, tensors, not self.multi_output and (
                type(out) is not np.ndarray), "outputs")
        return tensors


_new = object.__new__


def _note(op: Op, args: tuple[Any, ...], params: dict[str, Any], tensors: tuple[Tensor, ...],
          raw: bool, path: str) -> None:
    """Tell the calling thread's recording (pargrad.capture) of an op call, made by
    ``path`` (``"one"``, ``"lean"``: ``Op.call``'s paths; ``"outputs"``); a call that no
    recording of its thread notes made tensors the others cannot replay."""
    found = recorder.current()
    if found is not None:
        found.note_op(op, args, params, tensors, raw, path)
    if found is None or recorder.active > 1:
        for t in tensors:
            recorder.note_made(t)

NO_PARAMS: dict[str, Any] = {}
"""The parameters of an op called without any: one shared dict, never written."""

# Interned metadata: nodes of arrays alike share their metadata tuples instead of each
# holding tuples of their own (fewer objects for the garbage collector to visit, on every
# node). The hot paths look a cache up themselves (``cache.get(key) or ...``) and call
# these only to make what is missing. Each cache is emptied past _METAS_MAX entries; a
# race between threads only interns one tuple twice.
_METAS_MAX = 4096
_metas: dict[tuple[tuple[int, ...], np.dtype], tuple[Meta]] = {}
"""``(shape, dtype)`` -> ``((shape, dtype),)``: an output's metadata, an argument's."""
_input_metas: dict[tuple[Meta | None, ...], tuple[Meta | None, ...]] = {}
"""``_input_meta`` tuples (``(meta, None)`` for an array times a scalar...)."""
_and_none: dict[tuple[Meta], tuple[Meta | None, ...]] = {}
"""``(meta,)`` -> ``(meta, None)``: an array-and-scalar call's ``_input_meta``
(``OpNode.record_one``)."""

_K = TypeVar("_K")
_V = TypeVar("_V")


def _intern(cache: dict[_K, _V], key: _K, value: _V) -> _V:
    """``cache[key]``, which is ``value`` if it was missing."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= _METAS_MAX:
            cache.clear()
        found = cache[key] = value
    return found


def meta_of(array: np.ndarray) -> tuple[Meta]:
    """``((array.shape, array.dtype),)``, interned."""
    key = (array.shape, array.dtype)
    return _metas.get(key) or _intern(_metas, key, (key,))


def metas_of(metas: list[Meta | None]) -> tuple[Meta | None, ...]:
    """``tuple(metas)``, interned."""
    key = tuple(metas)
    return _input_metas.get(key) or _intern(_input_metas, key, key)


def meta_and_none(found: tuple[Meta]) -> tuple[Meta | None, ...]:
    """``(meta, None)`` for ``found``, ``(meta,)``; interned."""
    return _and_none.get(found) or _intern(_and_none, found, metas_of([found[0], None]))


_UNREAD = tuple((None,) * n for n in range(8))


def _only(values: Sequence[Any], mask: int) -> tuple[Any, ...]:
    """``values`` with those the rules do not read (bit ``i`` of ``mask`` clear) as None:
    a node keeps no array it will not read (``x * 2`` keeps 2, not ``x``'s array)."""
    if not mask:
        return unread(len(values))
    if mask == (1 << len(values)) - 1:
        return tuple(values)
    return tuple([v if mask >> i & 1 else None for i, v in enumerate(values)])


def unread(n: int) -> tuple[None, ...]:
    """What a node keeps of ``n`` arguments whose values its rules do not read."""
    return _UNREAD[n] if n < len(_UNREAD) else (None,) * n


LOSSY_KINDS = frozenset("cOSUVMm")
"""numpy dtype kinds that a float gradient cannot flow through: complex, object, bytes,
str, void, datetime and timedelta. (Bool and integer results, of comparisons and
``argmax``, are not differentiable by definition and pass.)"""


def _refuse_lossy_mix(name: str, operands: Sequence[Any], dtype: np.dtype) -> None:
    """Raise if a Tensor that requires grad went into a result of a ``LOSSY_KINDS``
    dtype: recording no node would silently drop that gradient path (docs/ops.md)."""
    if not any(isinstance(a, Tensor) and a.requires_grad for a in operands):
        return
    kinds = [np.asarray(array_of(a)).dtype for a in operands]
    culprits = [f"argument {i} ({k})" for i, k in enumerate(kinds) if k.kind in LOSSY_KINDS]
    how = f"was mixed with {', '.join(culprits)}, giving" if culprits else "became"
    raise TypeError(
        f"{name}: a float Tensor that requires grad {how} dtype {dtype}; pargrad "
        f"differentiates real floating-point data only, so its gradient path would be "
        f"lost. Convert the other operand to a float array (e.g. take .real, or "
        f".astype(np.float64)), or detach the Tensor if no gradient is wanted"
    )


def _reads(rule: Rule) -> tuple[bool, frozenset[int] | None]:
    """Whether ``rule(g, ans, *args)`` reads ``ans``, and which ``args`` it reads (None:
    maybe any), from the names its own code loads. Sound, not exact: a name that is
    loaded counts as read, even for its shape only.
    """
    if not isinstance(rule, types.FunctionType) or rule.__code__.co_flags & inspect.CO_VARARGS:
        return True, None  # a bound method's names are shifted by self; and so on
    code = rule.__code__
    names = code.co_varnames[:code.co_argcount]
    loaded = set(code.co_cellvars)  # captured by an inner function: count as read
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_FAST"):
            loaded.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
    return names[1] in loaded, frozenset(i for i, n in enumerate(names[2:]) if n in loaded)


def array_of(x: Any) -> Any:
    """The array behind a Tensor; anything else as it is."""
    return x.data if isinstance(x, Tensor) else x


def ndim_of(x: Any) -> int:
    """The number of dimensions of a Tensor or array-like."""
    return int(np.ndim(array_of(x)))


def normalize_axis(axis: Any, ndim: int, op: str) -> int:
    """One axis as numpy accepts it (negative counts from the end) -> a non-negative int.

    Raises TypeError for a non-integer and ValueError for an axis out of bounds, both
    naming ``op``.
    """
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{op}: axis must be an integer, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} is out of bounds for {ndim} dimensions")
    return int(axis) % ndim


def normalize_axes(axes: Any, ndim: int, op: str) -> tuple[int, ...]:
    """An axis or a sequence of axes -> a tuple of non-negative ints without repeats."""
    items = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    out = tuple(normalize_axis(a, ndim, op) for a in items)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: repeated axis in {axes!r}")
    return out


def _operand(a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        if any(isinstance(item, Tensor) for item in a):
            raise TypeError(
                "a list of Tensors is not an operand: its gradients would be lost; combine "
                "them with pargrad.stack or pargrad.concatenate first"
            )
        return np.asarray(a)
    return a


def _describe(a: Any) -> str:
    if isinstance(a, np.ndarray):
        return f"array of shape {a.shape} and dtype {a.dtype}"
    return repr(a)


def _forward_error(
    name: str, exc: Exception, arrays: Sequence[Any], params: dict[str, Any]
) -> Exception:
    operands = "; ".join(_describe(a) for a in arrays)
    extra = "".join(f", {k}={v!r}" for k, v in params.items())
    text = str(exc).removeprefix(f"{name}: ")  # numpy's own may name the op already
    message = f"{name}: {text} (operands: {operands}{extra})"
    kind = next(k for k in (ValueError, IndexError, TypeError) if isinstance(exc, k))
    return kind(message)


class ShapeOf:
    """What a rule may read of an argument whose values it does not need."""

    __slots__ = ("dtype", "shape")

    def __init__(self, array: np.ndarray) -> None:
        self.shape = array.shape
        self.dtype = array.dtype


class OpNode(Node):
    """The backward node of one op call.

    Saves the arrays that the rules that will run read (``Op.plan``), arguments and
    output, as they were in the forward (or only shapes, for ops that need no values),
    so replacing a tensor's ``.data`` later does not change its gradient, and the
    versions of those tensors, so that changing one in place before the backward is an
    error (pargrad/versions.py). With ``create_graph`` the rules differentiate through
    the argument Tensors themselves, which must still hold those arrays.
    """

    __slots__ = ("op", "output_counter", "params", "reads_output", "saved_ans", "saved_args",
                 "saved_arrays", "saved_versions")

    def __init__(
        self, op: Op, args: Sequence[Any], arrays: Sequence[Any], params: dict[str, Any],
        outs: tuple[np.ndarray, ...], device: Device,
    ) -> None:
        self.record(op, args, arrays, params, outs, device)

    # Run for every recorded op but the most common calls (record_one): one pass over the
    # arguments, no helper calls but _keep.
    def record(  # noqa: PLR0915
        self, op: Op, args: Sequence[Any], arrays: Sequence[Any], params: dict[str, Any],
        outs: tuple[np.ndarray, ...], device: Device,
    ) -> None:
        """``__init__``'s work, which ``Op.__call__`` calls on ``object.__new__(cls)``
        (0.2 µs less per op call than ``cls(...)``)."""
        # Node.__init__ written out, with the edges made in the same pass: this runs once
        # per op call. Operands that are views were refreshed by ``Op.outputs``.
        nodes: list[Node | None] = []
        nrs: list[int] = []
        metas: list[Meta | None] = []
        live = 0  # bit i: argument i gets a gradient
        tensors = 0  # bit i: argument i is a Tensor
        bit = 1
        cost = 0
        found: tuple[Meta, ...] | None = None
        for a in args:
            if isinstance(a, Tensor):
                tensors |= bit
                if a._requires_grad:
                    fn = a.grad_fn
                    array = a.data
                    if fn is None:  # a leaf (or a view): its edge
                        fn, nr = a._edge()
                        found = _metas.get((array.shape, array.dtype)) or meta_of(array)
                    else:  # as in Op.call: its node's record of it, if its only output
                        nr = a.output_nr
                        found = fn._output_meta
                        if nr or len(found) != 1:
                            found = _metas.get((array.shape, array.dtype)) or meta_of(array)
                    nodes.append(fn)
                    nrs.append(nr)
                    metas.append(found[0])
                    cost += array.size
                    live |= bit
                    bit <<= 1
                    continue
            nodes.append(None)
            nrs.append(0)
            metas.append(None)
            bit <<= 1
        if live >> op.ruled:  # fail in the forward, where the call is visible
            missing = next(i for i in range(op.ruled, len(args)) if live >> i & 1)
            raise TypeError(f"{op.name}: no gradient rule for argument {missing}")
        self.next_nodes = tuple(nodes)
        found_nrs = tuple(nrs)
        self.input_nrs = SHARED_NRS.get(found_nrs, found_nrs)  # input_nrs_of, inline
        # One argument: its interned ``(meta,)`` is the tuple of input metadata.
        self._input_meta = (found if found is not None and live == 1 and bit == 2
                            else metas_of(metas))
        self._keep(op, args, arrays, params, outs, device, live, tensors, cost)

    def _keep(
        self, op: Op, args: Sequence[Any], arrays: Sequence[Any], params: dict[str, Any],
        outs: tuple[np.ndarray, ...], device: Device, live: int, tensors: int, cost: int,
    ) -> None:
        """The rest of ``record``: the outputs' metadata, the node's bookkeeping, and what
        its rules will read (``live``, ``tensors``: bit i for argument i having an edge,
        being a Tensor; ``cost``: the arguments' elements with an edge)."""
        if len(outs) == 1:
            out = outs[0]
            cost += out.size
            self._output_meta = _metas.get((out.shape, out.dtype)) or meta_of(out)
        else:
            cost += sum(o.size for o in outs)
            self._output_meta = tuple([(o.shape, o.dtype) for o in outs])
        self.cost = cost
        self._released = False
        self.device = device
        self.sequence_nr = next_sequence_nr()
        self._hooks = None
        self._forward_trace = (anomaly.forward_trace() if anomaly.on and anomaly.mode.enabled
                               else None)
        self.op = op
        self.params = params
        self.output_counter: VersionCounter | None = None
        if op.needs_values:
            # Only what the rules that will run read, and the versions of the Tensors
            # among it: arguments' now, outputs' (Op.__call__, Op.outputs) once their
            # tensors exist. Arguments they do not read are kept as None.
            plan = op._plans.get(live) or op.plan(live)
            self.reads_output = plan.output
            # The ``ans`` its rules get: the output, or the tuple of a multi-output op's.
            self.saved_ans: Any = (None if not plan.output else outs if op.multi_output
                                   else outs[0])
            mask = plan.mask
            if mask & tensors:  # the values of Tensors: the arrays apart
                if mask == (1 << len(args)) - 1:  # every one read (x * w): no _only calls
                    self.saved_args: tuple[Any, ...] | None = tuple(args)
                    self.saved_arrays: tuple[Any, ...] | None = tuple(arrays)
                else:
                    self.saved_args = _only(args, mask)
                    self.saved_arrays = _only(arrays, mask)
                self.saved_versions: Saved = saved_versions(args, plan.args)
            else:  # scalars and plain arrays at most, each its own array
                self.saved_args = self.saved_arrays = _only(arrays, mask)
                self.saved_versions = ()
        else:
            self.saved_args = None
            self.saved_arrays = tuple([ShapeOf(a) if isinstance(a, np.ndarray) else a
                                       for a in arrays])
            self.saved_ans = None
            self.saved_versions = ()
            self.reads_output = False

    def name(self) -> str:
        return self.op.node_name

    @property
    def saved_outputs(self) -> tuple[np.ndarray, ...] | None:
        """The outputs saved for the rules (None if they read none, or once freed)."""
        ans = self.saved_ans
        return None if ans is None else ans if self.op.multi_output else (ans,)

    def _check_versions(self) -> None:
        """Raise ``BackwardError`` if a tensor this node saved was changed in place since:
        an argument or output (``saved_versions``), or the output whose counter
        ``output_counter`` is (made at version 0 on the output's first in-place change or
        save, by ``counter_of``; None while it has none)."""
        check(self.op.node_name, self.saved_versions)
        counter = self.output_counter
        if counter is not None and counter.value:
            outs = self.saved_outputs
            assert outs is not None
            changed(self.op.node_name, SavedVersion(-1, counter, 0, outs[0]))

    def _free_saved(self) -> bool:
        if not self.op.needs_values:
            return False
        self.saved_args = self.saved_arrays = self.saved_ans = None
        self.saved_versions = ()
        return True

    # Run for every node of a backward: the lean path kept in one frame.
    def apply(self, grads: Sequence[Grad | None], *, retain_graph: bool) -> list[Grad | None]:  # noqa: C901, PLR0912, PLR0915
        """``Node.apply``, with a lean path for the common case: one output whose gradient
        is a plain array, no hooks, values not freed, no graph of the backward recorded,
        anomaly mode off. The rules run directly; each gradient that is an array of its
        input's dtype is taken as it is, summed back to the input's shape if the forward
        broadcast it (``sum_to``); anything else goes through ``Node.apply``'s checks,
        which raise the errors."""
        g = grads[0]
        args = self.saved_arrays
        op = self.op
        rules = op.direct_rules
        if (rules is None or type(g) is not np.ndarray or self._hooks is not None
                or args is None or (anomaly.on and anomaly.mode.enabled)
                or not grad_mode.off or grad_mode.mode.enabled):
            return Node.apply(self, grads, retain_graph=retain_graph)
        counter = self.output_counter
        if self.saved_versions or (counter is not None and counter.value):
            self._check_versions()
        ans = self.saved_ans  # one output (direct_rules: not a multi-output op)
        params = self.params
        cut = op.cut_rules
        stream = op.stream_rules
        # In chunks, helped by idle threads (g is an array: checked above).
        chunked = bool(cut or stream) and g.size >= parallel.min_elements_
        results: list[Grad | None] = []
        metas = self._input_meta
        fits = True
        i = 0
        try:
            for next_node in self.next_nodes:
                if next_node is None:
                    results.append(None)
                    i += 1
                    continue
                r = None
                if chunked and i in cut:
                    r = elementwise(rules[i], (g, ans, *args), params)
                elif chunked and i in stream:
                    r = elementwise(rules[i], (g, ans, *args), params, streaming=True)
                if r is None:
                    r = rules[i](g, ans, *args, **params) if params else rules[i](g, ans, *args)
                if fits:
                    meta = metas[i]
                    fits = type(r) is np.ndarray and (r.dtype is meta[1]  # type: ignore[index]
                                                      or r.dtype == meta[1])  # type: ignore[index]
                    if fits and r.shape != meta[0]:  # type: ignore[index]
                        # Broadcast in the forward: summed back here (None: it does not
                        # fit, and _check raises the error).
                        summed = sum_to(r, meta[0])  # type: ignore[index]
                        if summed is None:
                            fits = False
                        else:
                            r = summed
                results.append(r)
                i += 1
        except BackwardError:
            raise
        except Exception as exc:
            raise BackwardError(op.node_name, f"{type(exc).__name__}: {exc}") from exc
        if not fits:
            results = self._check(results)
        if not retain_graph and op.needs_values:  # _free_saved, inline
            self.saved_args = self.saved_arrays = self.saved_ans = None
            self.saved_versions = ()
            self._released = True
        return results

    def backward(self, grads: tuple[Grad, ...]) -> list[Grad | None]:
        assert self.saved_arrays is not None
        self._check_versions()
        args: tuple[Any, ...] = self.saved_arrays
        outs: tuple[Any, ...] | None = self.saved_outputs
        if self.saved_args is not None and is_grad_enabled():
            # Recording a graph of this backward: differentiate through the saved
            # Tensors themselves, and through outputs rebuilt around this very node.
            check_saved_data(self.saved_args, args, "argument")
            args = self.saved_args
            if outs is not None:
                # With the counters the outputs have (output 0's: counter_of finds it).
                rebuilt = [Tensor._make(o, self, i) for i, o in enumerate(outs)]
                for record in self.saved_versions:
                    if record.where < 0:
                        rebuilt[-1 - record.where]._counter = record.counter
                outs = tuple(rebuilt)
        g = grads if self.op.multi_output else grads[0]
        ans = outs if outs is None or self.op.multi_output else outs[0]
        return [
            None if next_node is None else self.op.vjp(i, g, ans, args, self.params)
            for i, next_node in enumerate(self.next_nodes)
        ]


class BlasOpNode(OpNode):
    """The backward node of an op whose rules run BLAS (``Op(calls_blas=True)``)."""

    __slots__ = ()
    calls_blas = True


def defop(name: str, forward: Callable[..., Any], *rules: Rule, **options: Any) -> Op:
    """Define an op from its numpy forward and one gradient rule per positional argument.

    An op whose forward is a numpy ufunc also serves that ufunc called on Tensors.
    Options: ``argnum_rule``, ``multi_output``, ``needs_values``, ``calls_blas``, ``view``,
    ``cut``, ``doc`` (see ``Op``).
    """
    op = Op(name, forward, rules, **options)
    if isinstance(forward, np.ufunc):
        UFUNC_OPS[forward] = op
        UFUNC_CALLS[forward] = op.call
    return op


# Ufuncs whose result never carries a gradient (comparisons, logic, bits, rounding, sign).
CONSTANT_UFUNCS = frozenset({
    np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal,
    np.logical_and, np.logical_or, np.logical_not, np.logical_xor,
    np.bitwise_and, np.bitwise_or, np.bitwise_xor, np.invert,
    np.isfinite, np.isinf, np.isnan, np.sign, np.floor, np.ceil, np.rint, np.trunc,
})


def implements(*numpy_functions: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Register a pargrad function as the implementation of numpy functions on Tensors."""

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        for np_func in numpy_functions:
            if isinstance(np_func, np.ufunc):
                UFUNC_OPS[np_func] = func
                UFUNC_CALLS.pop(np_func, None)
            else:
                FUNCTION_OPS[np_func] = func
        return func

    return register


# Numpy functions whose result carries no gradient (indices, counts, truth values): on
# Tensors they return what they return on the Tensors' arrays.
PLAIN_FUNCTIONS = frozenset({
    np.argsort, np.argwhere, np.nonzero, np.flatnonzero, np.count_nonzero, np.searchsorted,
    np.all, np.any, np.isclose, np.allclose, np.array_equal, np.shape, np.ndim, np.size,
})


def _plain(value: Any) -> Any:
    """A Tensor's array, also inside a list or tuple; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return array_of(value)


def constant(ufunc: Callable[..., Any], *args: Any) -> Tensor:
    """Apply a numpy function to the arrays of ``args``; the result needs no gradient."""
    on = common_device(args, getattr(ufunc, "__name__", "constant"))
    out = Tensor._make(np.asarray(ufunc(*(array_of(a) for a in args))), device=on)
    if recorder.active and (found := recorder.current()) is not None:
        found.note_call(ufunc, args, out)  # replayed: the values depend on the operands'
    return out


def dispatch_ufunc(
    ufunc: np.ufunc, method: str, inputs: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``Tensor.__array_ufunc__``: route a numpy ufunc call to the matching op."""
    if method == "__call__" and not kwargs:
        op = UFUNC_OPS.get(ufunc)
        if op is not None:
            return op(*inputs)
        if ufunc in CONSTANT_UFUNCS:
            return constant(ufunc, *inputs)
    outs = kwargs.get("out") or ()
    if method == "__call__" and outs and not any(isinstance(o, Tensor) for o in outs):
        # ``v.data -= lr * v.grad`` lands here
        raise TypeError(
            f"numpy.{ufunc.__name__} cannot write into a numpy array (out=, or an in-place "
            f"operator on tensor.data) from a Tensor operand; update the Tensor itself: "
            f"`with pargrad.no_grad(): v -= lr * v.grad` (its version counter sees the "
            f"change), or use plain arrays on both sides: `v.data -= lr * v.grad.data`"
        )
    raise TypeError(
        f"pargrad Tensors do not support numpy.{ufunc.__name__}"
        f"{'' if method == '__call__' else '.' + method}"
        f"{' with ' + ', '.join(kwargs) if kwargs else ''}; call it on tensor.numpy() "
        f"(no gradient) or use a pargrad op"
    )


def dispatch_function(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``Tensor.__array_function__``: route a numpy function call to the matching op."""
    impl = FUNCTION_OPS.get(func)
    name = getattr(func, "__name__", repr(func))
    if impl is None and func in PLAIN_FUNCTIONS:
        if recorder.active:
            recorder.fail(f"numpy.{name} reads a tensor's values back into numpy")
        return func(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
    if impl is None:
        raise TypeError(
            f"pargrad Tensors do not support numpy.{name}; call it on tensor.numpy() "
            f"(no gradient) or use a pargrad op"
        )
    try:
        return impl(*args, **kwargs)
    except TypeError:
        signature = inspect.signature(impl)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:  # the call itself did not fit: say what does
            raise TypeError(
                f"numpy.{name} on pargrad Tensors takes only {name}{signature}: {exc}"
            ) from None
        raise
