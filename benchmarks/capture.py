"""The capture workloads: what ``pargrad.capture`` buys on steps of small ops, against
pargrad eager, PyTorch eager and (where it compiles in reasonable time) ``torch.compile``.

- ``tiny-chain``: 300 x (sin, times 0.9, plus 0.1) on 50 float64, summed; forward and
  backward, per op (900 ops). ``kernels`` is the numpy calls alone (the forward's and
  the gradient rules', no autograd): the floor. In full runs also ``torch.compile`` of
  the same function (its first call, which compiles, is reported apart); its target
  applies with ``pargrad[fast]`` only.
- ``mlp-step``: a training step in float32: 3 linear layers of 64 (the last to 10
  classes), ReLU between, cross-entropy on a batch of 32, SGD with momentum (zero the
  gradients, forward, backward, update). pargrad's captured step records the loss;
  the update runs eagerly, as it does in every user's loop.
- ``random-dag:600``: a random DAG of 600 small nodes from tests/strategies.py (its
  recipes without custom Functions), every sink a root: the backward alone, captured on
  the default engine against the eager reference engine (``SequentialEngine``).
- ``first call``: each workload's first captured call (it runs eagerly and records)
  over an eager call, forward only; and the second call, the first replay, which makes
  the program from the recording.

Contenders take turns within each repeat (interleaved), medians of the repeats. PyTorch
runs at the cores' thread count and at one thread; the targets take the faster.
Timings are printed and saved, never asserted. ``python -m benchmarks.capture [full |
quick | smoke]`` runs this part alone (quick by default); ``python -m benchmarks`` runs it
after the workloads (``--only capture``).
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import pargrad
from benchmarks import report
from pargrad.ops import fused
from pargrad.ops.elementwise import sin
from pargrad.replay import source

NAME = "capture"
REPEATS = {"full": 41, "quick": 11, "smoke": 1}
CHAIN = {"full": 300, "quick": 300, "smoke": 5}  # links of (sin, x 0.9, + 0.1)
DAG_STEPS = {"full": 600, "quick": 600, "smoke": 20}
COMPILE_IN = ("full",)  # the modes that try torch.compile (tens of seconds to compile)

Step = Callable[[], Any]


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _interleaved(steps: dict[str, Step], repeats: int,
                 warmup: int = source.COMPILE_AFTER + 1) -> dict[str, float]:
    """Median milliseconds of each step, the steps taking turns within each repeat; the
    warm-up calls include a captured step's recording and compiling."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    gc.collect()
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            started = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - started)
    return {name: _median_ms(t) for name, t in times.items()}


# ----- tiny-chain -----

def _chain(x: Any, links: int) -> Any:
    h = x
    for _ in range(links):
        h = pargrad.sin(h) * 0.9 + 0.1
    return h.sum()


_SIN_RULE = sin.rules[0]


def _kernels(x: np.ndarray, links: int) -> None:
    values = []
    h = x
    for _ in range(links):
        values.append(h)
        h = np.sin(h) * 0.9 + 0.1
    h.sum()
    g = np.ones_like(h)
    for k in reversed(range(links)):
        g = _SIN_RULE(g * 0.9, None, values[k])


def tiny_chain(mode: str, torch: Any) -> dict[str, Any]:
    links = CHAIN[mode]
    ops = 3 * links
    data = np.linspace(-1.0, 1.0, 50)
    x = pargrad.tensor(data, requires_grad=True)
    captured = pargrad.capture(lambda t: _chain(t, links))

    def eager() -> None:
        _chain(x, links).backward()

    def replayed() -> None:
        captured(x).backward()

    steps: dict[str, Step] = {"pargrad eager": eager, "pargrad captured": replayed,
                              "kernels": lambda: _kernels(data, links)}
    first = _first_call(lambda: pargrad.capture(lambda t: _chain(t, links)), (x,),
                        lambda: _chain(x, links))
    extra: dict[str, Any] = {}
    if torch is not None:
        tx = torch.tensor(data, requires_grad=True)

        def torch_chain(t: Any) -> Any:
            h = t
            for _ in range(links):
                h = torch.sin(h) * 0.9 + 0.1
            return h.sum()

        steps.update(_torch_steps(torch, lambda: torch_chain(tx).backward()))
        if mode in COMPILE_IN:
            compiled, extra = _compiled(torch, torch_chain, tx)
            if compiled is not None:
                steps["torch.compile"] = compiled
    figures = _interleaved(steps, REPEATS[mode])
    return {"ops": ops, "ms": figures,
            "us_per_op": {name: ms * 1e3 / ops for name, ms in figures.items()},
            "first_call_over_eager": first[0], "first_replay_over_eager": first[1], **extra}


def _torch_steps(torch: Any, step: Step) -> dict[str, Step]:
    threads = _torch_threads[0]

    def at(n: int) -> Step:
        def run() -> None:
            torch.set_num_threads(n)
            step()
        return run

    found = {f"torch({threads})": at(threads)}
    if threads > 1:
        found["torch(1)"] = at(1)
    return found


def _compiled(torch: Any, fn: Callable[[Any], Any], x: Any) -> tuple[Step | None, dict[str, Any]]:
    """``torch.compile(fn)`` and the seconds its first call took, or None and why."""
    started = time.perf_counter()
    try:
        compiled = torch.compile(fn)
        compiled(x).backward()
    except Exception as exc:  # a missing compiler, an unsupported platform
        return None, {"torch.compile": f"did not compile: {type(exc).__name__}: {exc}"[:300]}
    seconds = time.perf_counter() - started
    return (lambda: compiled(x).backward()), {"torch.compile_first_call_s": seconds}


def _first_call(make: Callable[[], Any], args: tuple[Any, ...], eager: Step,
                repeats: int = 5) -> tuple[float, float]:
    """Medians, over ``repeats`` fresh captures, of the first call's time (it records)
    and of the second's (the first replay: it makes the program from the recording) over
    an eager call's, forward only, taken in turn."""
    first, second = [], []
    for _ in range(repeats):
        step = make()
        started = time.perf_counter()
        eager()
        plain = time.perf_counter() - started
        started = time.perf_counter()
        step(*args)
        recording = time.perf_counter() - started
        started = time.perf_counter()
        step(*args)
        making = time.perf_counter() - started
        first.append(recording / plain)
        second.append(making / plain)
    return statistics.median(first), statistics.median(second)


# ----- mlp-step -----

SIZES = (64, 64, 64, 10)
BATCH = 32


def _logits(params: list[Any], h: Any, relu: Callable[[Any], Any]) -> Any:
    """The MLP's forward, in either library: a linear layer per (weight, bias) pair of
    ``params``, ``relu`` between them."""
    for k in range(0, len(params), 2):
        h = h @ params[k] + params[k + 1]
        if k + 2 < len(params):
            h = relu(h)
    return h


def _training(opt: Any, loss: Callable[[Any, Any], Any], batches: list[Any]) -> Step:
    """A training step on the next of ``batches``, in either library: zero the
    gradients, forward, backward, update."""
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad()
        loss(x, y).backward()
        opt.step()
    return step


def mlp_step(mode: str, torch: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    weights = [(rng.normal(0, n ** -0.5, (n, m)).astype(np.float32), np.zeros(m, np.float32))
               for n, m in itertools.pairwise(SIZES)]
    batches = [(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32),
                rng.integers(0, SIZES[-1], BATCH)) for _ in range(4)]
    tensors = [(pargrad.tensor(x), pargrad.tensor(y)) for x, y in batches]

    def pargrad_model() -> tuple[list[pargrad.Tensor], Callable[..., Any]]:
        params = [pargrad.tensor(a.copy(), requires_grad=True) for pair in weights for a in pair]
        return params, lambda x, y: pargrad.cross_entropy(_logits(params, x, pargrad.relu), y)

    def loop(loss: Callable[..., Any], params: list[pargrad.Tensor]) -> Step:
        return _training(pargrad.optim.SGD(params, lr=0.01, momentum=0.9), loss, tensors)

    eager_params, eager_loss = pargrad_model()
    captured_params, plain_loss = pargrad_model()
    steps: dict[str, Step] = {"pargrad eager": loop(eager_loss, eager_params),
                              "pargrad captured": loop(pargrad.capture(plain_loss),
                                                       captured_params)}
    _, loss = pargrad_model()
    x0, y0 = tensors[0]
    first = _first_call(lambda: pargrad.capture(loss), (x0, y0), lambda: loss(x0, y0))
    if torch is not None:
        steps.update(_torch_steps(torch, _torch_mlp(torch, weights, batches)))
    figures = _interleaved(steps, REPEATS[mode])
    return {"ms": figures, "first_call_over_eager": first[0],
            "first_replay_over_eager": first[1]}


def _torch_mlp(torch: Any, weights: list[tuple[np.ndarray, np.ndarray]],
               batches: list[tuple[np.ndarray, np.ndarray]]) -> Step:
    params = [torch.tensor(a.copy(), requires_grad=True) for pair in weights for a in pair]
    return _training(
        torch.optim.SGD(params, lr=0.01, momentum=0.9),
        lambda x, y: torch.nn.functional.cross_entropy(_logits(params, x, torch.relu), y),
        [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches])


# ----- random-dag -----

def random_dag(mode: str) -> dict[str, Any]:
    from tests.strategies import BINARY_STEPS, UNARY_STEPS, SeededChoices, make_recipe

    steps = DAG_STEPS[mode]
    made = [make_recipe(SeededChoices(seed), max_steps=steps, kinds=UNARY_STEPS + BINARY_STEPS)
            for seed in range(20)]
    recipe = max(made, key=lambda r: len(r.steps))
    leaves = [pargrad.tensor(a, requires_grad=flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    used = {i for step in recipe.steps for i in step[1:3] if isinstance(i, int)}
    n_leaves = len(recipe.leaves)
    sinks = tuple(k for k in range(n_leaves, n_leaves + len(recipe.steps)) if k not in used)
    recipe = type(recipe)(recipe.n, recipe.leaves, recipe.requires_grad, recipe.steps, sinks,
                          ())

    def roots_of(*args: Any) -> list[Any]:
        return [r for r in recipe.build(list(args)) if r.requires_grad]

    captured = pargrad.capture(roots_of)
    reference = pargrad.SequentialEngine()
    timed: dict[str, list[float]] = {"reference eager": [], "default captured": []}
    grads: dict[str, list[np.ndarray]] = {}

    def run(name: str, make: Callable[..., Any], engine: pargrad.Engine | None) -> None:
        for leaf in leaves:
            leaf.grad = None
        roots = make(*leaves)
        ones = [pargrad.ones_like(r) for r in roots]
        started = time.perf_counter()
        pargrad.backward(roots, ones, engine=engine)
        timed[name].append(time.perf_counter() - started)
        grads[name] = [np.zeros(0) if t.grad is None else t.grad.numpy().copy()
                       for t in leaves]

    first = _first_call(lambda: pargrad.capture(roots_of), tuple(leaves),
                        lambda: roots_of(*leaves))
    for _ in range(source.COMPILE_AFTER + 1):  # warm-up: the recording, the compile
        run("default captured", captured, None)
        run("reference eager", roots_of, reference)
    for name in timed:
        timed[name].clear()
    gc.collect()
    for r in range(REPEATS[mode]):
        order = [("reference eager", roots_of, reference), ("default captured", captured, None)]
        for name, make, engine in order[r % 2:] + order[:r % 2]:
            run(name, make, engine)
    for got, expected in zip(grads["default captured"], grads["reference eager"]):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    return {"steps": steps, "nodes": len(recipe.steps),
            "backward_ms": {k: _median_ms(v) for k, v in timed.items()},
            "first_call_over_eager": first[0], "first_replay_over_eager": first[1],
            "replays": captured.stats.replays}


_torch_threads = [1]  # PyTorch's thread count as the run found it (its cores)


def run_capture(mode: str) -> dict[str, Any]:
    """Every figure of the capture workloads."""
    try:
        import torch
    except ImportError:
        torch = None
    else:
        _torch_threads[0] = torch.get_num_threads()
    # The chain last: torch.compile's minute of compiling leaves the machine busy a while.
    figures = {"mlp-step": mlp_step(mode, torch), "random-dag": random_dag(mode)}
    figures["tiny-chain"] = tiny_chain(mode, torch)
    return figures


def _best_torch(ms: dict[str, float]) -> float | None:
    found = [v for k, v in ms.items() if k.startswith("torch(")]
    return min(found) if found else None


def capture_targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of capture, each with its measured ratio (None: not measured), as
    ``report.targets`` gives the others."""
    out: list[dict[str, Any]] = []
    chain = figures["tiny-chain"]["ms"]
    best = _best_torch(chain)
    report._target(out, "capture tiny-chain: captured / fastest torch eager",
                   None if best is None else chain["pargrad captured"] / best, 0.5, False,
                   "forward+backward per op")
    if "torch.compile" in chain and fused.enabled():  # a target with pargrad[fast] only
        report._target(out, "capture tiny-chain: captured / torch.compile",
                       chain["pargrad captured"] / chain["torch.compile"], 1.0, False,
                       "forward+backward per op")
    mlp = figures["mlp-step"]["ms"]
    best = _best_torch(mlp)
    report._target(out, "capture mlp-step: captured / fastest torch eager",
                   None if best is None else mlp["pargrad captured"] / best, 0.7, False,
                   "zero_grad+forward+backward+SGD step")
    dag = figures["random-dag"]["backward_ms"]
    report._target(out, f"capture random-dag:{figures['random-dag']['steps']}: captured on "
                   f"the default engine / eager sequential", dag["default captured"]
                   / dag["reference eager"], 0.5, False, "backward")
    first = max(figures[name]["first_call_over_eager"] for name in
                ("tiny-chain", "mlp-step", "random-dag"))
    report._target(out, "capture: first call (records) / eager call, worst workload", first,
                   3.0, False, "forward")
    return out


def print_capture(figures: dict[str, Any]) -> None:
    chain = figures["tiny-chain"]
    print(f"\ncapture: tiny-chain ({chain['ops']} ops on 50 float64), forward + backward, "
          f"microseconds per op (median):")
    for name, us in chain["us_per_op"].items():
        print(f"  {name:<20}{us:8.2f}")
    if "torch.compile_first_call_s" in chain:
        print(f"  (torch.compile's first call took {chain['torch.compile_first_call_s']:.1f} s)")
    elif "torch.compile" in chain and isinstance(chain["torch.compile"], str):
        print(f"  (torch.compile: {chain['torch.compile']})")
    print("capture: mlp-step (float32, 64-64-64-10, batch 32, SGD), milliseconds per step:")
    for name, ms in figures["mlp-step"]["ms"].items():
        print(f"  {name:<20}{ms:8.3f}")
    dag = figures["random-dag"]
    print(f"capture: random-dag ({dag['nodes']} nodes), backward milliseconds:")
    for name, ms in dag["backward_ms"].items():
        print(f"  {name:<20}{ms:8.3f}")
    print("capture: first call (records) / eager call, forward: " + ", ".join(
        f"{name} {figures[name]['first_call_over_eager']:.2f}"
        for name in ("tiny-chain", "mlp-step", "random-dag")))
    print("capture: second call (makes the program, replays) / eager call, forward: "
          + ", ".join(f"{name} {figures[name]['first_replay_over_eager']:.2f}"
                      for name in ("tiny-chain", "mlp-step", "random-dag")))


if __name__ == "__main__":
    import sys

    from benchmarks.measure import simd

    mode = sys.argv[1] if len(sys.argv) > 1 else "quick"
    print("numpy SIMD:", simd())
    figures = run_capture(mode)
    print_capture(figures)
    report.print_targets(capture_targets(figures), mode)
