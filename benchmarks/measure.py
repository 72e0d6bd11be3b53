"""Timing and memory of trials, and the facts of the machine they ran on.

Times are ``time.perf_counter`` around each part of a trial (forward, then backward), a
garbage collection before each forward; around the backward also the process's minor
page faults (``getrusage``, every thread: memory the allocator had given back to the
system and touches again, which moves large-array figures; "Page faults" in
docs/performance.md); the contenders of a workload take turns within
each repeat, so that a noisy stretch of time hits them all alike, and the first
``warmup`` repeats are dropped. Memory is a separate, untimed pass (tracemalloc slows
Python down): the peak of traced memory during the backward above what was traced when
it started; tracemalloc sees numpy's arrays, on every thread, and pargrad's pool of large
arrays keeps no free block during that pass, so that it sees theirs come and go too.
"""

from __future__ import annotations

import gc
import importlib
import os
import platform
import statistics
import sys
import sysconfig
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Any, NamedTuple

try:
    import resource
except ImportError:  # Windows: no getrusage, no fault counts
    resource = None  # type: ignore[assignment]

import numpy as np

from benchmarks.workloads import Trial


class Run(NamedTuple):
    """One run of a trial."""

    forward_s: float
    backward_s: float
    backward_faults: int | None
    """Minor page faults of the whole process during the backward; None where the
    platform does not count them."""
    grad: np.ndarray
    """The gradient the trial checks."""


def minor_faults() -> int | None:
    """The process's minor page faults so far (every thread), or None without
    ``getrusage``."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# Without the GIL, CPython's collector is not generational: every automatic collection
# walks the whole heap, and one landing in a timed backward moved it by 50% (two runs of
# one engine differed by 1.4x). So there the collector is off while a trial is timed, as
# it is collected right before.
GC_OFF_WHILE_TIMED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@contextmanager
def collected() -> Iterator[None]:
    """A garbage collection, then the block; without the GIL, with the collector off
    until the block is left (``GC_OFF_WHILE_TIMED``)."""
    gc.collect()
    if not GC_OFF_WHILE_TIMED:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_trial(trial: Trial) -> Run:
    """Time one forward and backward of ``trial``."""
    if trial.prepare is not None:
        trial.prepare()
    with collected():
        start = time.perf_counter()
        state = trial.forward()
        faults = minor_faults()
        middle = time.perf_counter()
        grad = trial.backward(state)
        end = time.perf_counter()
        after = minor_faults()
    return Run(middle - start, end - middle,
               None if faults is None or after is None else after - faults, grad)


def measure(trials: dict[str, Trial], repeats: int, warmup: int,
            tick: Callable[[], object] = lambda: None) -> dict[str, dict[str, list[Any]]]:
    """Forward and backward seconds, and the backward's minor page faults, of each trial
    per kept repeat (keys ``forward``, ``backward``, ``faults``), trials in turn within
    each repeat, each repeat starting one trial further along (so that no trial always
    follows the same one); ``tick`` is called after each run (a progress bar)."""
    samples: dict[str, dict[str, list[Any]]] = {
        name: {"forward": [], "backward": [], "faults": []} for name in trials}
    names = list(trials)
    for repeat in range(warmup + repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            run = time_trial(trials[name])
            if repeat >= warmup:
                samples[name]["forward"].append(run.forward_s)
                samples[name]["backward"].append(run.backward_s)
                samples[name]["faults"].append(run.backward_faults)
            tick()
    return samples


def backward_summary(times: dict[str, list[Any]]) -> dict[str, Any]:
    """``summary`` of the backward seconds of one contender's ``measure`` samples, with
    ``minor_faults``, the median of its backward's page faults, and ``faults_samples``,
    each run's in the order of ``samples_s`` (None and [] if not counted)."""
    faults = times["faults"]
    counted = bool(faults) and None not in faults
    order = sorted(range(len(faults)), key=times["backward"].__getitem__)
    return {**summary(times["backward"]),
            "minor_faults": statistics.median(faults) if counted else None,
            "faults_samples": [faults[i] for i in order] if counted else []}


def peak_backward_bytes(trial: Trial, repeats: int) -> tuple[int, int]:
    """Over ``repeats`` untimed runs, the largest peak of memory allocated during the
    backward above what was allocated when it started, and the largest peak itself
    (what the forward's graph held plus that): the first compares engines on one tree,
    the second two trees, whose graphs may hold different amounts after the forward."""
    peaks, absolute = [], []
    with _pool_keeps_nothing():
        for _ in range(repeats):
            gc.collect()
            tracemalloc.start()
            try:
                state = trial.forward()
                gc.collect()
                _settle_pool()
                base, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                grad = trial.backward(state)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            del state, grad
            peaks.append(peak - base)
            absolute.append(peak)
    return max(peaks), max(absolute)


def _pargrad_memory() -> Any:
    """pargrad's pool module (pargrad/memory.py), or None in a tree without it
    (``--compare`` measures older commits too)."""
    return getattr(importlib.import_module("pargrad"), "memory", None)


@contextmanager
def _pool_keeps_nothing() -> Iterator[None]:
    """pargrad's pool of large arrays (pargrad/memory.py) keeping no free block: each
    block goes back to numpy when its array dies and a new one is allocated for every
    array, so tracemalloc sees the memory of the arrays alive, as it does without the
    pool (a block kept from before tracing started would be reused unseen). A tree
    without the pool (``--compare`` on an older commit) is measured as it is."""
    memory = _pargrad_memory()
    if memory is None:
        yield
        return
    limit = memory.set_cache_limit(0)
    try:
        yield
    finally:
        memory.set_cache_limit(limit)


def _settle_pool() -> None:
    """Have pargrad's pool give back now the blocks whose arrays died (it does so at its
    next call): else a temporary of the forward would count in the backward's base."""
    memory = _pargrad_memory()
    if memory is not None:
        memory.memory_stats()


def pool_footprint() -> dict[str, int] | None:
    """What pargrad's pool holds now: ``{"leased_bytes", "cached_bytes"}`` (None for a
    tree without the pool)."""
    memory = _pargrad_memory()
    if memory is None:
        return None
    stats = memory.memory_stats()
    return {"leased_bytes": stats["leased_bytes"], "cached_bytes": stats["cached_bytes"]}


def summary(values: Iterable[float]) -> dict[str, Any]:
    """Median and spread of some seconds: min, max, quartiles, and the samples."""
    data = sorted(values)
    quartiles = statistics.quantiles(data, n=4) if len(data) > 1 else [data[0]] * 3
    return {"median_s": statistics.median(data), "min_s": data[0], "max_s": data[-1],
            "q1_s": quartiles[0], "q3_s": quartiles[2], "samples_s": data}


def cpu_model() -> str | None:
    """The processor's name as the system reports it (Linux: /proc/cpuinfo), or None."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def simd() -> dict[str, list[str]] | None:
    """numpy's SIMD extensions as ``numpy.show_runtime()`` reports them: the baseline it
    was built for, and the dispatched ones this CPU has (found) or lacks (not found)."""
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:  # what show_runtime reads (numpy 2, then numpy 1), without printing
            umath = importlib.import_module(name)
        except ImportError:
            continue
        features, dispatch = umath.__cpu_features__, umath.__cpu_dispatch__
        return {"baseline": list(umath.__cpu_baseline__),
                "found": [f for f in dispatch if features[f]],
                "not_found": [f for f in dispatch if not features[f]]}
    return None


def _fused_load_seconds(fused: Any) -> float | None:
    """Seconds the first fused kernel took to be ready in this process (numba's import,
    then compiling the kernels or loading them from its on-disk cache); None where the
    kernels are off or were ready already."""
    if not fused.enabled() or getattr(fused, "_kernels", None):
        return None
    start = time.perf_counter()
    fused.kernel("tanh_backward")
    return round(time.perf_counter() - start, 3)


def machine_facts() -> dict[str, Any]:
    """The CPU, cores, SIMD, Python, numpy and its BLAS, the fused kernels, and every
    thread and allocator setting that moves the figures."""
    from threadpoolctl import threadpool_info

    from pargrad.engine.threaded import default_workers
    from pargrad.ops import fused
    facts: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "simd": simd(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        # (not pargrad.devices.gil_enabled: --compare runs this on older commits too)
        "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)(),
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "blas": [{key: pool.get(key) for key in
                  ("internal_api", "version", "architecture", "threading_layer",
                   "num_threads")} for pool in threadpool_info()],
        "pargrad_default_workers": default_workers(),
        "fused_kernels": fused.enabled(),
        "fused_kernels_load_s": _fused_load_seconds(fused),
        "numba": _version("numba"),
    }
    libc = platform.libc_ver()
    facts["libc"] = " ".join(libc) if libc[0] else None
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                 "OPENBLAS_THREAD_TIMEOUT", "PARGRAD_ENGINE", "PARGRAD_FUSED", "PARGRAD_CACHING",
                 "PARGRAD_CACHE_LIMIT", "MALLOC_TOP_PAD_",
                 "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX",
                 "LD_PRELOAD"):
        facts[name] = os.environ.get(name)
    return facts


def _version(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
