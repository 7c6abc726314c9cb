"""The dense family: one SwiGLU, Llama's FFN (docs/design.md section 1): its config, block and
accounting."""
