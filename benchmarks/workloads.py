"""The benchmark workloads, in pargrad, and their plain-threads ceilings.

A workload owns its leaf arrays and writes its forward graph once, as ``graph(ops,
leaves)`` over an ``Ops`` namespace, so that pargrad and the peers (``benchmarks/peers.py``:
PyTorch, HIPS autograd) build the very same graph. It makes *trials* from them: one way
of computing its gradient, timed in two parts (a forward that builds what the backward
needs, then the backward). ``engine_trial`` runs the pargrad graph on an engine; the
branchy workloads also give ``ceiling_trial``, exactly the numpy kernels of that backward
on plain Python threads with no engine at all (the most threads can give), started, like
the engines' backward, right after the same forward; deep-elementwise gives one too,
its rules' arithmetic split across the threads by elements into buffers allocated once
(the streaming ceiling). Every trial's backward returns the
gradient of the first leaf, which the suite checks against the reference's.

Sizes: ``make_workloads(mode)`` gives each workload's parameters for ``full``/``quick``
(the same graphs; quick repeats less, and runs deep-elementwise and softmax-xent on
smaller arrays) and ``smoke`` (tiny graphs, for the test suite).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import pargrad
from pargrad.graph import AccumulateGrad, Dependencies


@dataclass(frozen=True)
class Trial:
    """One way of computing a workload's gradient. ``forward()`` builds the state that
    ``backward(state)`` needs and is timed apart; ``backward`` returns the checked
    gradient. ``fused``: the library has no separate forward (HIPS autograd traces the
    forward inside ``grad``), so ``forward`` does nothing and ``backward`` is both.
    ``prepare``: called untimed before each forward (PyTorch's thread count)."""

    forward: Callable[[], Any]
    backward: Callable[[Any], np.ndarray]
    fused: bool = False
    prepare: Callable[[], object] | None = None


@dataclass(frozen=True)
class Ops:
    """The few functions the workloads' graphs use beyond ``+ * @``, in one library."""

    const: Callable[[np.ndarray], Any]  # an array that needs no gradient
    tanh: Callable[[Any], Any]
    relu: Callable[[Any], Any]
    sum: Callable[[Any], Any]
    mean: Callable[[Any], Any]
    log_softmax: Callable[[Any, int], Any]  # (x, axis)
    exp: Callable[[Any], Any]


PARGRAD = Ops(const=pargrad.tensor, tanh=pargrad.tanh, relu=pargrad.relu, sum=pargrad.sum,
              mean=pargrad.mean, log_softmax=pargrad.log_softmax, exp=pargrad.exp)


def count_nodes(roots: list[pargrad.Tensor]) -> int:
    """The nodes a backward from ``roots`` runs (leaf accumulators not counted)."""
    nodes = Dependencies({t.grad_fn for t in roots if t.grad_fn is not None}).counts
    return sum(not isinstance(node, AccumulateGrad) for node in nodes)


class Workload:
    """What every workload has: a name, a one-line description, its leaf arrays and
    its graph, and the pargrad trial of that graph on any engine."""

    name: str
    description: str
    arrays: list[np.ndarray]  # the leaves; the first one's gradient is checked
    width: int | None = None  # independent branches, for the plot against graph width
    calls_blas = False  # its backward runs matmuls (BLAS threads matter)
    portable = True  # its graph is written over Ops, so the peers can build it too
    tiny_nodes = False  # nodes so small that PyTorch runs at 1 intra-op thread too
    _leaves: list[pargrad.Tensor] | None = None

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        """The forward graph on ``leaves`` (one per array), in ``ops``'s library;
        returns the loss."""
        raise NotImplementedError

    def _roots(self) -> list[pargrad.Tensor]:
        """A fresh forward in pargrad on the workload's leaves, their gradients reset."""
        if self._leaves is None:
            self._leaves = [pargrad.tensor(a, requires_grad=True) for a in self.arrays]
        for leaf in self._leaves:
            leaf.grad = None
        return [self.graph(PARGRAD, self._leaves)]

    def nodes(self) -> int:
        return count_nodes(self._roots())

    def engine_trial(self, engine: pargrad.Engine) -> Trial:
        def backward(roots: list[pargrad.Tensor]) -> np.ndarray:
            pargrad.backward(roots, engine=engine)
            assert self._leaves is not None and self._leaves[0].grad is not None
            return self._leaves[0].grad.numpy()
        return Trial(self._roots, backward)

    def ceiling_trial(self, threads: int, blas_1: bool) -> Trial | None:
        """The plain-threads ceiling on ``threads`` threads (BLAS at 1 thread with
        ``blas_1``), or None where the workload has none."""
        return None


def _sum_branches(parts: list[Any]) -> Any:
    """A left-deep chain of adds, as a loop summing the branches builds it."""
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss


# ----- the ceiling of the branchy workloads -----
_blas_controller: Any = None


_TANH_RULE = pargrad.ops.elementwise.tanh.rules[0]


def _tanh_backward(g: np.ndarray, ans: np.ndarray) -> np.ndarray:
    """tanh's gradient by pargrad's own rule (numba's fused kernel where installed), so
    that the plain threads run the kernels the engines run: a ceiling computing
    ``g * (1 - ans * ans)`` in three numpy passes ran below the reference's one. (The
    rule is found once: without the GIL, two threads looking it up through the same
    module and op objects for every call slowed each other down.)"""
    return _TANH_RULE(g, ans, None)


def _blas_1() -> Any:
    """A context that holds BLAS at one thread (threadpoolctl, libraries found once)."""
    global _blas_controller
    if _blas_controller is None:
        from threadpoolctl import ThreadpoolController
        _blas_controller = ThreadpoolController()
    return _blas_controller.limit(limits=1, user_api="blas")


class Branchy(Workload):
    """Independent branches from one leaf ``x``. Subclasses give the plain numpy forward
    of a branch and the backward kernels of a branch; the ceiling runs the kernels of
    an equal share of the branches on each of ``threads`` plain threads."""

    width: int

    def _forward_branch(self, b: int) -> Any:
        raise NotImplementedError

    def _backward_branch(self, b: int, values: Any) -> np.ndarray:
        """The gradient of ``x`` from branch ``b`` (computing its weights' too)."""
        raise NotImplementedError

    def _share(self, which: range, values: list[Any], out: list[np.ndarray]) -> None:
        grad_x: np.ndarray | None = None
        for b in which:
            g = self._backward_branch(b, values[b])
            grad_x = g if grad_x is None else grad_x + g
        assert grad_x is not None
        out.append(grad_x)

    def _run_ceiling(self, values: list[Any], threads: int) -> np.ndarray:
        parts: list[np.ndarray] = []
        shares = [range(i, self.width, threads) for i in range(min(threads, self.width))]
        if len(shares) == 1:
            self._share(shares[0], values, parts)
        else:
            pool = [threading.Thread(target=self._share, args=(share, values, parts))
                    for share in shares]
            for thread in pool:
                thread.start()
            for thread in pool:
                thread.join()
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def ceiling_trial(self, threads: int, blas_1: bool) -> Trial:
        def forward() -> list[Any]:
            return [self._forward_branch(b) for b in range(self.width)]

        def backward(values: list[Any]) -> np.ndarray:
            if blas_1:
                with _blas_1():
                    return self._run_ceiling(values, threads)
            return self._run_ceiling(values, threads)
        return Trial(forward, backward)


# ----- wide-matmul -----
class WideMatmul(Branchy):
    """``width`` branches from ``x``, each ``depth`` x (matmul by its own weight, tanh)."""

    name, calls_blas = "wide-matmul", True

    def __init__(self, width: int = 8, depth: int = 6, size: int = 256, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.width, self.depth, self.size = width, depth, size
        self.description = (f"{width} independent branches of {depth} x ({size}x{size} "
                            "matmul + tanh), summed")
        self.x = rng.standard_normal((size, size))
        self.weights = [[rng.standard_normal((size, size)) / np.sqrt(size)
                         for _ in range(depth)] for _ in range(width)]
        self.arrays = [self.x] + [w for branch in self.weights for w in branch]

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        x, weights = leaves[0], leaves[1:]
        parts = []
        for b in range(self.width):
            h = x
            for w in weights[b * self.depth:(b + 1) * self.depth]:
                h = ops.tanh(h @ w)
            parts.append(ops.sum(h))
        return _sum_branches(parts)

    def _forward_branch(self, b: int) -> list[tuple[np.ndarray, np.ndarray]]:
        h, layers = self.x, []
        for w in self.weights[b]:
            out = np.tanh(h @ w)
            layers.append((h, out))
            h = out
        return layers

    def _backward_branch(self, b: int, values: Any) -> np.ndarray:
        g: np.ndarray = np.broadcast_to(np.float64(1.0), (self.size, self.size))  # sum
        weight_grads = []  # kept alive, as an engine keeps the leaves' gradients
        for w, (h, ans) in zip(reversed(self.weights[b]), reversed(values)):
            g = _tanh_backward(g, ans)    # tanh
            weight_grads.append(h.T @ g)  # matmul, right operand
            g = g @ w.T                   # matmul, left operand
        return g


# ----- wide-elementwise -----
class WideElementwise(Branchy):
    """``width`` branches from ``x``, each ``depth`` x (tanh, times a constant)."""

    name = "wide-elementwise"

    def __init__(self, width: int = 8, depth: int = 4, size: int = 1_000_000,
                 seed: int = 1) -> None:
        rng = np.random.default_rng(seed)
        self.width, self.depth, self.size = width, depth, size
        self.description = (f"{width} independent branches of {depth} x (tanh, * c) on "
                            f"{size:,}-element arrays, summed")
        self.x = rng.standard_normal(size)
        self.constants = [0.9 + 0.025 * k for k in range(width)]
        self.arrays = [self.x]

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        parts = []
        for c in self.constants:
            y = leaves[0]
            for _ in range(self.depth):
                y = ops.tanh(y) * c
            parts.append(ops.sum(y))
        return _sum_branches(parts)

    def _forward_branch(self, b: int) -> list[np.ndarray]:
        y, layers = self.x, []
        for _ in range(self.depth):
            ans = np.tanh(y)
            layers.append(ans)
            y = ans * self.constants[b]
        return layers

    def _backward_branch(self, b: int, values: Any) -> np.ndarray:
        g: np.ndarray = np.broadcast_to(np.float64(1.0), (self.size,))  # sum
        c, tanh_backward = self.constants[b], _tanh_backward  # read once (as the nodes do)
        for ans in reversed(values):
            g = g * c                    # times the constant
            g = tanh_backward(g, ans)    # tanh
        return g


# ----- small-branches -----
class SmallBranches(WideElementwise):
    """``width`` independent branches of ``ops`` small ops each (tanh, times a constant,
    alternately) on 100-element arrays: parallel work whose nodes are all small, which
    threads can only run at once without the GIL (a free-threaded Python)."""

    tiny_nodes = True

    def __init__(self, width: int = 8, ops: int = 300, size: int = 100, seed: int = 6) -> None:
        super().__init__(width=width, depth=ops // 2, size=size, seed=seed)
        self.name = f"small-branches:{width}x{ops}"
        self.description = (f"{width} independent branches of {ops} ops (tanh, * c) on "
                            f"{size}-element arrays, summed")

    def ceiling_trial(self, threads: int, blas_1: bool) -> Trial:
        """The kernels of the backward on ``threads`` persistent plain threads, each
        working on arrays and constants it made itself. On nodes this small, what the
        threads share is what limits them without the GIL (every read of a shared object
        writes its reference count), so the ceiling shares nothing but the code: threads
        started per call, or reading the forward's arrays, measured below one thread."""
        crew = _Crew(self, threads)

        def backward(_: object) -> np.ndarray:
            return crew.run()
        return Trial(lambda: None, backward)


class _Crew:
    """Plain threads that each own a share of a SmallBranches' branches (their forward
    values and constants, made on the thread) and run that share's backward kernels
    whenever ``run`` asks; daemons, idle between calls."""

    def __init__(self, work: SmallBranches, threads: int) -> None:
        self.work, self.threads = work, threads
        self.parts: list[np.ndarray | None] = [None] * threads
        self.go = [threading.Semaphore(0) for _ in range(threads)]
        self.done = threading.Semaphore(0)
        self.started = False

    def _serve(self, k: int) -> None:
        work = self.work
        mine = range(k, work.width, self.threads)
        # This thread's own copies: arrays and floats made here, not the forward's.
        constants = {b: float(repr(work.constants[b])) for b in mine}
        values = {b: [v.copy() for v in work._forward_branch(b)] for b in mine}
        go, done, size, tanh_backward = self.go[k], self.done, work.size, _tanh_backward
        while True:
            go.acquire()
            total = None
            for b in mine:
                c = constants[b]
                g: np.ndarray = np.ones(size)
                for ans in reversed(values[b]):
                    g = tanh_backward(g * c, ans)
                total = g if total is None else total + g
            self.parts[k] = total
            done.release()

    def run(self) -> np.ndarray:
        if not self.started:
            for k in range(self.threads):
                threading.Thread(target=self._serve, args=(k,), daemon=True,
                                 name=f"ceiling-{k}").start()
            self.started = True
        for go in self.go:
            go.release()
        for _ in range(self.threads):
            self.done.acquire()
        total = self.parts[0]
        assert total is not None
        for part in self.parts[1:]:
            assert part is not None
            total = total + part
        return total


# ----- fan-in -----
class FanIn(Branchy):
    """One leaf ``x`` read by ``width`` consumers ``tanh(x * c_k).sum()``: every consumer
    delivers into the one gradient buffer of ``x``."""

    name = "fan-in"

    def __init__(self, width: int = 256, size: int = 1 << 16, seed: int = 2) -> None:
        rng = np.random.default_rng(seed)
        self.width, self.size = width, size
        self.description = (f"one {size:,}-element leaf used by {width} consumers "
                            "tanh(x * c).sum(), summed")
        self.x = rng.standard_normal(size)
        self.constants = [float(c) for c in np.linspace(0.5, 1.5, width)]
        self.arrays = [self.x]

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        return _sum_branches([ops.sum(ops.tanh(leaves[0] * c)) for c in self.constants])

    def _forward_branch(self, b: int) -> np.ndarray:
        return np.tanh(self.x * self.constants[b])

    def _backward_branch(self, b: int, values: Any) -> np.ndarray:
        g: np.ndarray = np.broadcast_to(np.float64(1.0), (self.size,))  # sum
        return g * (1 - values * values) * self.constants[b]


# ----- tiny-chain -----
class TinyChain(Workload):
    """``ops`` small ops one after another: the engine's cost per node."""

    name, tiny_nodes = "tiny-chain", True

    def __init__(self, ops: int = 3000, size: int = 100) -> None:
        self.ops, self.size = ops, size
        self.description = f"{ops} ops (tanh, * 1.0001) on {size}-element arrays, in a chain"
        self.arrays = [np.linspace(-1.0, 1.0, size)]

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        y = leaves[0]
        for i in range(self.ops):
            y = ops.tanh(y) if i % 2 == 0 else y * 1.0001
        return ops.sum(y)


# ----- mlp-step -----
class MlpStep(Workload):
    """A float32 MLP's forward and backward: relu layers, mean cross-entropy."""

    name, calls_blas = "mlp-step", True

    def __init__(self, batch: int = 512, sizes: tuple[int, ...] = (784, 1024, 1024, 10),
                 seed: int = 3) -> None:
        rng = np.random.default_rng(seed)
        self.batch, self.sizes = batch, sizes
        self.description = (f"float32 MLP {'-'.join(map(str, sizes))}, batch {batch}, relu, "
                            "mean cross-entropy: forward and backward")
        self.x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
        self.labels = rng.integers(0, sizes[-1], batch)
        self.arrays = []
        for fan_in, fan_out in itertools.pairwise(sizes):
            self.arrays.append((rng.standard_normal((fan_in, fan_out))
                                * np.sqrt(2 / fan_in)).astype(np.float32))
            self.arrays.append(np.zeros(fan_out, np.float32))

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        h = ops.const(self.x)
        for i in range(0, len(leaves) - 2, 2):
            h = ops.relu(h @ leaves[i] + leaves[i + 1])
        log_probs = ops.log_softmax(h @ leaves[-2] + leaves[-1], 1)
        return -ops.mean(log_probs[np.arange(self.batch), self.labels])


# ----- deep-elementwise -----
class DeepElementwise(Workload):
    """One chain of ``cycles`` x 6 elementwise ops on one large array: a graph with no
    branches, where only parallelism inside an op (intra-op) can help."""

    name = "deep-elementwise"

    def __init__(self, size: int = 4_000_000, cycles: int = 4, seed: int = 5) -> None:
        self.size, self.cycles = size, cycles
        self.description = (f"one chain of {cycles} x (tanh, * 1.5, + 0.1, relu, exp, * 0.3) "
                            f"= {6 * cycles} ops on {size:,}-element arrays, summed")
        self.arrays = [np.random.default_rng(seed).standard_normal(size)]

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        y = leaves[0]
        for _ in range(self.cycles):  # values stay within (0, 1.5]: exp never overflows
            y = ops.exp(ops.relu(ops.tanh(y) * 1.5 + 0.1)) * 0.3
        return ops.sum(y)

    def ceiling_trial(self, threads: int, blas_1: bool) -> Trial:
        """The streaming ceiling: the backward's arithmetic (each rule's, in the rules'
        order) on ``threads`` plain threads, each owning an equal slice of the elements
        and its buffers allocated once, so that no pass faults memory in: what a second
        core buys a chain of passes that only stream memory."""
        n = self.size
        cuts = [n * k // threads for k in range(threads + 1)]
        slices = [slice(a, b) for a, b in itertools.pairwise(cuts)]
        buffers = [(np.empty(s.stop - s.start), np.empty(s.stop - s.start),
                    np.empty(s.stop - s.start, bool)) for s in slices]

        def forward() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            y, saved = self.arrays[0], []
            for _ in range(self.cycles):
                t = np.tanh(y)
                b = t * 1.5 + 0.1
                e = np.exp(np.maximum(b, 0))
                saved.append((t, b, e))
                y = e * 0.3
            return saved

        def share(k: int, saved: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
            piece, (g, tmp, mask) = slices[k], buffers[k]
            g.fill(1.0)  # sum's gradient
            for t, b, e in reversed(saved):
                np.multiply(g, 0.3, out=g)                       # * 0.3
                np.multiply(g, e[piece], out=g)                  # exp: g * ans
                np.greater(b[piece], 0, out=mask)                # relu: g * (x > 0)
                np.multiply(g, mask, out=g)
                np.multiply(g, 1.5, out=g)                       # * 1.5 (+ 0.1: g)
                np.multiply(t[piece], t[piece], out=tmp)         # tanh: g * (1 - ans^2)
                np.subtract(1.0, tmp, out=tmp)
                np.multiply(g, tmp, out=g)

        def backward(saved: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
            if threads == 1:
                share(0, saved)
            else:
                pool = [threading.Thread(target=share, args=(k, saved))
                        for k in range(threads)]
                for thread in pool:
                    thread.start()
                for thread in pool:
                    thread.join()
            return np.concatenate([g for g, _, _ in buffers])
        return Trial(forward, backward)


# ----- softmax-xent -----
class SoftmaxXent(Workload):
    """A linear classifier head on a large batch: ``logits = x @ W + b``, log_softmax
    over the classes, mean negative log-likelihood of the labels. Its backward is one
    matmul (for W) and the softmax's and indexing's rules on ``batch x classes``
    elements."""

    name, calls_blas = "softmax-xent", True

    def __init__(self, batch: int = 16384, features: int = 64, classes: int = 256,
                 seed: int = 6) -> None:
        rng = np.random.default_rng(seed)
        self.batch = batch
        self.description = (f"classifier head: logits = x @ W + b ({batch} x {features} "
                            f"-> {classes} classes, float64), log_softmax, mean NLL")
        self.x = rng.standard_normal((batch, features))
        self.labels = rng.integers(0, classes, batch)
        self.arrays = [rng.standard_normal((features, classes)) / np.sqrt(features),
                       np.zeros(classes)]

    def graph(self, ops: Ops, leaves: list[Any]) -> Any:
        log_probs = ops.log_softmax(ops.const(self.x) @ leaves[0] + leaves[1], 1)
        return -ops.mean(log_probs[np.arange(self.batch), self.labels])


# ----- random-dag -----
class RandomDag(Workload):
    """A random DAG from the test suite's recipes (``tests/strategies.py``'s
    ``make_recipe``, which its ``graph_recipes`` strategy draws with hypothesis; here
    the one with the most steps of 20 made from fixed seeds, with up to ``steps``
    steps): fan-out, fan-in, multi-output custom Functions, broadcasting; arrays of at
    most 3x3. Its roots are every value that no later step uses (the recipe's own roots
    reach only a few steps), each with a random root gradient, in one backward call. Not
    portable: the recipe builds pargrad graphs (with a pargrad Function); PyTorch runs
    its translation op for op (``benchmarks/torch_recipes.py``), HIPS autograd does not
    run it."""

    portable, tiny_nodes = False, True

    def __init__(self, steps: int, seed: int = 4) -> None:
        self.name = f"random-dag:{steps}"
        recipe = _draw_recipe(steps)
        self.arrays = list(recipe.leaves)
        self.leaves = [pargrad.tensor(a, requires_grad=flag)
                       for a, flag in zip(recipe.leaves, recipe.requires_grad)]
        used = {i for step in recipe.steps for i in step[1:3] if isinstance(i, int)}
        n_leaves = len(recipe.leaves)
        sinks = [k for k in range(n_leaves, n_leaves + len(recipe.steps)) if k not in used]
        self.recipe = dataclasses.replace(recipe, roots=tuple(sinks), root_grads=())
        roots = [(k, t.shape) for k, t in zip(sinks, self._roots()) if t.requires_grad]
        self.recipe = dataclasses.replace(self.recipe, roots=tuple(k for k, _ in roots))
        rng = np.random.default_rng(seed)
        self.root_grads = [rng.uniform(-1, 1, shape) for _, shape in roots]
        self.description = (f"random DAG from tests/strategies.py: {len(recipe.steps)} steps "
                            f"on {n_leaves} leaves of side {recipe.n}, {len(roots)} roots")

    def _roots(self) -> list[pargrad.Tensor]:
        for leaf in self.leaves:
            leaf.grad = None
        return list(self.recipe.build(self.leaves))

    def _leaf_grads(self) -> np.ndarray:
        """Every leaf's gradient, flattened one after another (zeros where a leaf got
        none)."""
        return np.concatenate([np.zeros(leaf.data.size) if leaf.grad is None
                               else leaf.grad.numpy().ravel() for leaf in self.leaves])

    def engine_trial(self, engine: pargrad.Engine) -> Trial:
        grads = [pargrad.tensor(g) for g in self.root_grads]

        def backward(roots: list[pargrad.Tensor]) -> np.ndarray:
            pargrad.backward(roots, grads, engine=engine)
            return self._leaf_grads()
        return Trial(self._roots, backward)


_EXAMPLES = 20  # recipes made per size (seeds 0-19); the one with the most steps is used


def _draw_recipe(steps: int) -> Any:
    """The recipe with the most steps among those of seeds 0 to 19 (``SeededChoices``:
    the same graphs on every hypothesis version and in every process)."""
    from tests.strategies import SeededChoices, make_recipe
    made = [make_recipe(SeededChoices(seed), max_steps=steps) for seed in range(_EXAMPLES)]
    return max(made, key=lambda recipe: len(recipe.steps))


# ----- sizes -----
SMOKE: dict[str, dict[str, Any]] = {
    "wide-matmul": {"width": 2, "depth": 2, "size": 16},
    "wide-elementwise": {"width": 2, "depth": 2, "size": 1000},
    "tiny-chain": {"ops": 50},
    "fan-in": {"width": 8, "size": 64},
    "mlp-step": {"batch": 8, "sizes": (16, 8, 8, 3)},
    "deep-elementwise": {"size": 1000, "cycles": 1},
    "softmax-xent": {"batch": 16, "features": 4, "classes": 5},
}
"""The tiny sizes of smoke mode; full uses the defaults of each class."""
QUICK: dict[str, dict[str, Any]] = {
    "deep-elementwise": {"size": 500_000},
    "softmax-xent": {"batch": 2048},
}
"""Quick mode's smaller arrays (the same graphs); the other workloads keep their defaults."""
CLASSES: dict[str, Callable[..., Workload]] = {
    "wide-matmul": WideMatmul, "wide-elementwise": WideElementwise, "tiny-chain": TinyChain,
    "fan-in": FanIn, "mlp-step": MlpStep, "deep-elementwise": DeepElementwise,
    "softmax-xent": SoftmaxXent}
RANDOM_DAG_STEPS = {"full": (30, 300, 1000), "quick": (30, 300), "smoke": (12,)}
SMALL_BRANCHES = {"full": ((8, 300), (2, 500)), "quick": ((8, 300), (2, 500)),
                  "smoke": ((2, 12),)}
"""(branches, ops per branch) of the small-branches workloads."""


def selected(name: str, only: list[str] | None) -> bool:
    """Whether ``--only`` picks workload ``name``: ``wide-matmul`` that workload,
    ``random-dag`` every size (``random-dag:30``, ...), ``small-branches`` both shapes;
    None picks every workload."""
    return only is None or any(name == o or name.startswith(o + ":") for o in only)


def make_workloads(mode: str) -> dict[str, Callable[[], Workload]]:
    """Every workload's name and constructor at the sizes of ``mode`` (``full``,
    ``quick`` or ``smoke``). The random-dag constructors need hypothesis (they import
    tests/strategies.py, which does) and raise ImportError without it."""
    sized = SMOKE if mode == "smoke" else QUICK if mode == "quick" else {}
    made: dict[str, Callable[[], Workload]] = {
        name: functools.partial(cls, **sized.get(name, {})) for name, cls in CLASSES.items()}
    for steps in RANDOM_DAG_STEPS[mode]:
        made[f"random-dag:{steps}"] = functools.partial(RandomDag, steps)
    for width, ops in SMALL_BRANCHES[mode]:
        made[f"small-branches:{width}x{ops}"] = functools.partial(SmallBranches, width, ops)
    return made


ELEMENTWISE_SWEEP: dict[str, tuple[tuple[int, int, int], ...]] = {
    "full": (*((b, d, 300_000) for b in (2, 6, 8) for d in (2, 4)),
             (6, 4, 30_000), (6, 4, 1_000_000), (2, 2, 30_000)),
    "quick": ((2, 2, 30_000), (6, 4, 300_000), (8, 2, 1_000_000)),
    "smoke": ((2, 2, 1000), (3, 1, 2000)),
}
"""(branches, depth, elements) of the wide-elementwise sweep: the engine against the
plain-threads ceiling away from the suite's own size (6 x 4 on 3e5 was the worst seen)."""


def make_wide(name: str, mode: str, width: int) -> Branchy:
    """``name`` (wide-matmul or wide-elementwise) at the sizes of ``mode`` with
    ``width`` branches: the graphs of the plot against graph width."""
    made = CLASSES[name](**{**(SMOKE[name] if mode == "smoke" else {}), "width": width})
    assert isinstance(made, Branchy)
    return made
