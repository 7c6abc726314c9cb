"""Looking inside a trained run: expert load, CoE co-activation, DAG edge gates, dropped tokens.

:func:`~dagmoe_jax.analysis.collect.collect` runs the model with its intermediates recorded
(routing decisions per layer and CoE iteration, the DAG module's edge gates) and reduces them;
:mod:`~dagmoe_jax.analysis.plots` draws PNGs (matplotlib, Agg backend);
:func:`~dagmoe_jax.analysis.report.analyze_run` does both for a run directory. Command line::

    python -m dagmoe_jax.analysis --run_dir=runs/default --out=runs/default/plots [--data=SPEC]
"""

from dagmoe_jax.analysis.collect import Collected, collect, record
from dagmoe_jax.analysis.report import PLOTS, PlotResult, analyze_run, write_plots

__all__ = ["PLOTS", "PlotResult", "analyze_run", "write_plots", "Collected", "collect", "record"]
