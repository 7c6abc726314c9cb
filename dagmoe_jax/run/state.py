"""Building a run: the model settled for this machine, its sharded train state, its batches.

Training, evaluation, sampling, analysis, upcycling and the benchmarks all build models here:

* :func:`build`: (model, optimizer, schedule) from the run's configs, parameters initialised
  from ``RunConfig.seed``, created directly sharded over a mesh when one is given, or only
  their shapes and shardings (``abstract``: what the ahead-of-time compile lowers);
* :func:`device_batch` / :func:`replicated_batch`: a host batch's model inputs on the devices
  (this process's rows of a training batch; a whole evaluation batch on every device);
* :func:`check_compatible`: one-line errors for data the model cannot take.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.config import ModelConfig
from dagmoe_jax.data import DataConfig
from dagmoe_jax.data.batch import MODEL_INPUTS
from dagmoe_jax.model import Transformer
from dagmoe_jax.parallel import create_train_state, shard_batch
from dagmoe_jax.parallel.axes import MeshLayout
from dagmoe_jax.model.settle import check_kernel_precision, settle
from dagmoe_jax.run.config import OptimConfig, RunConfig
from dagmoe_jax.run.optim import TRAINABLE, check_trainable, make_optimizer, make_schedule


def check_compatible(model_cfg: ModelConfig, data_cfg: DataConfig, tokenizer) -> None:
    """One-line errors for a data setup the model cannot take."""
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"DataConfig.seq_len={data_cfg.seq_len} exceeds ModelConfig.max_seq_len="
                         f"{model_cfg.max_seq_len}: shorten the sequences or raise max_seq_len")
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the {data_cfg.tokenizer!r} tokenizer has {tokenizer.vocab_size} tokens "
                         f"but ModelConfig.vocab_size={model_cfg.vocab_size}: set vocab_size >= "
                         f"{tokenizer.vocab_size}")


def build(model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: RunConfig, mesh=None,
          log: Callable[[str], None] = lambda _message: None, *,
          backend: Optional[str] = None, abstract: bool = False):
    """(model, optimizer, schedule) for a run: parameters initialised from ``run_cfg.seed``,
    created directly sharded over ``mesh`` when one is given (optimizer state too).

    The model runs as ``run_cfg.execution`` settled for ``model_cfg`` on ``backend`` (default:
    this machine's) and the mesh (:func:`dagmoe_jax.model.settle.settle`; ``model.execution``
    is the settled config). ``abstract``: no arrays, only their shapes, dtypes and shardings
    over ``mesh`` (:func:`dagmoe_jax.parallel.state.create_abstract`), settled for the
    ``backend`` and the devices of the mesh (a compile-only topology's: what
    :mod:`dagmoe_jax.compile` lowers for another machine)."""
    if abstract and mesh is None:
        raise ValueError("an abstract train state is built over a mesh (a topology's devices)")
    tx = make_optimizer(optim_cfg, run_cfg.steps)
    check_trainable(model_cfg, run_cfg.trainable)
    wrt = TRAINABLE[run_cfg.trainable]
    layout = MeshLayout.of(mesh)
    execution = settle(model_cfg, run_cfg.execution, backend=backend, layout=layout,
                       device=mesh.devices.flat[0] if abstract else None, log=log)
    check_kernel_precision(execution.attention, execution.grouped_matmul,
                           backend or jax.default_backend())

    def new_model():
        return Transformer(model_cfg, execution=execution, rngs=nnx.Rngs(run_cfg.seed),
                           layout=layout)
    if mesh is None:
        model = new_model()
        optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    else:
        model, optimizer = create_train_state(new_model, tx, mesh, wrt=wrt, abstract=abstract)
    return model, optimizer, make_schedule(optim_cfg, run_cfg.steps)


def train_state(model, optimizer) -> dict:
    """The state a checkpoint holds: ``{'model': ..., 'optimizer': ...}``."""
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def abstract(tree):
    """Shapes, dtypes and shardings of a pytree of arrays (what ``restore`` reads into)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def device_batch(batch: Dict[str, np.ndarray], mesh=None,
                 extra_keys: Sequence[str] = ()) -> Dict[str, jax.Array]:
    """The model's inputs of a host batch (:data:`MODEL_INPUTS` and ``extra_keys``, a
    family's annotations) on the device(s): this process's rows of the global batch sharded
    over ``mesh``'s batch axes, or (no mesh) on the default device."""
    keys = MODEL_INPUTS + tuple(extra_keys)
    batch = {k: v for k, v in batch.items() if k in keys}
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    return shard_batch(batch, mesh)


def replicated_batch(batch: Dict[str, np.ndarray],
                     extra_keys: Sequence[str] = ()) -> Dict[str, jax.Array]:
    """An evaluation batch (the same whole batch on every process) replicated on every device
    of the active mesh, so its outputs are readable on every host and any row count works."""
    keys = MODEL_INPUTS + tuple(extra_keys)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or jax.process_count() == 1:
        return {k: jnp.asarray(v) for k, v in batch.items() if k in keys}
    sharding = jax.sharding.NamedSharding(jax.sharding.get_mesh(), jax.sharding.PartitionSpec())
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v), np.shape(v))
            for k, v in batch.items() if k in keys}
