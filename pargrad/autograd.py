"""``pargrad.backward`` and ``pargrad.grad``: check the roots, run an engine, hand back
the gradients (``grad``) or commit them to ``.grad`` (``backward``); ``backward_async``
and ``grad_async`` do the same behind a future (docs/async.md).

All-or-nothing: leaf gradients are committed to ``.grad`` only after the engine has
finished the whole graph, so a backward that raises leaves every ``.grad`` as it was.
The one exception, a leaf with post-accumulate-grad hooks, is committed as soon as its
gradient is final (so that its hooks can run during the backward) and restored if the
backward then fails, unless another backward has committed into that leaf meanwhile
(then it stays: ``_EarlyCommits.undo``). Such a hook may also take part in that
undo: ``queue_undo(fn)`` runs ``fn`` if the backward fails (an optimizer's updates
during backward, pargrad/optim/in_backward.py). A commit that raises is undone as a
failed backward is, by ``backward`` and ``backward_async`` alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pargrad import memory
from pargrad.engine.base import BackwardRequest, Engine
from pargrad.engine.buffer import accumulate
from pargrad.engine.selection import current_engine
from pargrad.futures import BackwardFuture
from pargrad.grad_mode import enable_grad, no_grad
from pargrad.graph import AccumulateGrad, BackwardError, Edge, Grad
from pargrad.interrupts import HELD, NODE, deferred_interrupts, gate_installed
from pargrad.ops import copy
from pargrad.replay import recorder
from pargrad.tensor import Tensor, bind_backward, grad_lock
from pargrad.versions import counter_of

if TYPE_CHECKING:
    from pargrad.hooks import NodeHooks


def backward(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Tensor | Sequence[Tensor] | None = None,
    *,
    engine: Engine | None = None,
) -> None:
    """Accumulate the gradients of ``tensors`` into ``.grad`` of the leaves they depend on.

    ``grad_tensors`` gives d(loss)/d(tensor) for each tensor (one per tensor, or a single
    one for a single tensor); it may be omitted, or None for an entry, only for tensors
    with one element. Blocks until the backward is done; thread-safe for independent
    graphs. ``retain_graph`` (default: ``create_graph``) keeps saved values for another
    backward; ``create_graph=True`` records the backward so that it can be differentiated.
    ``inputs`` (tensors, leaves or not) restricts accumulation to their ``.grad``, and
    runs only the nodes on a path to them. Non-leaf tensors marked with ``retain_grad``
    get their ``.grad`` too.

    Raises TypeError/ValueError/RuntimeError for bad roots or gradients, and
    ``BackwardError`` (naming the node, original exception chained) if a node fails;
    in both cases no ``.grad`` is changed (a post-accumulate-grad hook that ran is not
    undone unless it queued its own undo with ``queue_undo``, but the ``.grad`` it saw
    is restored).

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> pargrad.backward((x ** 2).sum())
    >>> x.grad
    tensor([2., 4., 6.], dtype=float64)
    """
    _run(_BackwardCall(tensors, grad_tensors, retain_graph, create_graph, inputs, engine))


def tensor_backward(tensor: Tensor, gradient: Any, retain_graph: bool | None,
                    create_graph: bool, inputs: Tensor | Sequence[Tensor] | None,
                    engine: Engine | None) -> None:
    """``Tensor.backward``: ``backward(tensor, gradient, ...)``, whose messages then name
    the method's parameter (``gradient=``)."""
    _run(_BackwardCall(tensor, [gradient], retain_graph, create_graph, inputs, engine,
                       caller="Tensor.backward"))


def _run(call: _BackwardCall) -> None:
    # SIGINT's handler is swapped once for the whole call (interrupts.gate_installed),
    # not once by the engine and again by the commit: the engine runs in NODE mode (a
    # Ctrl-C raises at once, as with no gate; ThreadedEngine holds it around its own
    # bookkeeping, without a swap), the commit and the undo in HELD mode.
    with gate_installed(NODE) as gate:
        try:
            kept = call.engine.execute(call.request())
            gate.mode = HELD  # the commit held whole (a Ctrl-C in it raises after it), and
            call.commit(kept)  # the block left held: a Ctrl-C raised on __exit__'s first
        except BaseException:  # bytecode would skip putting the previous handler back
            gate.mode = HELD  # (no signal point before this line)
            call.early.undo()  # the commit failed too: no .grad changed, early ones undone
            raise


def backward_async(
    tensors: Tensor | Sequence[Tensor],
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Tensor | Sequence[Tensor] | None = None,
    *,
    engine: Engine | None = None,
) -> BackwardFuture[None]:
    """Start ``backward(...)`` and return a ``concurrent.futures.Future`` of it.

    On a ``ThreadedEngine`` it returns at once and the engine's workers run the
    backward; the calling thread may go on (prepare the next batch) and wait later with
    ``future.result()``, which then helps run it. ``SequentialEngine`` runs it to the end
    first and returns a future that is done. The future resolves with None once every
    ``.grad`` is committed; a leaf's post-accumulate-grad hooks run earlier, as soon as
    its gradient is final: on an engine thread, or, for a leaf passed as one of the
    ``tensors`` itself, on the calling thread inside this call. Bad arguments raise here, as in
    ``backward``; a failing node's ``BackwardError`` goes to the future (also one raised
    by the hook of a leaf passed as a root), and then, as after ``future.cancel()``, no
    ``.grad`` is changed (except: an early commit into a leaf that another backward has
    committed to since is kept, see ``_EarlyCommits.undo``). Thread-safe. docs/async.md
    says what hooks and done-callbacks may do.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> future = pargrad.backward_async((x ** 2).sum())
    >>> future.result(timeout=10)
    >>> x.grad
    tensor([2., 4., 6.], dtype=float64)
    """
    call = _BackwardCall(tensors, grad_tensors, retain_graph, create_graph, inputs, engine)
    try:  # a root that is a leaf with hooks is committed early, on this thread
        future = call.engine.execute_async(call.request())
    except BaseException:
        call.early.undo()
        raise
    return future._then(call.commit, call.early.undo)


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
    *,
    engine: Engine | None = None,
) -> tuple[Tensor | None, ...]:
    """Return the gradients of ``outputs`` with respect to ``inputs``; touch no ``.grad``.

    Only the nodes on a path from the outputs to the inputs run. ``inputs`` may be
    leaves or not; the result has one entry per input. ``grad_outputs``,
    ``retain_graph`` and ``create_graph`` are as ``backward``'s ``grad_tensors``,
    ``retain_graph`` and ``create_graph`` (with ``create_graph`` the gradients have a
    graph of their own). An input that gets no gradient (not used to compute the
    outputs) raises RuntimeError unless ``allow_unused=True``; its entry is then None,
    or zeros with ``materialize_grads=True`` (which implies ``allow_unused``). Blocks
    until done; thread-safe. Errors as ``backward``'s.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> y = x * x
    >>> pargrad.grad(y.sum(), [x, y])
    (tensor([2., 4.], dtype=float64), tensor([1., 1.], dtype=float64))
    >>> x.grad is None
    True
    """
    call = _GradCall(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
                     materialize_grads, engine)
    return call.results(call.engine.execute(call.request()))


def grad_async(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
    *,
    engine: Engine | None = None,
) -> BackwardFuture[tuple[Tensor | None, ...]]:
    """Start ``grad(...)`` and return a ``concurrent.futures.Future`` of its result.

    Returns at once on a ``ThreadedEngine`` (as ``backward_async``); the future
    resolves with the tuple ``grad`` returns, or carries its error (an unused input's
    RuntimeError too). Bad arguments raise here. Thread-safe.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> pargrad.grad_async((x * x).sum(), [x]).result(timeout=10)
    (tensor([2., 4.], dtype=float64),)
    """
    call = _GradCall(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
                     materialize_grads, engine)
    future = call.engine.execute_async(call.request())
    return future._then(call.results, lambda: None)


class _Call:
    """What a call of ``backward`` or ``grad`` (or their async forms) hands an engine,
    once its subclass has checked the arguments (each in its own order)."""

    def _set(self, roots: tuple[Tensor, ...], grads: list[Grad], retain_graph: bool | None,
             create_graph: bool, engine: Engine | None) -> None:
        if recorder.active:
            recorder.fail("a backward or grad() runs inside the function")
        if engine is not None and not isinstance(engine, Engine):
            raise TypeError(f"engine= must be a pargrad Engine (e.g. pargrad.ThreadedEngine()), "
                            f"got {type(engine).__name__} {engine!r}")
        self.grads = grads
        self.roots = [t._edge() for t in roots]
        self.retain_graph = create_graph if retain_graph is None else bool(retain_graph)
        self.create_graph = create_graph
        self.engine = engine if engine is not None else current_engine()

    def _request(self, targets: list[Edge] | None,
                 on_kept: Callable[[Edge, Grad], bool] | None = None) -> BackwardRequest:
        """What ``Engine.execute`` / ``execute_async`` get."""
        return BackwardRequest(self.roots, self.grads, self.retain_graph, self.create_graph,
                               targets, on_kept)


class _BackwardCall(_Call):
    """One call of ``backward`` or ``backward_async``: its checked arguments, the early
    commits of its post-accumulate-grad leaves, and the commit of the rest."""

    def __init__(self, tensors: Any, grad_tensors: Any, retain_graph: bool | None,
                 create_graph: bool, inputs: Any, engine: Engine | None,
                 caller: str = "backward") -> None:
        create_graph = _flags(retain_graph, create_graph, "backward")
        roots = _as_tensors(tensors, "backward")
        grads = _root_grads(roots, grad_tensors, create_graph, caller)
        self.targets = None if inputs is None else _inputs(inputs, "backward")
        self._set(roots, grads, retain_graph, create_graph, engine)
        self.early = _EarlyCommits(create_graph)

    def request(self) -> BackwardRequest:
        """What ``Engine.execute`` / ``execute_async`` get."""
        targets = None if self.targets is None else [t._edge() for t in self.targets]
        return self._request(targets, self.early)

    def commit(self, kept: dict[Edge, Grad]) -> None:
        """Add what the engine kept to ``.grad`` (the whole backward succeeded).

        Atomic, also under Ctrl-C: every new ``.grad`` is computed first (an interrupt
        there publishes nothing), then published by a loop that only assigns new
        ``.grad`` tensors or adds into existing ones in place (``_adds_in_place``: no
        allocation, shapes checked, so it cannot fail midway), with SIGINT deferred to
        its end (``interrupts.deferred_interrupts``), all under ``grad_lock``, so no
        thread and no handler sees part of it."""
        receivers = {} if self.targets is None else {t._edge(): t for t in self.targets}
        with grad_lock:
            with enable_grad():
                updates = [(tensor, None, grad) if _adds_in_place(tensor, self.create_graph)
                           else (tensor, _added_to_grad(tensor, grad, self.create_graph), None)
                           for tensor, grad in _receivers(kept, receivers)]
            with deferred_interrupts():
                for tensor, value, addend in updates:
                    if value is not None:
                        tensor._grad = value
                    else:  # an existing .grad, summed into in place
                        _add_in_place(tensor._grad, addend)  # type: ignore[arg-type]
        self.early.settle()  # committed: nothing of it will be undone


class _GradCall(_Call):
    """One call of ``grad`` or ``grad_async``: its checked arguments and its results."""

    def __init__(self, outputs: Any, inputs: Any, grad_outputs: Any,
                 retain_graph: bool | None, create_graph: bool, allow_unused: bool | None,
                 materialize_grads: bool, engine: Engine | None) -> None:
        create_graph = _flags(retain_graph, create_graph, "grad")
        if materialize_grads and allow_unused is False:
            raise ValueError("grad: materialize_grads=True needs allow_unused=True (or unset)")
        self.allow_unused = materialize_grads if allow_unused is None else allow_unused
        self.materialize_grads = materialize_grads
        roots = _as_tensors(outputs, "grad")
        self.targets = _inputs(inputs, "grad")
        grads = _root_grads(roots, grad_outputs, create_graph, "grad")
        self._set(roots, grads, retain_graph, create_graph, engine)
        self.edges = [t._edge() for t in self.targets]

    def request(self) -> BackwardRequest:
        """What ``Engine.execute`` / ``execute_async`` get."""
        return self._request(self.edges)

    def results(self, kept: dict[Edge, Grad]) -> tuple[Tensor | None, ...]:
        """One gradient per input, from what the engine kept."""
        results: list[Tensor | None] = []
        for i, (target, edge) in enumerate(zip(self.targets, self.edges)):
            grad = kept.get(edge)
            if grad is None:
                if not self.allow_unused:
                    raise RuntimeError(
                        f"grad: inputs[{i}] got no gradient: it was not used to compute "
                        f"the outputs; pass allow_unused=True to get None for it"
                    )
                results.append(self._zeros(target) if self.materialize_grads else None)
            elif isinstance(grad, Tensor):
                results.append(grad)
            else:  # its own memory, as a .grad would be
                results.append(Tensor._make(memory.copy(grad), device=target.device))
        return tuple(results)


    def _zeros(self, target: Tensor) -> Tensor:
        """A materialized gradient: zeros, a leaf that requires grad with ``create_graph``
        (so it can be differentiated again, as PyTorch's)."""
        zeros = Tensor._make(np.zeros(target.shape, target.dtype), device=target.device)
        zeros._requires_grad = self.create_graph
        return zeros


class _EarlyCommits:
    """``on_kept`` for backward: commit a leaf whose accumulator has hooks (its leaf's
    post-accumulate-grad hooks, or the ``AccumulateGrad`` node's pre- and post-hooks) as
    soon as its gradient is final, running them in PyTorch's order: the node's pre-hooks
    (which may replace the gradient), the commit, the post-accumulate-grad hooks, the
    node's post-hooks (``hook((), (grad,))``). ``undo`` restores those ``.grad``s if the
    backward fails, after calling what the hooks queued with ``queue_undo``; ``settle``
    drops those once the backward has committed; ``pending`` tells which has happened
    (``undo_may_run``). Called on engine threads, concurrently for different leaves.
    """

    def __init__(self, create_graph: bool) -> None:
        self.create_graph = create_graph
        # Guards _done: (leaf, its .grad before, its .grad after) per early commit; and
        # _undo: the functions its hooks queued with queue_undo, in order.
        self._lock = threading.Lock()
        self._done: list[tuple[Tensor, Tensor | None, Tensor | None]] = []
        self._undo: list[Callable[[], object]] = []
        # False until the backward's outcome is final: committed (the queued functions
        # are dropped, unrun) or undone (they have run). Needs no lock: written once, by
        # the thread that finishes the backward (``settle``, or the end of ``undo``),
        # before it returns from ``backward`` or resolves the future, so whatever is
        # started after that sees it; read by ``pending``.
        self._settled = False

    def __call__(self, edge: Edge, grad: Grad) -> bool:
        node = edge[0]
        if not isinstance(node, AccumulateGrad):
            return False
        hooks = node._hooks
        if hooks is None or not (hooks.post_accumulate or hooks.pre or hooks.post):
            return False
        enclosing, _running.commits = _running.commits, self  # for queue_undo
        try:
            return self._commit(node, hooks, grad)
        finally:
            _running.commits = enclosing

    def _commit(self, node: AccumulateGrad, hooks: NodeHooks, grad: Grad) -> bool:
        if hooks.pre:
            (grad,) = node._run_pre_hooks(hooks, (grad,))
        leaf = node.variable
        with grad_lock, enable_grad():
            before = leaf._grad
            leaf._grad = after = _added_to_grad(leaf, grad, self.create_graph)
        with self._lock:
            self._done.append((leaf, before, after))
        for _, hook in hooks.post_accumulate:
            if node._call(hook, "post-accumulate-grad hook", leaf) is not None:
                raise BackwardError(node.name(), "a post-accumulate-grad hook returned a "
                                                 "value; post-accumulate-grad hooks should "
                                                 "return None")
        if hooks.post:  # PyTorch's AccumulateGrad hands the new .grad itself on, if any
            given = after if before is None else _as_tensor(grad, leaf)
            for _, hook in hooks.post:
                node._call(hook, "hook", (), (given,))
        return True

    def queue_undo(self, fn: Callable[[], object]) -> None:
        """Have ``undo`` call ``fn()`` (``queue_undo``'s work)."""
        with self._lock:
            self._undo.append(fn)

    def pending(self) -> bool:
        """Whether the functions queued by ``queue_undo`` may still run: the backward
        has neither committed nor been undone yet. Lock-free (see ``_settled``)."""
        return not self._settled

    def settle(self) -> None:
        """The backward has committed: the queued functions will never run."""
        with self._lock:
            self._undo = []
        self._settled = True

    def undo(self) -> None:
        """Call the functions queued by ``queue_undo``, newest first, then restore the
        ``.grad`` of each leaf committed early, unless another backward (or a ``.grad``
        assignment) has replaced it since: then the early commit stays in it, mixed with
        the other contribution. Subtracting it back out instead would not restore the
        value exactly in floating point (nor undo a ``.grad`` a hook set), so a failed or
        cancelled backward is all-or-nothing only for leaves nobody else committed to
        meanwhile (docs/async.md).

        Every queued function is called even if one raises; the first exception is
        raised once the ``.grad``s are restored. Called once no node or hook of the
        backward runs any more."""
        with deferred_interrupts():  # all undone, or none
            with self._lock:
                queued, self._undo = self._undo, []
            failure = _call_all(reversed(queued))
            with grad_lock, self._lock:
                for leaf, before, after in reversed(self._done):
                    if leaf._grad is after:  # else another backward has added to it since
                        leaf._grad = before
            self._settled = True
        if failure is not None:
            raise failure


def _call_all(functions: Iterable[Callable[[], object]]) -> BaseException | None:
    """Call each of ``functions``; return the first exception one raised, if any."""
    failure: BaseException | None = None
    for fn in functions:
        try:
            fn()
        except BaseException as exc:  # the rest still run: each undoes its own part
            failure = exc if failure is None else failure
    return failure


class _Running(threading.local):
    """Per thread, so no lock: ``commits``, the ``_EarlyCommits`` whose hooks this thread
    runs now (None outside them; a backward nested in a hook puts the outer one back)."""

    commits: _EarlyCommits | None = None


_running = _Running()


def queue_undo(fn: Callable[[], object]) -> None:
    """Call ``fn()`` if the backward whose post-accumulate-grad hook is running fails.

    For a hook whose effects must not outlive a failed (or cancelled) backward: call
    ``queue_undo`` with the function that puts back what the hook changes, *before*
    changing it. If the backward then fails (a later node or hook raises, a callback
    raises, the commit raises or is interrupted, ``future.cancel()``), the queued
    functions run, newest first, once no node or hook of it runs any more, on the thread
    that finishes the backward; then the ``.grad``s committed early are restored (so a
    function that puts back the ``.grad`` its hook cleared lets that restore see it).
    If the backward succeeds they are dropped, unrun. A function should not raise: if
    one does, the others still run and its exception is raised from the backward call,
    with the backward's own error as its context. After ``future.cancel()`` (which
    still returns True) the future then resolves with that exception, its context a
    ``concurrent.futures.CancelledError``, instead of being cancelled: ``cancelled()``
    is False. SIGINT waits until they have all run.

    ``undo_may_run()`` tells later whether ``fn`` may still run.

    Call it from a post-accumulate-grad hook (or a hook of a leaf's
    ``AccumulateGrad``) during ``backward`` / ``backward_async``; raises RuntimeError
    elsewhere, TypeError if ``fn`` is not callable. Thread-safe.

    >>> import pargrad
    >>> from pargrad.autograd import queue_undo
    >>> w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> log = []
    >>> def hook(t):
    ...     queue_undo(lambda: log.append("undone"))
    ...     log.append("changed")
    >>> _ = w.register_post_accumulate_grad_hook(hook)
    >>> (w * 2).sum().backward()                 # succeeds: nothing undone
    >>> def fail():
    ...     raise ValueError("late failure")
    >>> _ = w.register_hook(lambda g: pargrad.queue_callback(fail))
    >>> try:
    ...     (w * 2).sum().backward()             # fails after the hook ran
    ... except ValueError:
    ...     pass
    >>> log
    ['changed', 'changed', 'undone']
    """
    if not callable(fn):
        raise TypeError(f"queue_undo takes a callable, got {type(fn).__name__}")
    _running_commits("queue_undo").queue_undo(fn)


def undo_may_run() -> Callable[[], bool]:
    """A function that tells whether what the hooks of the running backward queue with
    ``queue_undo`` may still run: True until that backward has committed (the queued
    functions are dropped) or has been undone (they have run). Lock-free.

    For a hook that keeps what its undo puts back from one backward to the next: before
    a later backward overwrites it, ask the function the earlier backward gave
    (``Optimizer.step_in_backward`` does). Call it where ``queue_undo`` may be called;
    raises RuntimeError elsewhere.

    >>> import pargrad
    >>> from pargrad.autograd import undo_may_run
    >>> w = pargrad.tensor([1.0], requires_grad=True)
    >>> asked = []
    >>> _ = w.register_post_accumulate_grad_hook(lambda t: asked.append(undo_may_run()))
    >>> (w * 2).sum().backward()
    >>> asked[0]()                   # inside the hook it said True; committed now
    False
    """
    return _running_commits("undo_may_run").pending


def _running_commits(caller: str) -> _EarlyCommits:
    """The ``_EarlyCommits`` whose hooks this thread runs; RuntimeError if none."""
    commits = _running.commits
    if commits is None:
        raise RuntimeError(f"{caller} can only be called from a post-accumulate-grad hook "
                           f"(or a hook of a leaf's AccumulateGrad) during backward")
    return commits


def reset_grad(leaf: Tensor, set_to_none: bool = True) -> None:
    """Reset ``leaf.grad``: to None, or with ``set_to_none=False`` to zeros in place (as
    PyTorch's ``zero_grad`` does): the ``.grad`` stays the same Tensor, made a leaf that
    does not require grad (one from ``create_graph=True`` is cut off from its graph
    with ``detach_()``), and zeroed. What ``Module.zero_grad`` and
    ``Optimizer.zero_grad`` do to each parameter."""
    grad = leaf.grad
    if set_to_none or grad is None:
        leaf.grad = None
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    with no_grad():
        grad.zero_()


def _as_tensor(grad: Grad, like: Tensor) -> Tensor:
    return grad if isinstance(grad, Tensor) else Tensor._make(grad, device=like.device)


def _receivers(kept: dict[Edge, Grad],
               receivers: dict[Edge, Tensor]) -> Iterator[tuple[Tensor, Grad]]:
    """Each kept gradient with the tensor whose ``.grad`` it goes to (if any)."""
    for edge, grad in kept.items():
        tensor = _receiver(edge, receivers)
        if tensor is not None:
            yield tensor, grad


def _receiver(edge: Edge, receivers: dict[Edge, Tensor]) -> Tensor | None:
    """The tensor whose ``.grad`` a kept gradient goes to: the input it was asked for,
    the leaf of an accumulator, or a tensor marked with ``retain_grad`` (if alive)."""
    node, output_nr = edge
    if receivers:
        return receivers.get(edge)
    if isinstance(node, AccumulateGrad):
        return node.variable
    retains = node._hooks.retains if node is not None and node._hooks is not None else {}
    ref = retains.get(output_nr)
    return None if ref is None else ref()


def _flags(retain_graph: Any, create_graph: Any, caller: str) -> bool:
    """Check ``retain_graph`` and ``create_graph`` (a bool, numpy's included, or None);
    return ``create_graph`` as a bool (None: False). A string such as ``'no'`` would
    otherwise be taken as True."""
    for name, value in (("retain_graph", retain_graph), ("create_graph", create_graph)):
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{caller}: {name} must be True, False or None, "
                            f"got {type(value).__name__} {value!r}")
    return bool(create_graph)


def _as_tensors(tensors: Any, caller: str) -> tuple[Tensor, ...]:
    roots = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
    what = "tensors" if caller == "backward" else "outputs"
    for i, t in enumerate(roots):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: {what}[{i}] is a {type(t).__name__}, not a Tensor")
        if not t.requires_grad:
            raise RuntimeError(
                f"{caller}: {what}[{i}] does not require grad and has no grad_fn, so there "
                f"is nothing to differentiate; make its inputs with requires_grad=True"
            )
    return roots


def _inputs(inputs: Any, caller: str) -> tuple[Tensor, ...]:
    targets = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if not targets:  # the types PyTorch raises: RuntimeError from backward, ValueError from grad
        error = RuntimeError if caller == "backward" else ValueError
        raise error(f"{caller}: inputs must not be empty (pass None for every leaf)"
                    if caller == "backward" else f"{caller}: inputs must not be empty")
    for i, t in enumerate(targets):
        if not isinstance(t, Tensor):
            raise TypeError(f"{caller}: inputs[{i}] is a {type(t).__name__}, not a Tensor")
        if not t.requires_grad:
            raise RuntimeError(f"{caller}: inputs[{i}] does not require grad, so it can get "
                               f"no gradient; make it with requires_grad=True")
    return targets


# Per caller: what its message calls the roots and their gradients (its parameters).
_PARAMETERS = {"backward": ("tensors", "grad_tensors"), "grad": ("outputs", "grad_outputs"),
               "Tensor.backward": ("the tensor", "gradient")}


def _root_grads(roots: tuple[Tensor, ...], grad_tensors: Any, create_graph: bool,
                caller: str) -> list[Grad]:
    if grad_tensors is None:
        given: tuple[Any, ...] = (None,) * len(roots)
    elif len(roots) == 1 and not isinstance(grad_tensors, (list, tuple)):
        given = (grad_tensors,)
    else:
        given = tuple(grad_tensors)
    if len(given) != len(roots):
        what, parameter = _PARAMETERS[caller]
        raise ValueError(f"{caller}: got {len(given)} gradients in {parameter}= for "
                         f"{len(roots)} {what}")
    return [_root_grad(i, t, g, create_graph, caller)
            for i, (t, g) in enumerate(zip(roots, given))]


def _root_grad(i: int, root: Tensor, grad: Any, create_graph: bool, caller: str) -> Grad:
    data = root.data  # (root.shape and .dtype, read once: properties)
    shape, dtype = data.shape, data.dtype
    if grad is None:
        if data.size != 1:
            what, parameter = _PARAMETERS[caller]
            name = _root_name(i, caller)[0]
            each = ("an array of that shape" if caller == "Tensor.backward"
                    else f"one array per {what[:-1]}, of its shape")
            raise RuntimeError(
                f"{caller}: {name} has shape {shape}; a gradient can be implied only "
                f"for a tensor with one element, so pass {parameter}= ({each}), or reduce "
                f"it to one element first (.sum())"
            )
        array = np.ones(shape, dtype)
    else:
        array = grad.data if isinstance(grad, Tensor) else grad
        if not hasattr(array, "dtype"):  # Python numbers and lists take the root's dtype
            array = np.asarray(array, dtype=dtype)
        array = np.asarray(array)
        if array.shape != shape:
            name, grad_name = _root_name(i, caller)
            raise RuntimeError(
                f"{caller}: {grad_name} has shape {array.shape}, but {name} has shape "
                f"{shape}"
            )
        if array.dtype != dtype:
            name, grad_name = _root_name(i, caller)
            raise TypeError(
                f"{caller}: {grad_name} has dtype {array.dtype}, but {name} has dtype "
                f"{dtype}; cast it with .astype(np.{dtype})"
            )
    if create_graph:
        return grad if isinstance(grad, Tensor) else Tensor._make(array, device=root.device)
    return array


def _root_name(i: int, caller: str) -> tuple[str, str]:
    """How an error names root ``i`` and its gradient (only made for an error)."""
    what, parameter = _PARAMETERS[caller]
    if caller == "Tensor.backward":
        return what, parameter
    return f"{what}[{i}]", f"{parameter}[{i}]"


def _added_to_grad(tensor: Tensor, grad: Grad, create_graph: bool) -> Tensor:
    """The new ``tensor.grad``: a gathered gradient added to it, never in place (the
    caller assigns it).

    A new ``.grad`` is a copy, so it never shares memory with a gradient that the
    caller, another leaf or the graph still holds. With ``create_graph`` the copy and
    the sum are recorded, so ``.grad`` can be differentiated. The caller holds
    ``grad_lock`` (until it has assigned the result) and has grad mode enabled.
    """
    old = tensor._grad
    if create_graph:
        return copy(grad) if old is None else accumulate(old, False, copy(grad))[0]
    if old is None:
        return Tensor._make(memory.copy(grad), device=tensor.device)
    return Tensor._make(accumulate(old.data, False, grad)[0], device=tensor.device)


def _adds_in_place(tensor: Tensor, create_graph: bool) -> bool:
    """Whether a commit adds into ``tensor.grad``'s own array, as PyTorch does (a
    reference taken to ``x.grad`` then sees the sum): an existing ``.grad`` with no
    graph of its own, whose array may be written, when no graph is recorded."""
    old = tensor._grad
    return (not create_graph and old is not None and old.grad_fn is None
            and old.data.flags.writeable)


def _add_in_place(old: Tensor, grad: Grad) -> None:
    """Add ``grad`` into ``old``'s array (shapes and dtypes checked already: it cannot
    fail midway) and bump its version, as an in-place op would."""
    np.add(old.data, grad, out=old.data)
    counter_of(old).bump()


# ----- vector-Jacobian products of a function's outputs (gradcheck, checkpoint) -----
def _requires_grad(value: Any) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


def _fn_outputs(result: Any, caller: str,
                sequences: tuple[type[Sequence[Any]], ...] = (tuple,)
                ) -> list[Tensor]:
    """What a user's ``fn`` returned, as a list of Tensors: one Tensor, or a sequence of
    one of the types ``sequences``. Raises TypeError naming ``caller`` otherwise."""
    outputs = list(result) if isinstance(result, sequences) else [result]
    for output in outputs:
        if not isinstance(output, Tensor):
            raise TypeError(f"{caller}: fn must return a Tensor or a tuple of Tensors, got a "
                            f"{type(output).__name__}")
    return outputs


def _vjp(outputs: Sequence[Tensor], cotangents: Sequence[Any], inputs: Sequence[Tensor], *,
         create_graph: bool, retain_graph: bool, engine: Engine | None = None
         ) -> tuple[Tensor | None, ...]:
    """``d(sum(cotangent * output))/d(input)`` for each of ``inputs`` (None where none
    arrives), by ``grad``: touches no ``.grad``.

    Outputs that do not require grad are left out, with their cotangents. A cotangent
    (a Tensor or an array) is cast to its output's dtype (and, with ``create_graph``,
    made a Tensor on its output's device, keeping its own graph if it has one).
    """
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    if not pairs or not inputs:
        return (None,) * len(inputs)
    grads: list[Any] = []
    for o, c in pairs:
        if create_graph:
            c = c if isinstance(c, Tensor) else Tensor(c, device=o.device)
            c = c if c.device is o.device else c.to(o.device)
            grads.append(c if c.dtype == o.dtype else c.astype(o.dtype))
        else:
            grads.append(np.asarray(c.data if isinstance(c, Tensor) else c, dtype=o.dtype))
    return grad([o for o, _ in pairs], inputs, grads, retain_graph=retain_graph,
                create_graph=create_graph, allow_unused=True, engine=engine)


bind_backward(tensor_backward)  # Tensor.backward is this module's, and Tensor sits below it
