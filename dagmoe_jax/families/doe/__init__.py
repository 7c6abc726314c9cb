"""Decoupling of Experts (DoE; docs/design.md section 6), the whole family in one package.

* :mod:`~dagmoe_jax.families.doe.config`: ``DoEConfig`` and Stage 1's ``TopicConfig``;
* :mod:`~dagmoe_jax.families.doe.block`: the DoE block (the topic VAE, the decoupled experts
  and their gates); :mod:`~dagmoe_jax.families.doe.knowledge_blocks`: the 'blocks' reading of
  the experts; :mod:`~dagmoe_jax.families.doe.objective`: the composite loss of DoE eq. 4;
  :mod:`~dagmoe_jax.families.doe.accounting`: its parameters and FLOPs;
* :mod:`~dagmoe_jax.families.doe.topics`: Stage 1's topic model (LDA) and the topic ids;
* :mod:`~dagmoe_jax.families.doe.extension`: its hooks into the run (the topic ids in every
  batch, DoE's loss, the topics tracked while generating);
* :mod:`~dagmoe_jax.families.doe.analysis`: the mean gate per topic and layer;
* :mod:`~dagmoe_jax.families.doe.command`: ``dagmoe-topics``, Stage 1 on its own.
"""
