"""Shared helpers for the CPU test suite: tiny configurations and float32-exact matmuls."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dagmoe_jax.config import ModelConfig

# XLA on CPU may otherwise lower float32 matmuls to reduced-precision passes; the oracle
# comparisons below (1e-5 relative) need true float32 products.
jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(block: str = "moe", kind: str = "sum", **overrides) -> ModelConfig:
    """A model small enough to compile and run in about a second on 2 CPU cores.

    d_model 32, 2 layers, 4 heads over 2 KV heads (GQA), vocab 64, 4 experts with top-2,
    DAG/MLP hidden 16 with 2 iterations. ``attention_block`` 8 is smaller than the test sequence
    lengths (16-32), so the blockwise causal attention really runs block by block. Nested
    configs in ``overrides`` may be dicts of their fields (``router=dict(top_k=1)``).
    """
    base = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_hidden=64, max_seq_len=64, attention_block=8)
    changes = dict(block=block,
                   router=dict(top_k=2),
                   experts=dict(num_experts=4, expert_hidden=32, shared_hidden=32),
                   aggregation=dict(kind=kind, dag_dim=16, dag_iters=2))
    for name, value in overrides.items():
        if isinstance(value, dict) and isinstance(changes.get(name), dict):
            changes[name] = {**changes[name], **value}
        else:
            changes[name] = value
    return base.replace(**changes)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
