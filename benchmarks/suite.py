"""The suite: which contenders run on which workload, in what order, how often.

Contenders of every workload: ``sequential`` (the reference), ``threaded(w)`` for each
``w`` in ``--workers`` (``workers`` counts pool threads; the thread that calls backward
runs nodes too, so ``threaded(1)`` runs nodes on two threads), ``threaded(d,
deterministic)`` at the default worker count ``d`` (cores - 1), and on the workloads
that call BLAS ``threaded(d, limit_blas)``. The branchy workloads add the plain-threads
ceiling: ``ceiling(1)`` (the kernels inline), ``ceiling(c)`` on ``c`` = cores threads at
default BLAS and ``ceiling(c, BLAS 1)`` with BLAS held at one thread. Then the peers
that are installed, on the same graph.

Every contender first runs once untimed and its gradient is compared with the
reference's (a wrong contender is an error, not a figure); then the repeats; then the
memory pass of the pargrad engines and the ceilings.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pargrad
from benchmarks import peers
from benchmarks.measure import (
    backward_summary,
    measure,
    peak_backward_bytes,
    pool_footprint,
    summary,
    time_trial,
)
from benchmarks.workloads import (
    ELEMENTWISE_SWEEP,
    Branchy,
    Trial,
    WideElementwise,
    Workload,
    make_wide,
)

SEQUENTIAL = "sequential"
EVERY_NODE = "threaded(1, all handed off)"


@dataclass(frozen=True)
class Settings:
    mode: str  # full, quick or smoke
    repeats: int  # at least; more while a round of all contenders takes under round_s
    max_repeats: int
    budget_s: float  # the time the repeats of one workload may take, roughly
    warmup: int
    memory_repeats: int
    workers: tuple[int, ...]
    cores: int
    widths: tuple[int, ...]  # branches of the graphs against graph width
    width_repeats: int


def settings(mode: str, workers: tuple[int, ...], cores: int) -> Settings:
    """Repeats and sizes of ``mode``: full (7 to 101 repeats after 2 warm-up, as many as
    fit in about 12 s per workload: the graphs of a few milliseconds, whose ratios a
    stray millisecond moves most, get the most), quick (3 to 15 after 1, about 2 s: the same graphs
    but two random DAGs, under two minutes here), smoke (tiny graphs, one run: for CI)."""
    if mode == "full":
        return Settings(mode, 7, 101, 12.0, 2, 2, workers, cores, (1, 2, 4, 8, 16), 5)
    if mode == "quick":
        return Settings(mode, 3, 15, 2.0, 1, 1, workers, cores, (1, 2, 4, 8), 2)
    return Settings(mode, 1, 1, 0.0, 0, 1, workers, cores, (1, 2), 1)


@dataclass
class Contenders:
    """The engines of one suite run (made once, shut down at the end) and the peers."""

    default_workers: int
    workers: tuple[int, ...]
    engines: dict[str, pargrad.Engine] = field(default_factory=dict)
    blas_engines: dict[str, pargrad.Engine] = field(default_factory=dict)
    budget_engines: dict[str, pargrad.Engine] = field(default_factory=dict)
    # On the workloads of tiny nodes: one worker with every node handed off, the cost
    # of the threaded engine's own per-node path (docs/performance.md, free threading).
    handoff_engines: dict[str, pargrad.Engine] = field(default_factory=dict)
    peers: dict[str, Any] = field(default_factory=dict)
    skipped_peers: dict[str, str] = field(default_factory=dict)

    def threaded(self) -> list[str]:
        """The names of the ThreadedEngine contenders (limit_blas ones last)."""
        return [name for name in [*self.engines, *self.blas_engines, *self.budget_engines,
                                  *self.handoff_engines] if name != SEQUENTIAL]


@contextmanager
def contenders(workers: tuple[int, ...], cores: int, use_peers: bool) -> Iterator[Contenders]:
    from pargrad.engine.threaded import default_workers
    d = default_workers()
    made = Contenders(d, workers)
    made.engines[SEQUENTIAL] = pargrad.SequentialEngine()
    for w in workers:
        made.engines[f"threaded({w})"] = pargrad.ThreadedEngine(workers=w)
    made.engines[f"threaded({d}, deterministic)"] = pargrad.ThreadedEngine(
        workers=d, deterministic=True)
    made.blas_engines[f"threaded({d}, limit_blas)"] = pargrad.ThreadedEngine(
        workers=d, limit_blas=True)
    if "memory_budget" in inspect.signature(pargrad.ThreadedEngine).parameters:  # compare
        made.budget_engines[f"threaded({d}, memory_budget=0)"] = pargrad.ThreadedEngine(
            workers=d, memory_budget=0)  # runs this code on older commits too
    made.handoff_engines[EVERY_NODE] = pargrad.ThreadedEngine(workers=1, handoff_threshold=0)
    if use_peers:
        made.peers, made.skipped_peers = peers.load(cores)
    else:
        made.skipped_peers = {name: "--no-peers" for name in peers.PEERS}
    try:
        yield made
    finally:
        for engine in [*made.engines.values(), *made.blas_engines.values(),
                       *made.budget_engines.values(), *made.handoff_engines.values()]:
            if isinstance(engine, pargrad.ThreadedEngine):
                engine.shutdown()


def ceiling_names(cores: int) -> tuple[str, str, str]:
    """Names of the ceilings: inline, on ``cores`` threads, and those at BLAS 1."""
    return "ceiling(1)", f"ceiling({cores})", f"ceiling({cores}, BLAS 1)"


def trials_of(workload: Workload, made: Contenders, cores: int
              ) -> tuple[dict[str, Trial], dict[str, str], dict[str, str]]:
    """The trials of every contender on ``workload``, each contender's kind, and the
    peers skipped on it with the reason."""
    trials: dict[str, Trial] = {}
    kinds: dict[str, str] = {}
    engines = dict(made.engines)
    if workload.calls_blas:
        engines.update(made.blas_engines)
    if workload.width is not None:  # a wide graph: its peak memory grows with parallelism
        engines.update(made.budget_engines)
    for name, engine in engines.items():
        trials[name], kinds[name] = workload.engine_trial(engine), "engine"
    if workload.tiny_nodes:  # a probe of the engine's cost, not a configuration to use
        for name, engine in made.handoff_engines.items():
            trials[name], kinds[name] = workload.engine_trial(engine), "probe"
    inline, threads, threads_blas_1 = ceiling_names(cores)
    for name, (count, blas_1) in {inline: (1, False), threads: (cores, False),
                                  threads_blas_1: (cores, True)}.items():
        ceiling = workload.ceiling_trial(count, blas_1)
        if ceiling is not None:
            trials[name], kinds[name] = ceiling, "ceiling"
    skipped = dict(made.skipped_peers)
    for name, module in made.peers.items():
        made_trial = peers.trial(name, module, workload, cores)
        if made_trial is None:
            continue
        if isinstance(made_trial, str):
            skipped[name] = made_trial
        else:
            trials[name], kinds[name] = made_trial, "peer"
    return trials, kinds, skipped


def check(trials: dict[str, Trial], tick: Callable[[], object]) -> float:
    """Run every trial once (a warm-up too) and compare its gradient with the
    reference's; returns the seconds it took. Raises AssertionError naming a contender
    that computes another gradient."""
    started = time.perf_counter()
    expected: np.ndarray | None = None
    for name, trial in trials.items():
        grad = time_trial(trial).grad
        tick()
        if expected is None:
            expected = grad
            continue
        tolerance = 1e-3 if expected.dtype == np.float32 else 1e-7
        scale = float(np.max(np.abs(expected))) or 1.0
        np.testing.assert_allclose(grad, expected, rtol=tolerance, atol=tolerance * scale,
                                   err_msg=f"{name} disagrees with {SEQUENTIAL}")
    return time.perf_counter() - started


class _Silent:
    """What stands in for a tqdm bar when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total = total

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent(total)
    return tqdm(total=total, desc=desc, leave=False, unit="run", dynamic_ncols=True)


def run_workload(workload: Workload, made: Contenders, s: Settings) -> dict[str, Any]:
    """Every figure of one workload."""
    started = time.perf_counter()
    trials, kinds, skipped = trials_of(workload, made, s.cores)
    measured = [name for name in trials if kinds[name] != "peer"]
    # The check's round sets how many repeats fit the budget, so it has a bar of its own
    # and the measuring bar's total is known before it starts.
    bar = progress(len(trials), f"{workload.name}: check")
    try:
        round_s = check(trials, bar.update)
    finally:
        bar.close()
    repeats = min(s.max_repeats, max(s.repeats, int(s.budget_s / round_s)))
    bar = progress(len(trials) * (s.warmup + repeats) + len(measured) * s.memory_repeats,
                   workload.name)
    try:
        samples = measure(trials, repeats, s.warmup, bar.update)
        pool = pool_footprint()
        memory: dict[str, tuple[int, int]] = {}
        for name in measured:
            memory[name] = peak_backward_bytes(trials[name], s.memory_repeats)
            bar.update(s.memory_repeats)
    finally:
        bar.close()
    figures: dict[str, Any] = {}
    for name, times in samples.items():
        totals = [f + b for f, b in zip(times["forward"], times["backward"])]
        figures[name] = {"kind": kinds[name], "fused": trials[name].fused,
                         "forward": summary(times["forward"]),
                         "backward": backward_summary(times), "total": summary(totals),
                         "peak_backward_bytes": memory[name][0] if name in memory else None,
                         "peak_bytes": memory[name][1] if name in memory else None}
    return {"name": workload.name, "description": workload.description,
            "nodes": workload.nodes(), "width": workload.width,
            "repeats": repeats, "contenders": figures, "skipped_peers": skipped, "pool": pool,
            "seconds": time.perf_counter() - started}


def run_widths(name: str, made: Contenders, s: Settings,
               measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """Backward medians of the reference, each threaded(w) and the two ceilings on
    ``cores`` threads, for ``name`` at each width of ``s.widths``. ``measured``: the
    figures of the workload itself from this run, reused at its own width."""
    _, threads, threads_blas_1 = ceiling_names(s.cores)
    wanted = [SEQUENTIAL, *[f"threaded({w})" for w in s.workers], threads, threads_blas_1]
    rows: dict[str, Any] = {}
    widths = [w for w in s.widths if measured is None or w != measured["width"]]
    bar = progress(len(widths) * len(wanted) * (1 + s.width_repeats), f"{name} by width")
    try:
        for width in s.widths:
            if width not in widths:
                assert measured is not None
                rows[str(width)] = {key: measured["contenders"][key]["backward"]
                                    for key in wanted}
                continue
            workload: Branchy = make_wide(name, s.mode, width)
            trials, _, _ = trials_of(workload, made, s.cores)
            chosen = {key: trials[key] for key in wanted}
            check(chosen, bar.update)
            samples = measure(chosen, s.width_repeats, 0, bar.update)
            rows[str(width)] = {key: backward_summary(times)
                                for key, times in samples.items()}
    finally:
        bar.close()
    return rows


def run_sweep(made: Contenders, s: Settings) -> dict[str, Any]:
    """Backward medians of the reference, each threaded(w) and the ceiling on ``cores``
    threads on wide-elementwise at each (branches, depth, elements) of
    ``ELEMENTWISE_SWEEP[s.mode]``, keyed ``"BxDxN"``."""
    _, threads, _ = ceiling_names(s.cores)
    wanted = [SEQUENTIAL, *[f"threaded({w})" for w in s.workers], threads]
    shapes = ELEMENTWISE_SWEEP[s.mode]
    rows: dict[str, Any] = {}
    bar = progress(len(shapes) * len(wanted) * (1 + s.width_repeats), "wide-elementwise sweep")
    try:
        for branches, depth, size in shapes:
            workload = WideElementwise(branches, depth, size)
            trials, _, _ = trials_of(workload, made, s.cores)
            chosen = {key: trials[key] for key in wanted}
            check(chosen, bar.update)
            samples = measure(chosen, s.width_repeats, 0, bar.update)
            rows[f"{branches}x{depth}x{size}"] = {key: backward_summary(times)
                                                  for key, times in samples.items()}
    finally:
        bar.close()
    return rows
