"""The block families, one package each (docs/design.md section 11): ``dense``, ``moe`` (with
its aggregation: DAG-MoE), ``coe`` (Chain-of-Experts) and ``doe`` (Decoupling of Experts).

A family's package holds everything that is the family's own, each module in the layer its
name says (``tests/test_imports.py``): ``config`` (its config, registered in
:mod:`dagmoe_jax.config.families`), ``block`` and ``accounting`` (the model), and, where the
family needs them, ``extension`` (its hooks into the run), ``analysis`` and ``command``. The
layers find a family's modules through the registry, never by its name.

This package and each family's ``__init__`` import nothing: importing a family's config must
not load its model.
"""
