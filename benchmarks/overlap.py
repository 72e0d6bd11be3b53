"""The overlap workload: a training step with an asynchronous backward
(examples/async_training.py) against the synchronous one.

Figures: the step time of the synchronous loop (prepare the batch, forward, backward,
SGD step) and of the asynchronous one (forward, ``backward_async``, the next batch
prepared while the workers run the backward, SGD in the post-accumulate-grad hooks);
their ratio, of medians in one run; and, from the trace of one asynchronous step, when
each parameter's gradient was ready. Before timing, the two loops are checked to end
bitwise equal on the deterministic engine (a wrong loop is an error, not a figure).

``python -m benchmarks.overlap FILE.png`` draws one traced step (docs/images/async-overlap.png).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import pargrad
from benchmarks.measure import summary
from examples.async_training import Task, async_loop, sgd_step, sync_loop

NAME = "overlap"
TASKS = {"full": Task(), "quick": Task(), "smoke": Task(batch=16, sizes=(12, 8, 8, 3),
                                                         augment=1)}
STEPS = {"full": 10, "quick": 5, "smoke": 2}  # per loop and repeat; the first is dropped


def check(task: Task) -> None:
    """Raise AssertionError unless both loops end bitwise equal (deterministic engine)."""
    with pargrad.ThreadedEngine(deterministic=True) as engine:
        ends = []
        for loop in (sync_loop, async_loop):
            params = task.parameters()
            losses = loop(task, params, 3, engine)
            ends.append((losses, [p.data for p in params]))
    (sync_losses, sync_params), (async_losses, async_params) = ends
    assert sync_losses == async_losses, "overlap: the async loop's losses differ"
    for s, a in zip(sync_params, async_params):
        np.testing.assert_array_equal(a, s, err_msg="overlap: the async loop's weights differ")


def traced_step(task: Task, engine: pargrad.ThreadedEngine) -> dict[str, Any]:
    """One asynchronous step under ``pargrad.profile()`` (after one untraced step): the
    trace, the caller's own spans, and each parameter's readiness (ms after the
    backward started)."""
    params = task.parameters()
    names = [f"{kind}{i // 2 + 1}" for i, kind in enumerate(["W", "b"] * (len(params) // 2))]
    async_loop(task, params, 1, engine)
    handles = [p.register_post_accumulate_grad_hook(sgd_step) for p in params]
    try:
        batch = task.prepare(0)
        with pargrad.profile() as trace:
            start = time.perf_counter()
            loss = task.loss(params, batch)
            accumulators = {p._grad_accumulator().sequence_nr: n for p, n in zip(params, names)}
            backward = time.perf_counter()
            future = pargrad.backward_async(loss, engine=engine)
            batch = task.prepare(1)
            prepared = time.perf_counter()
            future.result()
            end = time.perf_counter()
    finally:
        for handle in handles:
            handle.remove()
    ready = {accumulators[r.sequence_nr]: (r.time - backward) * 1e3
             for r in trace.leaves_ready() if r.sequence_nr in accumulators}
    spans = {"forward": (start, backward), "prepare next batch": (backward, prepared),
             "result()": (prepared, end)}
    return {"trace": trace, "spans": spans, "origin": start, "ready_ms": ready}


def run_overlap(mode: str, repeats: int) -> dict[str, Any]:
    """Every figure of the overlap workload at the sizes of ``mode``."""
    task, steps = TASKS[mode], STEPS[mode]
    check(task)
    times: dict[str, list[float]] = {"sync": [], "async": []}
    with pargrad.ThreadedEngine() as engine:
        for _ in range(max(1, repeats)):
            for name, loop in (("sync", sync_loop), ("async", async_loop)):
                steps_s: list[float] = []
                loop(task, task.parameters(), steps, engine, steps_s.append)
                times[name].extend(steps_s[1:] or steps_s)
        traced = traced_step(task, engine)
    sync_s, async_s = summary(times["sync"]), summary(times["async"])
    return {"name": NAME, "description": (
                f"MLP {'-'.join(map(str, task.sizes))}, batch {task.batch}, "
                f"{task.augment} augmentation passes: step of the sync loop vs the async "
                "loop (next batch during the backward, SGD in hooks)"),
            "steps": len(times["sync"]), "sync_step": sync_s, "async_step": async_s,
            "sync / async": sync_s["median_s"] / async_s["median_s"],
            "leaves_ready_ms": traced["ready_ms"],
            "spans_ms": {k: [(a - traced["origin"]) * 1e3, (b - traced["origin"]) * 1e3]
                         for k, (a, b) in traced["spans"].items()}}


def plot(path: str, mode: str = "full") -> None:
    """Draw one traced asynchronous step: the caller's spans, each engine thread's
    nodes, and when each parameter was ready."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = TASKS[mode]
    with pargrad.ThreadedEngine() as engine:
        traced = traced_step(task, engine)
    origin = traced["origin"]
    events = traced["trace"].events()
    threads = sorted({e.thread for e in events}, key=lambda t: (t.startswith("pargrad"), t))
    caller = "caller (MainThread)"
    rows = [caller, *[t for t in threads if t != "MainThread"]]
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.7 * len(rows)))
    colours = {"forward": "tab:blue", "prepare next batch": "tab:green",
               "result()": "lightgrey"}
    for label, (a, b) in traced["spans"].items():
        ax.broken_barh([((a - origin) * 1e3, (b - a) * 1e3)], (0.6, 0.8),
                       color=colours[label], label=label)
    for e in events:
        row = rows.index(caller if e.thread == "MainThread" else e.thread)
        ax.broken_barh([((e.start - origin) * 1e3, (e.end - e.start) * 1e3)],
                       (row + 0.6, 0.8), color="tab:orange", edgecolor="black",
                       linewidth=0.3)
    backward_ms = (traced["spans"]["prepare next batch"][0] - origin) * 1e3
    for name, at in traced["ready_ms"].items():
        ax.axvline(backward_ms + at, color="tab:red", linewidth=0.8, linestyle=":")
        ax.text(backward_ms + at, 0.05, name, rotation=90, fontsize=7,
                color="tab:red", ha="center", va="bottom")
    ax.broken_barh([(0, 0)], (0, 0), color="tab:orange", label="backward nodes")
    ax.plot([], [], color="tab:red", linestyle=":", label="parameter ready (SGD step)")
    ax.set_yticks([r + 1 for r in range(len(rows))], rows)
    ax.set_ylim(-0.3, len(rows) + 0.5)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started")
    ax.set_title("one training step with backward_async: the caller prepares the next "
                 "batch while the worker runs the backward", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot(sys.argv[1] if len(sys.argv) > 1 else "async-overlap.png")
