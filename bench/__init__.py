"""swap-state benchmarks: the numbers that justify the design, measured side by side in one run.

Run from the repository root::

    bash scripts/bench.sh                       # sets up .venv, then python -m bench
    .venv/bin/python -m bench --params 64M --out results/

See ``python -m bench --help`` and :mod:`bench.cli` for what is measured. Everything printed
or written is a measurement of this run; goals are reported against, never asserted.
"""
