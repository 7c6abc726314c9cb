"""Shared helpers for the CPU test suite: tiny configurations and float32-exact matmuls."""

from __future__ import annotations

import dataclasses
import os

# Almost all of this suite's time is XLA compiling tiny programs; LLVM's optimisation passes are
# about half of that on CPU. Level 0 halves the suite's wall time and changes no float semantics
# (XLA CPU does not enable fast-math either way). It must be set before JAX starts its backend,
# hence here, before any test runs. Set DAGMOE_TEST_XLA_OPT=1 (or put your own
# --xla_backend_optimization_level in XLA_FLAGS) to test with the default optimisation.
if (os.environ.get("DAGMOE_TEST_XLA_OPT", "0") != "1"
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
# Eight simulated CPU devices for the sharding tests (tests/test_parallel.py): every other test
# runs on the first device as before (JAX's default device), unaffected by the other seven.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dagmoe_jax.config import ExecutionConfig, ModelConfig  # noqa: E402
from dagmoe_jax.runs.settle import settle  # noqa: E402

# Some backends run float32 matmuls at reduced precision by default (TF32 / bf16 passes on GPU and
# TPU); the oracle comparisons (1e-5 relative) need true float32 products wherever they run.
jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(block: str = "moe", kind: str = "sum", *, settled: bool = True,
                **overrides) -> ModelConfig:
    """A model small enough to compile in a few seconds and run in milliseconds on 2 CPU cores.

    d_model 32, 2 layers, 4 heads over 2 KV heads (GQA), vocab 64, 4 experts with top-2,
    DAG/MLP hidden 16 with 2 iterations. Attention 'auto' is the fused C++ kernel here (CPU,
    float32, single device) and blockwise under a mesh; ``attention_block`` 8 is smaller than
    the test sequence lengths (16-32), so the blockwise attention really runs block by block
    (test_kernels.py compares the two on the whole model). ExecutionConfig fields may be given
    at the top level (``attention='xla'``). Nested
    configs in ``overrides`` may be dicts of their fields (``router=dict(top_k=1)``).
    ``settled`` (default) settles the 'auto' fields for one device of this backend
    (:func:`dagmoe_jax.runs.settle.settle`), as a run does before building the model.
    """
    base = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_hidden=64, max_seq_len=64, execution=ExecutionConfig(attention_block=8))
    execution = {f.name for f in dataclasses.fields(ExecutionConfig)}
    overrides = {**{k: v for k, v in overrides.items() if k not in execution},
                 "execution": {**overrides.get("execution", {}),
                               **{k: v for k, v in overrides.items() if k in execution}}}
    changes = dict(block=block,
                   router=dict(top_k=2),
                   experts=dict(num_experts=4, expert_hidden=32, shared_hidden=32),
                   aggregation=dict(kind=kind, dag_dim=16, dag_iters=2))
    for name, value in overrides.items():
        if isinstance(value, dict) and isinstance(changes.get(name), dict):
            changes[name] = {**changes[name], **value}
        else:
            changes[name] = value
    cfg = base.replace(**changes)
    return settle(cfg) if settled else cfg


@pytest.fixture
def tiny():
    """The :func:`tiny_config` helper as a fixture (for tests that prefer not to import it)."""
    return tiny_config


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
