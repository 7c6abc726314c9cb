"""Looking inside a trained run: expert load, CoE co-activation, DAG edge gates, dropped tokens.

:func:`~dagmoe_jax.analysis.trace.collect` recomputes the model layer by layer to read what the
scanned forward pass hides (routing decisions per layer and CoE iteration, the DAG module's edge
gates); :mod:`~dagmoe_jax.analysis.plots` draws PNGs (matplotlib, Agg backend);
:func:`~dagmoe_jax.analysis.report.analyze_run` does both for a run directory. Command line::

    python -m dagmoe_jax.analysis --run_dir=runs/default --out=runs/default/plots [--data=SPEC]
"""

from dagmoe_jax.analysis.report import PLOTS, PlotResult, analyze_run, write_plots
from dagmoe_jax.analysis.trace import Collected, collect, edge_gates, layer_module, trace_tokens

__all__ = ["PLOTS", "PlotResult", "analyze_run", "write_plots", "Collected", "collect",
           "edge_gates", "layer_module", "trace_tokens"]
