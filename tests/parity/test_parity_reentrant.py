"""Reentrant backward (a node's backward calling backward itself), engine callbacks
(``queue_callback``) and checkpointing, which is built on reentrant backward."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given

import pargrad
from pargrad import Function, Tensor, once_differentiable
from tests.parity.support import close, grad_of
from tests.strategies import GraphRecipe, graph_recipes


class EventLog:
    """Events appended from whichever threads run the nodes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards events
        self.events: list[str] = []

    def add(self, event: str) -> None:
        with self._lock:
            self.events.append(event)


# ----- a backward inside a backward -----


class ScaledSquareViaInnerBackward(Function):
    """``c * x**2``, whose gradient comes from a backward through a graph the forward
    recorded and kept."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, c: np.ndarray) -> np.ndarray:
        with pargrad.enable_grad():
            ctx.inner_x = pargrad.tensor(x.data.copy(), requires_grad=True)
            ctx.inner_out = ctx.inner_x * ctx.inner_x * c
        return ctx.inner_out.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        ctx.inner_out.backward(g.data)
        return ctx.inner_x.grad, None


def test_a_node_can_compute_its_gradient_with_a_backward_of_its_own() -> None:
    x = pargrad.tensor([1.0, -2.0, 0.5], requires_grad=True)
    c = np.array([3.0, 1.0, -4.0])
    y = ScaledSquareViaInnerBackward.apply(x * 1.0, c)
    close(y, [3.0, 4.0, -1.0])
    (y * np.array([1.0, 10.0, 100.0])).sum().backward()
    close(x.grad, 2 * np.array([1.0, -2.0, 0.5]) * c * [1.0, 10.0, 100.0])


class Explodes(Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise ValueError("the inner graph's node exploded")


def test_an_error_in_a_nested_backward_reaches_the_outer_caller() -> None:
    inner_leaf = pargrad.tensor([2.0], requires_grad=True)
    inner_root = Explodes.apply(inner_leaf * 3.0).sum()

    class RunsInner(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            inner_root.backward()
            return g

    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    other = pargrad.tensor([5.0, 6.0], requires_grad=True)
    loss = (RunsInner.apply(w * 2.0) * other).sum()
    with pytest.raises(pargrad.BackwardError, match="the inner graph's node exploded") as caught:
        loss.backward()
    assert caught.value.node_name == "ExplodesBackward"
    assert isinstance(caught.value.__cause__, ValueError)
    assert w.grad is None and other.grad is None and inner_leaf.grad is None


def dive(levels: int, reached: list[int]) -> tuple[Tensor, Tensor]:
    """A leaf and a tensor made from it whose backward nests backward calls ``levels``
    deep: each level's node applies the next level and runs its backward before
    returning, and every level doubles the gradient."""

    class Dive(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, level: int) -> np.ndarray:
            ctx.level = level
            return x.data * 2.0

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            reached.append(ctx.level)
            if ctx.level < levels:
                inner = pargrad.tensor(1.0, requires_grad=True)
                with pargrad.enable_grad():
                    root = Dive.apply(inner, ctx.level + 1)
                root.backward()
                if inner.grad is None or inner.grad.item() != 2.0:
                    raise AssertionError(f"level {ctx.level + 1} gave {inner.grad}")
            return g * 2.0, None

    start = pargrad.tensor(0.5, requires_grad=True)
    return start, Dive.apply(start, 0)


def test_reentrant_backward_nests_thousands_deep() -> None:
    reached: list[int] = []
    start, out = dive(2500, reached)
    close(out, 1.0)
    out.backward()
    assert reached == list(range(2501))  # each level starts before the next
    close(start.grad, 2.0)
    # The engine is still usable, and a shallower dive right after works as well.
    reached.clear()
    start, out = dive(150, reached)
    out.backward()
    assert reached == list(range(151))
    close(start.grad, 2.0)


# ----- which nodes run while a nested backward is in progress -----

NESTING = 4


def order_graph(log: EventLog) -> tuple[Tensor, Tensor, Tensor]:
    """``a * b`` where ``a`` comes from two logging identities and ``b`` from a node whose
    backward nests ``NESTING`` backward calls, one inside the other. Both branches become
    ready together (one multiply feeds them); the nesting node is the newer one."""

    class Logged(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, name: str) -> np.ndarray:
            ctx.name = name
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            log.add(ctx.name)
            return g, None

    class Nest(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor, level: int) -> np.ndarray:
            ctx.level = level
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
            log.add(f"nest {ctx.level}")
            if ctx.level > 0:
                with pargrad.enable_grad():
                    inner = Nest.apply(pargrad.tensor(0.0, requires_grad=True), ctx.level - 1)
                inner.backward()
                log.add(f"nested {ctx.level - 1} returned")
            return g * 2.0, None

    a_leaf = pargrad.tensor(1.5, requires_grad=True)
    b_leaf = pargrad.tensor(4.0, requires_grad=True)
    a = Logged.apply(Logged.apply(a_leaf, "parent inner"), "parent outer")
    b = Nest.apply(b_leaf, NESTING)
    return a_leaf, b_leaf, a * b


def nesting_events() -> list[str]:
    """The nested backward calls' events, in the only order their dependencies allow."""
    down = [f"nest {k}" for k in range(NESTING, -1, -1)]
    up = [f"nested {k} returned" for k in range(NESTING)]
    return down + up


@contextmanager
def running_on(made: pargrad.Engine) -> Iterator[None]:
    """Make ``made`` current here and the default elsewhere (as the conftest fixture
    does), shutting a ThreadedEngine down afterwards."""
    before = pargrad.get_default_engine()
    pargrad.set_default_engine(made)
    try:
        with pargrad.use_engine(made):
            yield
    finally:
        pargrad.set_default_engine(before)
        if isinstance(made, pargrad.ThreadedEngine):
            made.shutdown()


# The order depends on whether nodes stay on the thread that made them ready, so the two
# tests below build the engines they are about themselves. Parametrizing ``engine``
# replaces the conftest's autouse fixture for them; the labels are conftest's, so that
# tests/parity/report.py counts each test under the engine it stands for.
ALL_INLINE = 10 ** 9  # a hand-off threshold no node here reaches: every node stays inline


@pytest.mark.parametrize("engine", ["sequential", "threaded"])
def test_a_nested_backward_runs_before_the_parents_remaining_nodes(engine: str) -> None:
    made = (pargrad.SequentialEngine() if engine == "sequential"
            else pargrad.ThreadedEngine(handoff_threshold=ALL_INLINE))
    with running_on(made):
        log = EventLog()
        a_leaf, b_leaf, root = order_graph(log)
        pargrad.backward([root])
    assert log.events == [*nesting_events(), "parent outer", "parent inner"]
    close(a_leaf.grad, 4.0)
    close(b_leaf.grad, 3.0)


@pytest.mark.differs("once nodes are handed to worker threads, the parent's ready nodes "
                     "are no longer held back until the nested backward has finished")
@pytest.mark.parametrize("engine", ["threaded-handoff1"])
def test_with_nodes_handed_off_a_nested_backward_still_completes_inside_its_node(
        engine: str) -> None:
    with running_on(pargrad.ThreadedEngine(handoff_threshold=1)):
        for _ in range(5):  # where the parent's nodes land varies from run to run
            log = EventLog()
            a_leaf, b_leaf, root = order_graph(log)
            pargrad.backward([root])
            events = log.events
            assert [e for e in events if e.startswith("nest")] == nesting_events()
            assert [e for e in events if e.startswith("parent")] == ["parent outer",
                                                                      "parent inner"]
            assert len(events) == len(nesting_events()) + 2
            close(a_leaf.grad, 4.0)
            close(b_leaf.grad, 3.0)


# ----- queue_callback -----


def test_a_callback_may_queue_another_and_both_run_after_the_last_node() -> None:
    log = EventLog()

    def first() -> None:
        log.add("first callback")
        pargrad.queue_callback(lambda: log.add("second callback"))

    class Queues(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        @once_differentiable
        def backward(ctx: Any, g: Tensor) -> Tensor:
            log.add("queueing node")
            pargrad.queue_callback(first)
            return g

    class Later(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            log.add("later node")
            return g * 3.0

    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    Queues.apply(Later.apply(x)).sum().backward()
    log.add("backward returned")
    assert log.events == ["queueing node", "later node", "first callback",
                          "second callback", "backward returned"]
    close(x.grad, [3.0, 3.0])


@pytest.mark.parametrize("queued_by", [set(), {"outer"}, {"inner"}, {"outer", "inner"}],
                         ids=["none", "outer-node", "nested-node", "both"])
def test_callbacks_run_once_at_the_end_of_the_backward_whose_node_queued_them(
        queued_by: set[str]) -> None:
    log = EventLog()
    inner_leaves: list[Tensor] = []

    class InnerStep(Function):
        @staticmethod
        def forward(ctx: Any, z: Tensor) -> np.ndarray:
            return z.data * 4.0

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            log.add("nested node")
            if "inner" in queued_by:
                pargrad.queue_callback(lambda: log.add("nested callback"))
            return g * 4.0

    class RunsNested(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            if "outer" in queued_by:  # queued before the nested backward even starts
                pargrad.queue_callback(lambda: log.add("outer callback"))
            z = pargrad.tensor([1.0, 1.0], requires_grad=True)
            with pargrad.enable_grad():
                nested_root = InnerStep.apply(z).sum()
            nested_root.backward()
            inner_leaves.append(z)
            log.add("nested backward returned")
            return g * 5.0

    class Earlier(Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            log.add("earlier node")
            return g * -1.0

    x = pargrad.tensor([2.0, -3.0], requires_grad=True)
    pargrad.backward([(RunsNested.apply(Earlier.apply(x)) * np.array([1.0, 2.0])).sum(),
                      (x * 0.5).sum()])
    log.add("outer backward returned")
    expected = ["nested node", *(["nested callback"] if "inner" in queued_by else []),
                "nested backward returned", "earlier node",
                *(["outer callback"] if "outer" in queued_by else []),
                "outer backward returned"]
    assert log.events == expected
    close(x.grad, [-5.0 + 0.5, -10.0 + 0.5])
    (z,) = inner_leaves
    close(z.grad, [4.0, 4.0])


# ----- checkpoint -----


@given(recipe=graph_recipes(max_steps=6))
def test_checkpointing_any_graph_keeps_its_gradients(recipe: GraphRecipe) -> None:
    def run(checkpointed: bool) -> list[Tensor]:
        leaves = [pargrad.tensor(a, requires_grad=r)
                  for a, r in zip(recipe.leaves, recipe.requires_grad)]
        if checkpointed:
            roots = pargrad.checkpoint(lambda *ls: tuple(recipe.build(ls)), *leaves)
        else:
            roots = tuple(recipe.build(leaves))
        pargrad.backward(list(roots), list(recipe.root_grads))
        return leaves

    for plain, checkpointed in zip(run(False), run(True)):
        if plain.grad is None:
            assert checkpointed.grad is None
        else:
            np.testing.assert_allclose(grad_of(checkpointed), grad_of(plain),
                                       rtol=1e-10, atol=1e-12)


def gated(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """A small segment of an input and two shared weights."""
    return pargrad.sigmoid(x * scale + shift) * x


def test_many_checkpoints_sharing_weights_give_the_plain_gradients() -> None:
    rng = np.random.default_rng(7)
    inputs = [rng.normal(size=4) for _ in range(12)]

    def gradients(checkpointed: bool) -> list[np.ndarray]:
        scale = pargrad.tensor([0.5, -1.0, 2.0, 0.25], requires_grad=True)
        shift = pargrad.tensor([0.1, 0.0, -0.3, 1.0], requires_grad=True)
        xs = [pargrad.tensor(v, requires_grad=True) for v in inputs]
        if checkpointed:
            outs = [pargrad.checkpoint(gated, x, scale, shift) for x in xs]
            assert {o.grad_fn.name() for o in outs} == {"CheckpointBackward"}
        else:
            outs = [gated(x, scale, shift) for x in xs]
        total = outs[0] * 1.0
        for k, o in enumerate(outs[1:], start=2):
            total = total + o * float(k)
        (total * total).sum().backward()
        return [grad_of(t) for t in (scale, shift, *xs)]

    for plain, checkpointed in zip(gradients(False), gradients(True)):
        np.testing.assert_allclose(checkpointed, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.differs("pargrad.grad works through a checkpoint; PyTorch's reentrant "
                     "checkpoint raises when torch.autograd.grad reaches it")
def test_grad_through_a_checkpoint_returns_the_plain_gradient_and_sets_no_grad() -> None:
    a = pargrad.tensor([[1.0, -0.5], [0.25, 2.0]], requires_grad=True)
    b = pargrad.tensor([[0.3, 0.1], [-0.2, 0.4]], requires_grad=True)

    def segment(p: Tensor, q: Tensor) -> Tensor:
        return (p * pargrad.exp(q)).sum()

    plain = pargrad.grad(segment(a, b), [a, b])
    through = pargrad.grad(pargrad.checkpoint(segment, a, b), [a, b])
    assert a.grad is None and b.grad is None
    close(plain[0], np.exp(b.data))
    close(plain[1], a.data * np.exp(b.data))
    for p, c in zip(plain, through):
        close(c, p.data)
    pargrad.checkpoint(segment, a, b).backward()
    close(a.grad, plain[0].data)
    close(b.grad, plain[1].data)


def test_backward_through_a_checkpoint_matches_the_plain_graph() -> None:
    a = pargrad.tensor([0.3, -0.7, 1.1], requires_grad=True)

    def segment(t: Tensor) -> Tensor:
        return pargrad.tanh(t) * t

    segment(a).sum().backward()
    plain = grad_of(a).copy()
    a.grad = None
    pargrad.checkpoint(segment, a).sum().backward()
    t = a.data
    close(plain, (1 - np.tanh(t) ** 2) * t + np.tanh(t))
    close(a.grad, plain)
