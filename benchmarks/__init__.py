"""pargrad's benchmark suite: run ``python -m benchmarks [--quick]`` from the repository root.

Modules: ``workloads`` (the graphs and their plain-threads ceilings), ``peers`` (the same
graphs in PyTorch and HIPS autograd), ``measure`` (timing, memory, machine facts),
``suite`` (contenders, order, repeats), ``report`` (ratios, targets, table, JSON),
``plots`` (PNG), ``__main__`` (the command line). docs/performance.md has the results.
"""
