"""Decoding: KV-cache generation (:mod:`~dagmoe_jax.decoding.generate`) and its command line
(:mod:`~dagmoe_jax.cli.sample`: ``python -m dagmoe_jax.cli.sample``, the console
script ``dagmoe-sample``)."""
