"""Upcycling dense models into MoEs (DUME, docs/design.md section 7); the Hugging Face checkpoints
it reads come in through :mod:`dagmoe_jax.hf`.

* :mod:`~dagmoe_jax.upcycle.moerge`: N dense models -> one MoE (DUME sec. 2.2, eq. 4);
* :mod:`~dagmoe_jax.upcycle.ridge`: the closed-form ridge routers (DUME eqs. 2-7);
* :mod:`~dagmoe_jax.upcycle.dume`: the statistics pass, DUME, its baselines and DUME+;
* :mod:`~dagmoe_jax.upcycle.command` and ``python -m dagmoe_jax.upcycle``: dense checkpoints to a
  DUME run directory.
"""
