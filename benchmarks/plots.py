"""PNG plots of a suite run (matplotlib, imported only here): backward speed-up over
the reference against workers, per workload, and against graph width."""

from __future__ import annotations

from typing import Any

from benchmarks.report import ceiling_speedup, median
from benchmarks.suite import SEQUENTIAL, ceiling_names


def plot(path: str, figures: dict[str, Any]) -> None:
    """Write the plots of ``figures`` (the suite's JSON) to ``path`` as one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = figures["settings"]["workers"]
    cores = figures["machine"]["cores"]
    widths = figures["widths"]
    fig, axes = plt.subplots(1, 1 + len(widths), figsize=(6 + 4.5 * len(widths), 4.5),
                             squeeze=False)
    by_workers = axes[0][0]
    for i, w in enumerate(figures["workloads"]):
        speedups = [median(w, SEQUENTIAL) / median(w, f"threaded({n})") for n in workers]
        line, = by_workers.plot(workers, speedups, marker="o", label=w["name"])
        ceiling = ceiling_speedup(w, cores)
        if ceiling is not None:
            by_workers.scatter([workers[-1] + 0.3 + 0.1 * i], [ceiling], marker="_", s=300,
                               color=line.get_color())
    by_workers.axhline(1.0, color="grey", linewidth=0.8)
    by_workers.set(title=f"speed-up against workers ({cores} cores)", xlabel="workers",
                   ylabel="backward speed-up over SequentialEngine", xticks=workers)
    by_workers.legend(fontsize=7, title="dashes: plain-threads ceiling", title_fontsize=7)

    _, threads, threads_blas_1 = ceiling_names(cores)
    for ax, (name, rows) in zip(axes[0][1:], widths.items()):
        xs = [int(width) for width in rows]
        for contender in [*(f"threaded({n})" for n in workers), threads, threads_blas_1]:
            ys = [row[SEQUENTIAL]["median_s"] / row[contender]["median_s"]
                  for row in rows.values()]
            style = "--" if contender.startswith("ceiling") else "-"
            ax.plot(xs, ys, style, marker="o", label=contender)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"{name}: speed-up against graph width", xlabel="independent branches",
               ylabel="backward speed-up over SequentialEngine", xscale="log", xticks=xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.legend(fontsize=7)
    fig.suptitle(f"pargrad backward, {figures['settings']['mode']} run "
                 f"({figures['machine']['python']}, numpy {figures['machine']['numpy']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
