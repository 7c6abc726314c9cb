"""Looking inside a trained run: expert load, CoE co-activation, DAG edge gates, dropped tokens.

:func:`~dagmoe_jax.analysis.collection.collect` runs the model with its intermediates recorded
(routing decisions per layer and CoE iteration, the DAG module's edge gates) and reduces them;
:mod:`~dagmoe_jax.analysis.plots` draws PNGs (matplotlib, Agg backend);
:func:`~dagmoe_jax.analysis.report.analyze_run` does both for a run. Command line
(:mod:`dagmoe_jax.cli.analyze`)::

    dagmoe-analyze --run_dir=runs/default --out=runs/default/plots [--data=SPEC]
"""

import importlib

# Loaded when first asked for (PEP 562): importing this package loads no JAX (a command
# imports it before its libraries, under the stop contract of dagmoe_jax/stopping.py).
_WHERE = {"Collected": "collection", "collect": "collection", "record": "collection",
          "PLOTS": "report", "PlotResult": "report", "analyze_run": "report",
          "write_plots": "report"}

__all__ = ["PLOTS", "PlotResult", "analyze_run", "write_plots", "Collected", "collect", "record"]


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"dagmoe_jax.analysis.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dagmoe_jax.analysis' has no attribute {name!r}")
