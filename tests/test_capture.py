"""pargrad.capture: a replayed step gives the eager step's answers, bit for bit on the
engines that sum in the canonical order; what a replay could get wrong runs eagerly."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pargrad
from pargrad import nn
from pargrad.replay import program
from pargrad.replay.backward import CapturedBackward
from tests.conftest import CANONICAL
from tests.strategies import StepRecipe, step_recipes


def _grads(tensors: list[pargrad.Tensor]) -> list[np.ndarray | None]:
    return [None if t.grad is None else t.grad.numpy().copy() for t in tensors]


def _same(got: Any, expected: Any, bitwise: bool) -> None:
    if expected is None:
        assert got is None
        return
    assert got is not None
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if bitwise:
        assert got.tobytes() == expected.tobytes()
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def _call_and_backward(fn: Callable[..., Any], recipe: StepRecipe, args: tuple[Any, ...],
                       leaves: list[pargrad.Tensor], seed: int) -> dict[str, Any]:
    """One step: ``fn`` on fresh argument tensors, the backward of its loss (plus, when
    it returns a value too, a term made outside from that value), what came out."""
    for t in leaves:
        t.grad = None
    x = pargrad.tensor(args[0], requires_grad=recipe.x_requires_grad)
    pargrad.random.seed(seed)  # dropout draws the same masks eagerly and on replay
    out = fn(x, pargrad.tensor(args[1]), pargrad.tensor(args[2]))
    loss, value = (out, None) if recipe.returns_value is None else out
    total = loss if value is None or not value.requires_grad else (
        loss + (value * value).sum() * 0.5)
    if total.requires_grad:
        total.backward()
    return {"loss": loss.numpy().copy(),
            "value": None if value is None else value.numpy().copy(),
            "grads": _grads(leaves), "x": None if x.grad is None else x.grad.numpy().copy()}


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(recipe=step_recipes(), seed=st.integers(0, 2**31 - 1),
       segment_cost=st.sampled_from([1, 40, program.SEGMENT_COST]))
def test_replays_give_the_eager_answers(engine: pargrad.Engine, request: pytest.FixtureRequest,
                                        recipe: StepRecipe, seed: int,
                                        segment_cost: int) -> None:
    """Random steps, replayed four times with new arguments, weights changed in place
    between steps (as an optimizer does) and fresh random draws: values and every
    ``.grad`` equal the eager step's on the same engine; also with the backward cut into
    a segment per node, or per few nodes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(program, "SEGMENT_COST", segment_cost)
        _replays_equal_eager(request, recipe, seed)


def _replays_equal_eager(request: pytest.FixtureRequest, recipe: StepRecipe,
                         seed: int) -> None:
    weights = [pargrad.tensor(a, requires_grad=flag)
               for a, (_, flag) in zip(recipe.weight_arrays(seed), recipe.weights)]

    def fn(x: Any, labels: Any, rows: Any) -> Any:
        return recipe.run(x, labels, rows, weights)

    step = pargrad.capture(fn)
    bitwise = request.node.callspec.params["engine"] in CANONICAL
    for call in range(5):
        args = recipe.arguments(seed + call)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing in these steps may fall back
            expected = _call_and_backward(fn, recipe, args, weights, seed + call)
            got = _call_and_backward(step, recipe, args, weights, seed + call)
        for key in ("loss", "value", "x"):
            _same(got[key], expected[key], bitwise)
        for g, e in zip(got["grads"], expected["grads"]):
            _same(g, e, bitwise)
        with pargrad.no_grad():  # an optimizer's update, seen by the next replay
            for w in weights:
                w -= 0.125 * w
    assert step.stats.records == 1 and step.stats.replays == 4
    assert step.stats.fallback is None


# ----- a small model used by the tests below -----

def _mlp(seed: int = 0) -> nn.Module:
    pargrad.random.seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(seed: int, rows: int = 5) -> tuple[pargrad.Tensor, pargrad.Tensor]:
    rng = np.random.default_rng(seed)
    return pargrad.tensor(rng.standard_normal((rows, 4))), pargrad.tensor(
        rng.integers(0, 3, rows))


def test_replays_after_the_first_call_and_accumulates_into_grad() -> None:
    model = _mlp()

    def loss_fn(x: Any, y: Any) -> Any:
        return pargrad.cross_entropy(model(x), y)

    step = pargrad.capture(loss_fn)
    x, y = _batch(1)
    for _ in range(3):  # .grad accumulates over calls, as eagerly
        step(x, y).backward()
    got = _grads(list(model.parameters()))
    model.zero_grad()
    for _ in range(3):
        loss_fn(x, y).backward()
    for g, e in zip(got, _grads(list(model.parameters()))):
        _same(g, e, bitwise=True)
    out = step(x, y)
    assert isinstance(out.grad_fn, CapturedBackward)
    assert step.stats.records == 1 and step.stats.replays == 3
    assert step.stats.reasons == ["first call"]


def test_an_optimizer_loop_matches_the_eager_loop() -> None:
    def train(captured: bool) -> list[np.ndarray]:
        model = _mlp(7)
        opt = pargrad.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def loss_fn(x: Any, y: Any) -> Any:
            return pargrad.cross_entropy(model(x), y)

        step = pargrad.capture(loss_fn) if captured else loss_fn
        for k in range(6):
            opt.zero_grad()
            step(*_batch(k)).backward()
            opt.step()
        return [p.numpy().copy() for p in model.parameters()]

    for got, expected in zip(train(True), train(False)):
        _same(got, expected, bitwise=True)


def test_usable_as_a_decorator_and_on_methods() -> None:
    w = pargrad.tensor([1.0, -2.0], requires_grad=True)

    @pargrad.capture
    def f(x: Any) -> Any:
        return (w * x).sum()

    class Model:
        scale = 3.0

        @pargrad.capture
        def loss(self, x: Any) -> Any:
            return (w * x * self.scale).sum()

    m = Model()
    for _ in range(2):
        f(pargrad.tensor([0.5, 0.5])).backward()
        m.loss(pargrad.tensor([1.0, 1.0])).backward()
    assert w.grad is not None
    np.testing.assert_array_equal(w.grad.numpy(), [7.0, 7.0])
    assert f.__name__ == "f" and f.stats.replays == 1
    assert Model.loss.stats.replays == 1


def test_returns_keep_their_structure() -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)

    def fn(x: Any) -> Any:
        h = w * x
        return {"loss": h.sum(), "parts": (h, 7, None), "w": w}

    step = pargrad.capture(fn)
    for _ in range(2):
        out = step(pargrad.tensor([3.0, 4.0]))
    assert set(out) == {"loss", "parts", "w"}
    assert out["w"] is w and out["parts"][1:] == (7, None)
    np.testing.assert_array_equal(out["parts"][0].numpy(), [3.0, 8.0])
    assert out["loss"].item() == 11.0
    assert step.stats.replays == 1


# ----- guards -----

def test_guards_record_again_and_say_why() -> None:
    w = pargrad.tensor(np.ones((4, 3)), requires_grad=True)

    def fn(x: Any, scale: float) -> Any:
        return ((x @ w) * scale).sum()

    step = pargrad.capture(fn)
    step(pargrad.tensor(np.ones((2, 4))), 1.0)
    step(pargrad.tensor(np.ones((2, 4))), 1.0)  # replay
    step(pargrad.tensor(np.ones((5, 4))), 1.0)  # another shape
    step(pargrad.tensor(np.ones((5, 4), np.float32)), 1.0)  # another dtype
    step(pargrad.tensor(np.ones((5, 4)), requires_grad=True), 1.0)
    out = step(pargrad.tensor(np.ones((5, 4))), 2.0)  # another Python value
    assert out.item() == fn(pargrad.tensor(np.ones((5, 4))), 2.0).item()
    with pargrad.no_grad():
        assert not step(pargrad.tensor(np.ones((5, 4))), 2.0).requires_grad
    reasons = step.stats.reasons
    assert reasons[0] == "first call"
    assert "shape (2, 4) -> (5, 4)" in reasons[1]
    assert "dtype float64 -> float32" in reasons[2]
    assert "requires_grad False -> True" in reasons[3]
    assert reasons[4] == "argument 1: 1.0 -> 2.0"
    assert reasons[5] == "grad mode: disabled"
    assert step.stats.records == 6 and step.stats.replays == 1
    w.requires_grad_(False)  # an outside tensor changed: recorded again
    step(pargrad.tensor(np.ones((5, 4))), 2.0)
    assert "outside tensor changed" in step.stats.reasons[-1]
    assert "requires_grad=True -> " in step.stats.reasons[-1]


def test_the_same_tensor_twice_is_a_variant_of_its_own() -> None:
    step = pargrad.capture(lambda a, b: (a * 2.0 + b).sum())
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = pargrad.tensor([10.0, 20.0], requires_grad=True)
    assert step(x, x).item() == 9.0
    assert step(x, y).item() == 36.0  # not the recording of (x, x)
    assert step(x, y).item() == 36.0
    assert step.stats.records == 2 and step.stats.replays == 1


def test_anomaly_mode_runs_eagerly() -> None:
    w = pargrad.tensor([1.0], requires_grad=True)
    step = pargrad.capture(lambda x: (w * x).sum())
    step(pargrad.tensor([1.0]))
    with pargrad.detect_anomaly():
        out = step(pargrad.tensor([1.0]))
    assert out.grad_fn is not None and out.grad_fn.name() == "SumBackward"
    assert step.stats.eager == 1 and step.stats.fallback is None


def test_too_many_variants_run_eagerly_with_a_warning() -> None:
    step = pargrad.capture(lambda x: (x * 2.0).sum())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 12):
            assert step(pargrad.tensor(np.ones(n))).item() == 2.0 * n
    assert step.stats.records == 8
    assert step.stats.fallback is not None and "more than 8 variants" in step.stats.fallback
    assert sum(issubclass(w.category, pargrad.CaptureWarning) for w in caught) == 1


# ----- what cannot be replayed runs eagerly, with the eager answer -----

def _outside_hook_calls() -> list[Any]:
    return []


FALLBACKS: dict[str, Callable[[Any, Any], Any]] = {
    # each: fn(x, w) whose later calls must give the eager answer
    "item": lambda x, w: (w * x).sum() * (2.0 if (x.sum().item() > 0) else -1.0),
    "bool": lambda x, w: (w * x).sum() if bool(x.sum() > 0) else (w - x).sum(),
    "float": lambda x, w: (w * float(x.sum())).sum(),
    "asarray": lambda x, w: (w * pargrad.tensor(np.asarray(x) * 2)).sum(),
    "numpy": lambda x, w: (w * pargrad.tensor(x.numpy() + 1.0)).sum(),
    "hook": lambda x, w: _with_hook(w * x).sum(),
    "retain_grad": lambda x, w: _retained(w * x).sum(),
    "inplace_outside": lambda x, w: _bump(w, x),
    "inplace_inside": lambda x, w: _inplace_inside(w, x),
    "backward_inside": lambda x, w: _backward_inside(w, x),
    "custom_function": lambda x, w: (_Double.apply(w * x)).sum(),
    "argmax": lambda x, w: (w * x)[pargrad.argmax(x)] * 2.0,
    "tolist": lambda x, w: (w * x).sum() * len([v for v in x.tolist() if v > 0]),
    "any": lambda x, w: (w * x).sum() * (2.0 if (x > 1.0).any() else 1.0),
    "np_nonzero": lambda x, w: (w * x)[np.nonzero(x > 0)[0]].sum(),
    "zero_grad": lambda x, w: _reset(w, (w * x).sum()),
    "grad_read": lambda x, w: (w * x).sum() + (0.0 if w.grad is None else 1.0),
    "requires_grad_": lambda x, w: (w * x.requires_grad_()).sum(),
    "numpy_slice_constant": lambda x, w: (w * pargrad.tensor(x.numpy()[::-1])).sum(),
    "nested_readback": lambda x, w: _inner(x, w) * (2.0 if x.sum().item() > 0 else 1.0),
}


def _reset(w: Any, loss: Any) -> Any:
    w.grad = None
    return loss


_INNER: dict[str, Any] = {}


def _inner(x: Any, w: Any) -> Any:
    step = _INNER.setdefault("step", pargrad.capture(lambda a, b: (a * b).sum()))
    return step(x, w)


class _Double(pargrad.Function):
    @staticmethod
    def forward(ctx: Any, t: Any) -> Any:
        return t.data * 2.0

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return g * 2.0


def _with_hook(t: Any) -> Any:
    t.register_hook(lambda g: g * 3.0)
    return t


def _retained(t: Any) -> Any:
    t.retain_grad()
    return t


def _bump(w: Any, x: Any) -> Any:
    with pargrad.no_grad():
        x += 1.0
    return (w * x).sum()


def _inplace_inside(w: Any, x: Any) -> Any:
    h = w * x
    h *= 2.0
    return h.sum()


def _backward_inside(w: Any, x: Any) -> Any:
    (g,) = pargrad.grad((w * w).sum(), [w], create_graph=True)
    return (g * x).sum()


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_what_cannot_be_replayed_runs_eagerly_with_one_warning(case: str) -> None:
    fn = FALLBACKS[case]
    w_eager = pargrad.tensor([0.5, -1.5, 2.0], requires_grad=True)
    w_step = pargrad.tensor([0.5, -1.5, 2.0], requires_grad=True)
    step = pargrad.capture(lambda x: fn(x, w_step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for values in ([1.0, 2.0, 3.0], [-3.0, 0.5, -2.0], [4.0, -4.0, 1.0]):
            got = step(pargrad.tensor(values))
            expected = fn(pargrad.tensor(values), w_eager)
            _same(got.numpy(), expected.numpy(), bitwise=True)
            got.backward()
            expected.backward()
            _same(w_step.grad.numpy(), w_eager.grad.numpy(), bitwise=True)  # type: ignore[union-attr]
    warned = [w for w in caught if issubclass(w.category, pargrad.CaptureWarning)]
    assert len(warned) == 1
    assert warned[0].filename == __file__  # the line of this file that read or changed
    assert step.stats.fallback is not None and step.stats.replays == 0
    assert step.stats.records == 1 and step.stats.eager == 2


def test_create_graph_through_a_replay_raises_then_runs_eagerly() -> None:
    w = pargrad.tensor([0.5, 2.0], requires_grad=True)
    step = pargrad.capture(lambda x: (w * w * x).sum())
    step(pargrad.tensor([1.0, 1.0]))
    out = step(pargrad.tensor([1.0, 1.0]))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(
            pargrad.BackwardError, match="create_graph=True through a step"):
        warnings.simplefilter("always")
        pargrad.grad(out, [w], create_graph=True)
    assert [c.category for c in caught] == [pargrad.CaptureWarning]
    assert w.grad is None
    out = step(pargrad.tensor([1.0, 1.0]))
    assert step.stats.fallback is not None and step.stats.eager == 1
    (g,) = pargrad.grad(out, [w], create_graph=True)
    (gg,) = pargrad.grad(g.sum(), [w])
    np.testing.assert_array_equal(gg.numpy(), [2.0, 2.0])


# ----- the engine's guarantees hold through a replay -----

def test_hooks_on_outside_tensors_see_the_same_gradients() -> None:
    def run(captured: bool) -> tuple[list[np.ndarray], np.ndarray]:
        w = pargrad.tensor([1.0, -1.0, 0.5], requires_grad=True)
        seen: list[np.ndarray] = []
        w.register_hook(lambda g: (seen.append(g.numpy().copy()), g * 2.0)[1])
        w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
        fn = lambda x: (pargrad.sin(w * x) * w).sum()
        step = pargrad.capture(fn) if captured else fn
        for k in range(3):
            step(pargrad.tensor([1.0, 2.0, 3.0]) * (k + 1)).backward()
        assert w.grad is not None
        return seen, w.grad.numpy().copy()

    got, expected = run(True), run(False)
    for g, e in zip(got[0], expected[0]):
        _same(g, e, bitwise=True)
    _same(got[1], expected[1], bitwise=True)


def test_a_returned_tensor_read_inside_gets_its_whole_gradient() -> None:
    """``fn`` returns ``h`` and a loss made from ``h``: a hook on ``h``, its
    ``retain_grad`` and ``grad(inputs=[h])`` see every contribution, as eagerly."""
    def run(captured: bool) -> list[Any]:
        w = pargrad.tensor([0.5, 1.5], requires_grad=True)

        def fn(x: Any) -> Any:
            h = pargrad.tanh(w * x)
            return (h * h).sum(), h

        step = pargrad.capture(fn) if captured else fn
        seen: list[np.ndarray] = []
        for k in range(3):
            loss, h = step(pargrad.tensor([1.0, -2.0]) + k)
            h.register_hook(lambda g: seen.append(g.numpy().copy()))
            h.retain_grad()
            (gh,) = pargrad.grad(loss + h.sum(), [h], retain_graph=True)
            (loss + h.sum()).backward()
        assert h.grad is not None and w.grad is not None
        return [*seen, gh.numpy(), h.grad.numpy(), w.grad.numpy()]

    for g, e in zip(run(True), run(False)):
        _same(g, e, bitwise=True)


def test_gradients_from_outside_the_step_add_in_the_eager_order(
        canonical_engine: pargrad.Engine) -> None:
    def run(captured: bool) -> np.ndarray:
        w = pargrad.tensor(np.linspace(-1, 1, 7), requires_grad=True)
        fn = lambda x: (pargrad.sin(w * x) + w * 0.1 + pargrad.exp(w)).sum()
        step = pargrad.capture(fn) if captured else fn
        for k in range(3):
            before = (w * w).sum() * 0.3
            loss = step(pargrad.tensor(np.linspace(0.1, 3, 7)) * (k + 0.5))
            (before + loss + pargrad.cos(w).sum()).backward()
        assert w.grad is not None
        return w.grad.numpy().copy()

    _same(run(True), run(False), bitwise=True)


def test_a_failed_replayed_backward_changes_no_grad_and_names_the_node() -> None:
    """A weight changed in place between the forward and the backward: the replay raises
    the eager error, naming the same node, and writes no ``.grad``."""
    def attempt(captured: bool) -> str:
        w = pargrad.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
        b = pargrad.tensor([0.5, 0.5], requires_grad=True)
        fn = lambda x: (pargrad.tanh(x @ w) + b).sum()
        step = pargrad.capture(fn) if captured else fn
        step(pargrad.tensor([[1.0, 1.0]])).backward()
        before = (w.grad.numpy().copy(), b.grad.numpy().copy())  # type: ignore[union-attr]
        loss = step(pargrad.tensor([[1.0, 1.0]]))
        with pargrad.no_grad():
            w -= 0.1  # as an optimizer step taken too early
        with pytest.raises(pargrad.BackwardError) as caught:
            loss.backward()
        _same(w.grad.numpy(), before[0], bitwise=True)  # type: ignore[union-attr]
        _same(b.grad.numpy(), before[1], bitwise=True)  # type: ignore[union-attr]
        return str(caught.value)

    message = attempt(True)
    assert message == attempt(False)
    assert message.startswith("MatmulBackward")


def test_a_failing_rule_is_reported_under_its_node_name() -> None:
    """A rule that raises during a replayed backward: a ``BackwardError`` naming its
    node, with the original exception as its cause, and no ``.grad`` written."""
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    step = pargrad.capture(lambda x: (pargrad.sqrt(w * x)).sum())
    step(pargrad.tensor([1.0, 1.0])).backward()
    before = w.grad.numpy().copy()  # type: ignore[union-attr]
    loss = step(pargrad.tensor([1.0, 1.0]))
    segment = loss.grad_fn.segment  # type: ignore[union-attr]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segment, "run", _failing(segment.run))
        with pytest.raises(pargrad.BackwardError, match=r"^SqrtBackward: FloatingPointError: "
                           r"boom") as caught:
            loss.backward()
    assert isinstance(caught.value.__cause__, FloatingPointError)
    _same(w.grad.numpy(), before, bitwise=True)  # type: ignore[union-attr]


def _failing(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with its saved arrays made to raise in any numpy call."""
    def wrapped(grads: Any, saved: Any, *more: Any) -> Any:
        saved = tuple(_Exploding(s) if isinstance(s, np.ndarray) else s for s in saved)
        return run(grads, saved, *more)
    return wrapped


class _Exploding(np.ndarray):
    def __new__(cls, array: np.ndarray) -> _Exploding:
        return np.asarray(array).view(cls)

    def __array_ufunc__(self, *args: Any, **kwargs: Any) -> Any:
        raise FloatingPointError("boom")


def test_retain_graph_and_a_second_backward_as_eagerly() -> None:
    def run(captured: bool) -> tuple[np.ndarray, str]:
        w = pargrad.tensor([1.0, 2.0], requires_grad=True)
        fn = lambda x: (pargrad.exp(w * x)).sum()
        step = pargrad.capture(fn) if captured else fn
        step(pargrad.tensor([0.5, 0.5]))
        loss = step(pargrad.tensor([0.5, 0.5]))
        loss.backward(retain_graph=True)
        loss.backward()
        with pytest.raises(pargrad.BackwardError) as caught:
            loss.backward()
        assert w.grad is not None
        return w.grad.numpy().copy(), str(caught.value)

    got, expected = run(True), run(False)
    _same(got[0], expected[0], bitwise=True)
    assert got[1] == expected[1]


def test_backward_async_of_a_replayed_step() -> None:
    model = _mlp(3)
    step = pargrad.capture(lambda x, y: pargrad.cross_entropy(model(x), y))
    step(*_batch(0)).backward()
    model.zero_grad()
    future = pargrad.backward_async(step(*_batch(0)))
    future.result(timeout=30)
    got = _grads(list(model.parameters()))
    model.zero_grad()
    pargrad.cross_entropy(model(_batch(0)[0]), _batch(0)[1]).backward()
    for g, e in zip(got, _grads(list(model.parameters()))):
        _same(g, e, bitwise=True)


@pytest.mark.timeout(60)
def test_threads_replaying_one_step_at_once() -> None:
    w = pargrad.tensor(np.linspace(-1, 1, 16), requires_grad=True)
    step = pargrad.capture(lambda x: (pargrad.tanh(w * x) * w).sum())
    expected = {k: step(pargrad.tensor(np.full(16, k / 8))).item() for k in range(8)}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(50):
                x = pargrad.tensor(np.full(16, k / 8), requires_grad=True)
                out = step(x)
                assert out.item() == expected[k]
                out.backward()
                assert x.grad is not None
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # Threads that miss the cache at once each record (without the GIL, several do).
    stats = step.stats
    assert stats.fallback is None and stats.replays + stats.records == stats.calls
    assert stats.replays >= 400 - len(threads)


def test_python_values_inside_the_function_are_constants_of_the_recording() -> None:
    """The documented contract: what ``fn`` computes in Python (not from tensors) is
    recorded as it was; pass it as an argument to have it guarded."""
    settings_ = {"scale": 2.0}
    step = pargrad.capture(lambda x: (x * settings_["scale"]).sum())
    assert step(pargrad.tensor([1.0])).item() == 2.0
    settings_["scale"] = 5.0
    assert step(pargrad.tensor([1.0])).item() == 2.0
    guarded = pargrad.capture(lambda x, scale: (x * scale).sum())
    assert guarded(pargrad.tensor([1.0]), 2.0).item() == 2.0
    assert guarded(pargrad.tensor([1.0]), 5.0).item() == 5.0


_W = np.linspace(-1.0, 1.0, 6).reshape(2, 3)
PATTERNS: dict[str, Callable[[Any, Any], Any]] = {
    # each: fn(x, w) of patterns models use; none may fall back
    "zeros": lambda x, w: (x @ w + pargrad.zeros(3)).sum(),
    "ones_like": lambda x, w: (x @ w * pargrad.ones_like(x @ w)).sum(),
    "full": lambda x, w: (x @ w + pargrad.full((3,), 2.0)).sum(),
    "arange": lambda x, w: (x @ w * pargrad.arange(3)).sum(),
    "eye": lambda x, w: (x @ w @ pargrad.eye(3)).sum(),
    "from_numpy": lambda x, w: (x @ w + pargrad.from_numpy(np.ones(3))).sum(),
    "tensor": lambda x, w: (x @ w * pargrad.tensor([0.5, 1.5, -1.0])).sum(),
    "mse_loss": lambda x, w: pargrad.mse_loss(x @ w, pargrad.ones((4, 3))),
    "bce": lambda x, w: pargrad.binary_cross_entropy_with_logits(x @ w, pargrad.ones((4, 3))),
    "layer_norm": lambda x, w: nn.functional.layer_norm(x @ w, (3,)).sum(),
    "numpy_ufunc": lambda x, w: np.cos(x @ w).sum(),
    "column": lambda x, w: pargrad.softmax(x @ w, axis=1)[:, 1].sum(),
    "astype": lambda x, w: (x @ w).astype(np.float32).sum(),
    "std": lambda x, w: pargrad.std(x @ w),
    "where_scalar": lambda x, w: pargrad.where(x @ w > 0, x @ w, 0.0).sum(),
}


@pytest.mark.parametrize("case", sorted(PATTERNS))
def test_common_patterns_replay(case: str) -> None:
    fn = PATTERNS[case]
    w = pargrad.tensor(_W, requires_grad=True)
    step = pargrad.capture(lambda x: fn(x, w))
    rng = np.random.default_rng(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            x = pargrad.tensor(rng.standard_normal((4, 2)))
            w.grad = None
            expected = fn(x, w)
            expected.backward()
            grad = w.grad.numpy().copy()  # type: ignore[union-attr]
            w.grad = None
            got = step(x)
            got.backward()
            _same(got.numpy(), expected.numpy(), bitwise=True)
            _same(w.grad.numpy(), grad, bitwise=True)  # type: ignore[union-attr]
    assert step.stats.replays == 3 and step.stats.fallback is None


# ----- eager against captured, call by call: values, .grad, errors -----

Case = tuple[Callable[..., Any], Callable[[int], tuple[Any, ...]], list[Any],
             Callable[[Any, int], Any] | None]


def _tensors_in(value: Any) -> list[Any]:
    if isinstance(value, pargrad.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _log(make: Callable[[], Case], captured: bool, calls: int = 5) -> list[Any]:
    """What each call gives: its tensors' values and the leaves' gradients after
    ``after`` (a backward, say), or the error it raised."""
    fn, args_for, leaves, after = make()
    step = pargrad.capture(fn) if captured else fn
    log: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pargrad.CaptureWarning)
        for i in range(calls):
            try:
                out = step(*args_for(i))
                extra = None if after is None else after(out, i)
                log.append(([t.numpy().tobytes() for t in _tensors_in(out)],
                            [None if t._grad is None else t._grad.numpy().tobytes()
                             for t in leaves], repr(extra)))
            except Exception as exc:  # compared with the eager call's
                log.append(f"{type(exc).__name__}: {exc}")
    return log


def _mask_mean() -> Case:
    w = pargrad.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    xs = [[1.0, -1.0, -1.0, -1.0], [1.0, 2.0, 3.0, -1.0]] * 3
    return (lambda x: ((w * x)[x > 0] ** 2).mean(), lambda i: (pargrad.tensor(xs[i]),), [w],
            lambda out, i: out.backward())


def _enable_grad_inside() -> Case:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)

    def fn(x: Any) -> Any:
        with pargrad.enable_grad():
            return (w * x).sum()

    def call(i: int) -> tuple[Any, ...]:
        return (pargrad.tensor([1.0, float(i)]),)

    def after(out: Any, i: int) -> Any:
        out.backward()
        return out.requires_grad

    def under_no_grad(x: Any) -> Any:
        with pargrad.no_grad():
            return step_of[0](x)

    step_of = [fn]
    return fn, call, [w], after


def _loss_changed_after_the_call() -> Case:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)

    def after(out: Any, i: int) -> Any:
        out += (w * w).sum()  # the returned loss gets another history
        out.backward()

    return (lambda x: (pargrad.sin(w * x)).sum(), lambda i: (pargrad.tensor([1.0, i + 0.5]),),
            [w], after)


def _two_losses() -> Case:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    v = pargrad.tensor([0.5, -0.5], requires_grad=True)

    def after(out: Any, i: int) -> Any:
        out[0].backward()
        out[1].backward()

    return (lambda x: ((pargrad.tanh(w * x)).sum(), (pargrad.exp(v * x)).sum()),
            lambda i: (pargrad.tensor([1.0, -i / 3]),), [w, v], after)


def _signed_zero() -> Case:
    w = pargrad.tensor([1.0, -2.0], requires_grad=True)
    scales = [0.0, -0.0, 0.0, -0.0, 1.0]
    return (lambda x, s: (w * x * s).sum(), lambda i: (pargrad.tensor([1.0, 2.0]), scales[i]),
            [w], lambda out, i: out.backward())


def _fortran_layout() -> Case:
    w = pargrad.tensor(np.linspace(0.0, 1.0, 1 << 10), requires_grad=True)

    def call(i: int) -> tuple[Any, ...]:
        a = np.asfortranarray(np.linspace(-1.0, 1.0 + i, 1 << 20).reshape(1 << 10, 1 << 10))
        return (pargrad.tensor(np.asfortranarray(a)).T,)

    return (lambda x: (pargrad.exp(x * 0.5) * w).sum(axis=0).sum(), call, [w],
            lambda out, i: out.backward())


def _embedding_out_of_range() -> Case:
    pargrad.random.seed(2)
    table = nn.Embedding(4, 2)
    rows = [[0, 1], [2, 3], [-1, 0], [3, 4], [1, 1]]
    return (lambda idx: table(idx).sum(), lambda i: (pargrad.tensor(rows[i]),),
            [table.weight], lambda out, i: out.backward())


def _dropout_switched_to_eval() -> Case:
    drop = nn.Dropout(0.5)
    w = pargrad.tensor(np.linspace(0.5, 2.0, 8), requires_grad=True)

    def call(i: int) -> tuple[Any, ...]:
        drop.train(i % 2 == 0)
        pargrad.random.seed(i)
        return (pargrad.tensor(np.ones(8)),)

    return lambda x: drop(w * x).sum(), call, [w], lambda out, i: out.backward()


def _array_argument_is_the_tensor_argument_s() -> Case:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    x0 = pargrad.tensor([3.0, 4.0])

    def call(i: int) -> tuple[Any, ...]:
        x = x0 if i == 0 else pargrad.tensor([3.0, 4.0 + i])
        return x, (x0.numpy() if i == 0 else np.array([-1.0, -2.0]))

    return (lambda x, a: (w * x).sum() + (w * a).sum(), call, [w],
            lambda out, i: out.backward())


def _hook_raising_on_the_loss() -> Case:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)

    def after(out: Any, i: int) -> Any:
        out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("no")))
        out.backward()

    return (lambda x: (pargrad.sin(w * x)).sum(), lambda i: (pargrad.tensor([1.0, i]),), [w],
            after)


SAME_AS_EAGER: dict[str, Callable[[], Case]] = {
    "a boolean mask made from values": _mask_mean,
    "enable_grad inside the function": _enable_grad_inside,
    "the returned loss changed in place after the call": _loss_changed_after_the_call,
    "two losses of one step, each backwarded": _two_losses,
    "0.0 and -0.0 arguments": _signed_zero,
    "a Fortran-ordered operand on large arrays": _fortran_layout,
    "embedding indices out of range": _embedding_out_of_range,
    "a Dropout switched between train and eval": _dropout_switched_to_eval,
    "an array argument that is a tensor argument's array": (
        _array_argument_is_the_tensor_argument_s),
    "a hook on the returned loss that raises": _hook_raising_on_the_loss,
}


@pytest.mark.parametrize("case", sorted(SAME_AS_EAGER))
def test_call_by_call_as_eagerly(case: str, canonical_engine: pargrad.Engine) -> None:
    """Cases a replay once got wrong, or that must fall back: every call gives what the
    eager call gives (values, every .grad, or the same error)."""
    make = SAME_AS_EAGER[case]
    assert _log(make, captured=True) == _log(make, captured=False)


def test_enable_grad_inside_a_step_called_under_no_grad() -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)

    def fn(x: Any) -> Any:
        with pargrad.enable_grad():
            return (w * x).sum()

    step = pargrad.capture(fn)
    for i in range(4):
        with pargrad.no_grad():
            out = step(pargrad.tensor([1.0, float(i)]))
        assert out.requires_grad
        out.backward()
    assert w.grad is not None
    np.testing.assert_array_equal(w.grad.numpy(), [4.0, 6.0])
    assert step.stats.replays == 3


@pytest.mark.timeout(60)
def test_threads_making_a_program_at_once() -> None:
    """Two threads on the first replay of one recording: both get the eager answer and
    the step keeps replaying."""
    w = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    for trial in range(10):
        step = pargrad.capture(lambda x: (pargrad.exp(w * x)).sum())
        step(pargrad.tensor([0.1, 0.2, 0.3]))
        barrier = threading.Barrier(2)
        results: list[float] = []

        def first_replay(step: Any, barrier: threading.Barrier, results: list[float]) -> None:
            barrier.wait()
            results.append(step(pargrad.tensor([0.1, 0.2, 0.3])).item())

        threads = [threading.Thread(target=first_replay, args=(step, barrier, results))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expected = (pargrad.exp(w * pargrad.tensor([0.1, 0.2, 0.3]))).sum().item()
        assert results == [expected, expected], trial
        assert step(pargrad.tensor([0.1, 0.2, 0.3])).item() == expected
        assert step.stats.fallback is None and step.stats.replays == 3


def test_returning_an_object_capture_does_not_look_inside_runs_eagerly() -> None:
    class Holder:
        def __init__(self, loss: Any) -> None:
            self.loss = loss

    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    step = pargrad.capture(lambda x: Holder((w * x).sum()))
    with pytest.warns(pargrad.CaptureWarning, match="returns a Holder"):
        step(pargrad.tensor([1.0, 1.0]))
    for k in range(3):
        held = step(pargrad.tensor([1.0, float(k)]))
        assert held.loss.item() == 1.0 + 2.0 * k
    assert step.stats.replays == 0 and step.stats.eager == 3


def test_an_object_guarded_by_identity_is_not_held() -> None:
    import gc
    import weakref

    class Model:
        def __init__(self) -> None:
            self.w = pargrad.tensor([1.0, 2.0], requires_grad=True)

        @pargrad.capture
        def loss(self, x: Any) -> Any:
            return (self.w * x).sum()

    models = [Model() for _ in range(3)]
    for m in models:
        m.loss(pargrad.tensor([1.0, 1.0]))
        m.loss(pargrad.tensor([1.0, 1.0]))
    alive = [weakref.ref(m) for m in models]
    del models, m
    gc.collect()
    assert all(r() is None for r in alive)
    assert not Model.loss._variants  # each variant went with its object
