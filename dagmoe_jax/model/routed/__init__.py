"""The routed-expert parts every routed family is built from (MoE, Chain-of-Experts, DoE's
knowledge experts): :mod:`~dagmoe_jax.model.routed.router` (scores, top-k, balancing),
:mod:`~dagmoe_jax.model.routed.dispatch` (tokens to their experts and back on one device),
:mod:`~dagmoe_jax.model.routed.expert_parallel` (the same across a mesh's expert axis) and
:mod:`~dagmoe_jax.model.routed.experts` (the routed and shared experts' FFNs that run them)."""
