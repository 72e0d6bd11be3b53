"""The backward engine on hand-built graphs, with values worked out by hand.

Runs on every engine (the ``engine`` fixture makes each one current in turn).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, ClassVar

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from pargrad.engine.buffer import InputBuffer
from tests.helpers import Boom


def leaf(value: Any, dtype: Any = np.float64) -> Tensor:
    return pargrad.tensor(value, dtype=dtype, requires_grad=True)


class Log(pargrad.Function):
    """Identity in forward and backward; records the order in which backwards run."""

    calls: ClassVar[list[str]] = []

    @staticmethod
    def forward(ctx: Any, x: Tensor, tag: str) -> np.ndarray:
        ctx.tag = tag
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        Log.calls.append(ctx.tag)
        return g, None


# ----- shapes of graphs -----

def test_diamond(engine: pargrad.Engine) -> None:
    x = leaf([1.0, -2.0, 3.0])
    a, b = x * 2, x * 3
    (a * b).sum().backward()  # y = 6 x^2
    np.testing.assert_array_equal(x.grad.data, 12 * x.data)


def test_wide_fan_in_onto_one_leaf(engine: pargrad.Engine) -> None:
    x = leaf(np.ones(4))
    coefficients = np.arange(256.0)
    total = pargrad.stack([x * c for c in coefficients]).sum()
    total.backward()
    np.testing.assert_array_equal(x.grad.data, np.full(4, coefficients.sum()))


def test_multi_output_node_whose_only_used_output_is_not_the_first(
        engine: pargrad.Engine) -> None:
    # The seed asserted output_nr == 0 when a node became ready on its first gradient.
    x = leaf(np.arange(6.0))
    parts = pargrad.split(x, 3)
    (parts[1] * 5).sum().backward()
    np.testing.assert_array_equal(x.grad.data, [0, 0, 5, 5, 0, 0])


def test_root_is_one_output_of_a_multi_output_node(engine: pargrad.Engine) -> None:
    x = leaf(np.arange(6.0))
    first, _, last = pargrad.split(x, 3)
    pargrad.backward([last, first], [np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    np.testing.assert_array_equal(x.grad.data, [3, 4, 0, 0, 1, 2])


def test_inputs_that_need_no_grad(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    c = pargrad.tensor([3.0, 4.0])  # a constant tensor: its edge is (None, 0)
    y = x * c
    assert y.grad_fn.next_functions[1] == (None, 0)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [3.0, 4.0])
    assert c.grad is None


def test_shared_leaf_across_several_roots(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    y1, y2 = (x * x).sum(), (3 * x).sum()
    pargrad.backward([y1, y2])
    np.testing.assert_array_equal(x.grad.data, 2 * x.data + 3)


def test_root_that_feeds_another_root(engine: pargrad.Engine) -> None:
    # y's node gets a root gradient and one from z; it must wait for z's.
    x = leaf(2.0)
    y = x * x
    z = y * 3
    pargrad.backward([y, z])
    assert x.grad.item() == 2 * 2.0 + 3 * 2 * 2.0


def test_same_root_twice(engine: pargrad.Engine) -> None:
    x = leaf(3.0)
    y = x * x
    pargrad.backward([y, y])
    assert x.grad.item() == 12.0


def test_root_gradients_given_once_twice_or_with_an_edge_in_root_order(
        canonical_engine: pargrad.Engine) -> None:
    # Roots given once start ready as given; one given several times sums in root
    # order, (1e16 + 1) - 1e16 = 0 (any other order gives 1); a root reached by another
    # root's edge waits for it, and its given gradient comes first.
    x = leaf(1.0)
    a, b, c = x * 1.0, x * 2.0, x * 4.0
    d = c * 1.0
    pargrad.backward([a, b, a, c, d, a],
                     [np.array(g) for g in (1e16, 3.0, 1.0, 5.0, 7.0, -1e16)])
    assert x.grad.item() == 0.0 + 3.0 * 2 + (5.0 + 7.0) * 4


def test_leaf_as_root(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    x.backward(np.array([5.0, 6.0]))
    np.testing.assert_array_equal(x.grad.data, [5.0, 6.0])


def test_grad_accumulates_across_calls_and_resets(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    for _ in range(3):
        (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad.data, 3 * 2 * x.data)
    x.grad = None
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad.data, 2 * x.data)


def test_gradient_keeps_the_input_dtype(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0], dtype=np.float32)
    w = leaf([0.5, 0.25], dtype=np.float64)
    (x * w).sum().backward()  # the product is float64; x's gradient is cast back
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float64
    np.testing.assert_array_equal(x.grad.data, np.array([0.5, 0.25], np.float32))


def test_long_chain_is_iterative_and_freed(engine: pargrad.Engine) -> None:
    x = leaf(1.0)
    y = x
    for _ in range(100_000):
        y = y + 1.0
    probe = weakref.ref(y.grad_fn)
    y.backward()
    assert x.grad.item() == 1.0
    del y
    gc.collect()
    assert probe() is None


def test_wide_graph(engine: pargrad.Engine) -> None:
    xs = [leaf(float(i)) for i in range(20_000)]
    total = pargrad.stack([x * 2 for x in xs]).sum()
    total.backward()
    assert all(x.grad.item() == 2.0 for x in xs)


# ----- the seed's defects -----

def test_zero_gradient_is_a_gradient() -> None:
    # The seed tested `if not prev_grad[...]`: wrong (or an error) for arrays.
    buffer = InputBuffer(1)
    buffer.accumulate(0, np.zeros(3))
    buffer.accumulate(0, np.ones(3))
    np.testing.assert_array_equal(buffer.take()[0], np.ones(3))


def test_zero_first_contribution(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    y = x * 0.0 + x * 2.0
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [2.0, 2.0])


def test_no_in_place_write_into_gradients_others_hold(engine: pargrad.Engine) -> None:
    # add's rule hands the same gradient object to both edges; the seed's add_ would
    # have written the sum into the caller's gradient array.
    x = leaf([1.0, 2.0])
    g = np.array([1.0, 10.0])
    (x + x + x).backward(g)
    np.testing.assert_array_equal(g, [1.0, 10.0])
    np.testing.assert_array_equal(x.grad.data, [3.0, 30.0])


def test_grads_never_share_memory(engine: pargrad.Engine) -> None:
    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    g = np.array([1.0, 1.0])
    (a + b).backward(g)
    assert not np.shares_memory(a.grad.data, b.grad.data)
    assert not np.shares_memory(a.grad.data, g)
    a.grad.data += 100  # a user updating one gradient in place changes nothing else
    np.testing.assert_array_equal(b.grad.data, [1.0, 1.0])
    np.testing.assert_array_equal(g, [1.0, 1.0])


def test_accumulation_adds_into_the_previous_grad_in_place(engine: pargrad.Engine) -> None:
    # As PyTorch: without create_graph, .grad is added to in place (issue 14).
    x = leaf([1.0, 2.0])
    (x * 1.0).sum().backward()
    first = x.grad
    (x * 1.0).sum().backward()
    assert x.grad is first and first._version == 1
    np.testing.assert_array_equal(first.data, [2.0, 2.0])
    (x * 1.0).sum().backward(create_graph=True)  # recording: a new tensor, as PyTorch
    assert x.grad is not first
    np.testing.assert_array_equal(first.data, [2.0, 2.0])
    np.testing.assert_array_equal(x.grad.data, [3.0, 3.0])


# ----- order -----

def test_nodes_run_in_reverse_creation_order(in_order_engine: pargrad.Engine) -> None:
    Log.calls = []
    x = leaf(1.0)
    a = Log.apply(x, "a")
    b = Log.apply(x * 2, "b")
    c = Log.apply(a + b, "c")
    d = Log.apply(a * 3, "d")
    (c + d).backward()
    assert Log.calls == ["d", "c", "b", "a"]


def test_canonical_summation_order(canonical_engine: pargrad.Engine) -> None:
    # Float addition is not associative: 1 + 1e16 - 1e16 is 0 but -1e16 + 1e16 + 1 is 1.
    # Contributions are summed by descending sequence number of the producing node,
    # so the newest consumer's gradient (-1e16) comes first.
    x = leaf(1.0)
    a, b, c = x * 1.0, x * 1e16, x * -1e16
    (a + b + c).backward()
    assert x.grad.item() == 1.0
    assert (-1e16 + 1e16) + 1.0 == 1.0 and (1.0 + 1e16) + -1e16 == 0.0


class Three(pargrad.Function):
    """a + b + c, whose backward gives its three edges 1, 1e16 and -1e16 times g."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, c: Tensor) -> np.ndarray:
        return a.data + b.data + c.data

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return g * 1.0, g * 1e16, g * -1e16


def test_edges_of_one_producer_are_summed_in_edge_order(
        canonical_engine: pargrad.Engine) -> None:
    x = leaf(1.0)
    Three.apply(x, x, x).backward()
    assert x.grad.item() == (1.0 + 1e16) + -1e16 == 0.0  # reversed order would give 1.0


def test_node_backwards_run_with_grad_mode_set_to_create_graph(
        engine: pargrad.Engine) -> None:
    seen = []

    class Probe(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data * 1.0

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            seen.append(pargrad.is_grad_enabled())
            return g

    x = leaf(1.0)
    Probe.apply(x).backward()  # the caller has grad mode on
    with pargrad.no_grad():
        Probe.apply(x)  # records nothing, runs no backward
    Probe.apply(x).backward(create_graph=True)
    assert seen == [False, True]
    assert pargrad.is_grad_enabled()


def test_root_gradients_are_summed_first(engine: pargrad.Engine) -> None:
    x = leaf(1.0)
    y = x * 1.0
    z = y * -1e16
    w = y * 1e16
    # y's buffer gets its root gradient (1.0) first, then w's 1e16 (the newer node),
    # then z's -1e16: (1 + 1e16) - 1e16 == 0. Roots last would give 1.
    pargrad.backward([y, z, w], [np.array(1.0), np.array(1.0), np.array(1.0)])
    assert x.grad.item() == (1.0 + 1e16) + -1e16 == 0.0


# ----- retain_graph -----

def test_second_backward_through_freed_graph_fails(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward()
    with pytest.raises(pargrad.BackwardError, match=r"MultiplyBackward.*retain_graph=True"):
        y.backward()
    np.testing.assert_array_equal(x.grad.data, [2.0, 4.0])


def test_retain_graph_allows_a_second_backward(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad.data, [4.0, 8.0])


def test_freed_saved_values_are_released(engine: pargrad.Engine) -> None:
    x = leaf(np.ones(3))
    y = x * 2.0
    node = y.grad_fn
    y.sum().backward()
    assert node.saved_args is None and node.saved_outputs is None


# ----- errors -----

def test_failure_names_the_node_and_chains_the_cause(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    with pytest.raises(pargrad.BackwardError, match="BoomBackward: ValueError: boom") as info:
        Boom.apply(x).sum().backward()
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.__cause__.__traceback__ is not None
    assert info.value.node_name == "BoomBackward"


def test_failed_backward_changes_no_grad(engine: pargrad.Engine) -> None:
    x1, x2 = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    x1.grad = pargrad.tensor([10.0, 10.0])
    bad = Boom.apply(x2)        # older node: runs after x1's branch has been summed
    y = (bad + x1 * 2).sum()
    with pytest.raises(pargrad.BackwardError):
        y.backward()
    np.testing.assert_array_equal(x1.grad.data, [10.0, 10.0])
    assert x2.grad is None


# ----- engine selection -----

class Recording(pargrad.SequentialEngine):
    def __init__(self) -> None:
        self.calls = 0

    def execute(self, request: pargrad.BackwardRequest) -> Any:
        self.calls += 1
        return super().execute(request)


def test_engine_selection() -> None:
    x = leaf(1.0)
    explicit, scoped, default = Recording(), Recording(), Recording()
    previous = pargrad.get_default_engine()
    pargrad.set_default_engine(default)
    try:
        (x * 2).backward()
        assert default.calls == 1
        with pargrad.use_engine(scoped):
            assert pargrad.current_engine() is scoped
            (x * 2).backward()
            (x * 2).backward(engine=explicit)
        assert (scoped.calls, explicit.calls) == (1, 1)
        assert pargrad.current_engine() is default
    finally:
        pargrad.set_default_engine(previous)
    with pytest.raises(TypeError, match="Engine"):
        pargrad.set_default_engine("sequential")  # type: ignore[arg-type]


def test_use_engine_is_thread_local() -> None:
    import threading

    seen = []
    with pargrad.use_engine(Recording()):
        t = threading.Thread(target=lambda: seen.append(pargrad.current_engine()))
        t.start()
        t.join()
    assert seen == [pargrad.get_default_engine()]


class DropGradient(pargrad.Function):
    """Passes its input through but gives it no gradient (returns None)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> np.ndarray:
        return x.data.copy()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> None:
        return None


def test_a_node_that_receives_only_none_is_skipped(engine: pargrad.Engine) -> None:
    x = leaf([1.0, 2.0])
    upstream = x.exp()  # gets nothing: DropGradient returns None
    y = DropGradient.apply(upstream) * 2 + x
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])  # only the direct path
    upstream.grad_fn.register_prehook(lambda grads: pytest.fail("ExpBackward ran"))
    DropGradient.apply(upstream).sum().backward()  # the op node is skipped: no error


def test_a_function_that_receives_only_none_still_runs(engine: pargrad.Engine) -> None:
    # As PyTorch: a custom Function's backward runs with zeros (issue 14).
    Log.calls = []
    x = leaf([1.0, 2.0])
    upstream = Log.apply(x * 3, "upstream")  # gets nothing: DropGradient returns None
    y = DropGradient.apply(upstream) * 2 + x
    y.sum().backward()
    assert Log.calls == ["upstream"]
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])  # zeros from that path


def test_node_interface(engine: pargrad.Engine) -> None:
    class Bare(pargrad.Node):
        __slots__ = ()

    node = Bare((), (), ((((), np.dtype(np.float64)),)))
    assert node.name() == "Bare" and repr(node).startswith("<Bare sequence_nr=")
    assert node.num_outputs == 1 and node.next_functions == ()
    with pytest.raises(pargrad.BackwardError, match=r"Bare: NotImplementedError: Bare has no"):
        node.apply([np.array(1.0)], retain_graph=False)


def test_a_node_sees_the_engine_running_it(engine: pargrad.Engine) -> None:
    seen: list[pargrad.Engine] = []

    class Probe(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            return x.data.copy()

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            seen.append(pargrad.current_engine())
            return g

    x = leaf([1.0, 2.0])
    with pargrad.use_engine(pargrad.SequentialEngine()):  # not the engine passed below
        Probe.apply(x).sum().backward(engine=engine)
    assert seen == [engine]
