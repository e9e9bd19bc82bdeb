"""Benchmarks for shardopt (issue 6): step cost, communication, memory, scaling and convergence.

Run from the repository root as modules, e.g. ``python -m benchmarks.step_time --quick``; every script
writes ``benchmarks/results/<name>.json`` and ``<name>.md`` and ``python -m benchmarks.summarize`` turns
them into the README table. See ``benchmarks/README.md``.
"""
