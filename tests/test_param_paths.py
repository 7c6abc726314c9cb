"""The model's parameter paths and shapes do not move when its code is restructured: a
checkpoint names every array by its path in ``nnx.state``, so a moved or renamed parameter
would make every earlier checkpoint unreadable.

``tests/fixtures/param_paths_520a405.json`` was recorded from commit 520a405 (before the
block protocol and the sub-config constructors) for the tiny config of every block family,
with ``jax.tree_util.keystr(path, simple=True, separator='/')`` and each leaf's shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from flax import nnx

from conftest import make_model, tiny_config

RECORDED = json.loads((Path(__file__).resolve().parent / "fixtures"
                       / "param_paths_520a405.json").read_text())
CASES = {"dense": ("dense", "sum", {}),
         "moe-sum-shared": ("moe", "sum", {"experts": {"num_shared": 1}}),
         "moe-dag": ("moe", "dag", {}), "moe-mlp": ("moe", "mlp", {}),
         "coe": ("coe", "sum", {"coe": {"shared_router": False}}),
         "moe-bias": ("moe", "sum", {"router": {"bias": True}}),
         "doe": ("doe", "sum", {"doe": {"num_topics": 4, "topic_dim": 8, "vae_hidden": 16,
                                        "latent_dim": 8}})}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parameter_paths_are_those_earlier_checkpoints_hold(name):
    block, kind, overrides = CASES[name]
    model = nnx.eval_shape(lambda: make_model(tiny_config(block, kind, **overrides)))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    paths = sorted(f"{jax.tree_util.keystr(p, simple=True, separator='/')} {tuple(leaf.shape)}"
                   for p, leaf in leaves)
    assert paths == RECORDED[name]
