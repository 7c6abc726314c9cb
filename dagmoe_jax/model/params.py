"""A model's parameters by attribute path, read and written as NumPy arrays: how checkpoints of
other tools (Hugging Face imports, DUME's merges) reach an NNX model."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx


def flat_params(model: nnx.Module) -> dict:
    """{path tuple: float32 NumPy array} of every parameter of ``model``."""
    return {tuple(path): np.asarray(v[...], np.float32)
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def variable(model: nnx.Module, path: Sequence[str]):
    """The parameter of ``model`` at attribute ``path`` (e.g. ``('layers', 'attn', 'w_q')``; an
    integer indexes a list of modules, as in ``('layers', 'block', 'routers', 0, 'w_router')``)."""
    node = model
    for part in path:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node


def set_params(model: nnx.Module, params, source: str = "the merge") -> None:
    """Write {path: array} (or (path, array) pairs, read one at a time) into ``model``'s
    parameters (concrete, or abstract from ``nnx.eval_shape``), cast to their dtypes; a shape
    mismatch is a one-line error naming the parameter and what gave the array (``source``)."""
    for path, value in (params.items() if isinstance(params, dict) else params):
        node = variable(model, path)
        if tuple(node.shape) != tuple(np.shape(value)):
            raise ValueError(f"parameter {'.'.join(path)} has shape {tuple(node.shape)}, "
                             f"{source} gives {tuple(np.shape(value))}")
        # ``value`` rather than ``[...]``: the model may be abstract (nnx.eval_shape), its
        # parameters shapes only until set here.
        node.set_value(jnp.asarray(np.asarray(value, dtype=node.dtype)))
