"""The MoE family (docs/design.md sections 2-4): a router, routed and shared experts and the
aggregation of their outputs (eq. 1's sum, DAG-MoE's DAG module, or an MLP): its config, block,
accounting, and the conversion of a trained MoE into a DAG-MoE or a CoE."""
