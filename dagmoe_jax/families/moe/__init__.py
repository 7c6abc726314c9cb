"""The MoE family, whole (docs/design.md sections 2-4): a router, routed and shared experts and
the aggregation of their outputs (eq. 1's sum, DAG-MoE's DAG module, or an MLP). Its config
and parameter budgets (``config``, ``budget``), its block (``block``, built from the routed
parts of :mod:`dagmoe_jax.model.routed`), its aggregators (``aggregation``) and DAG module
(``dag``: equations, execution strategies, the scanned module), its accounting, and the
conversion of a trained MoE into a DAG-MoE or a CoE (``conversion``)."""
