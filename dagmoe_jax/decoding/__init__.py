"""Decoding: KV-cache generation (:mod:`~dagmoe_jax.decoding.generate`) and its command line
(:mod:`~dagmoe_jax.decoding.sample`: ``python -m dagmoe_jax.decoding.sample``, the console
script ``dagmoe-sample``)."""
