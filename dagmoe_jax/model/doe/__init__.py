"""Decoupling of Experts (DoE; docs/design.md section 6): the block's modules.

* :mod:`~dagmoe_jax.model.doe.block`: the DoE block (the topic VAE, the decoupled experts and
  their gates);
* :mod:`~dagmoe_jax.model.doe.knowledge_blocks`: the 'blocks' reading of the experts;
* :mod:`~dagmoe_jax.model.doe.objective`: the composite loss of DoE eq. 4.

Its configuration is :mod:`dagmoe_jax.config.doe`; Stage 1's topic model, and the hooks that carry
topic ids through the data and generation, are :mod:`dagmoe_jax.data.topics`; its analysis is
:mod:`dagmoe_jax.analysis.doe`.
"""
