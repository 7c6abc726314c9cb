"""The block families, one package each (docs/design.md section 11): ``dense``, ``moe`` (with
its aggregation: DAG-MoE), ``coe`` (Chain-of-Experts) and ``doe`` (Decoupling of Experts).

A family's package holds everything that is the family's own, each module in the layer its
name says (``tests/test_imports.py``): ``config`` (its config, registered in
:mod:`dagmoe_jax.config.families`), ``block`` and ``accounting`` (the model) and the block's
own modules (the MoE family's aggregators and DAG module), and, where the family needs them,
``extension`` (its hooks into the run), ``analysis`` and ``command``. What several families
build from is the core's (:mod:`dagmoe_jax.model.routed`). The layers find a family through
the registry, never by importing it: the families stand above the core.

This package and each family's ``__init__`` import nothing: importing a family's config must
not load its model.
"""
