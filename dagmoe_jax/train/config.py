"""Validated configuration of a training run (the loop itself; the model, data and optimiser
have their own dataclasses: ``ModelConfig``, ``DataConfig``, ``OptimConfig``).

All four are exposed to gin under their class names, so a run is described by gin files plus
``--gin.TrainConfig.steps=2000``-style bindings (see ``train.py``).
"""

from __future__ import annotations

import dataclasses

from dagmoe_jax.validate import check as _check
from dagmoe_jax.validate import choice as _choice
from dagmoe_jax.validate import positive as _positive
from dagmoe_jax.parallel.mesh import MeshConfig


def _nonneg_int(field: str, value) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, "TrainConfig",
           field, value, "an integer >= 0")


TRAINABLE_SETS = ("all", "router")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How long to train, and how often to log, evaluate and checkpoint.

    steps: optimiser steps in the whole run (the schedule's length; a resumed run continues
        up to it).
    grad_accum: micro-batches per optimiser step; ``DataConfig.batch_size`` is split into this
        many equal parts whose gradients are averaged (a ``lax.scan`` inside the jitted step).
    seed: seed of the parameter initialisation (the data order has ``DataConfig.seed``).
    run_dir: where the operative config, ``metrics.jsonl``, TensorBoard events and checkpoints
        go; a run started again in the same directory resumes from its newest checkpoint.
    log_every: steps between metric records (JSONL + TensorBoard) and progress-bar updates.
    eval_every: steps between held-out evaluations (0 = only at the end).
    eval_batches: held-out batches per evaluation (0 = the whole held-out split).
    task_eval_examples: problems scored exactly (greedy answer == reference) per evaluation
        when the data source is a synthetic task; 0 turns that off.
    save_every: steps between checkpoints (the last step and an interrupt always save).
    keep_checkpoints: newest checkpoints kept on disk.
    async_checkpoint: write checkpoints in a background thread while training goes on.
    tensorboard: write TensorBoard event files beside ``metrics.jsonl``.
    wandb_project: also log to Weights & Biases in this project ('' = off, the default; needs
        ``pip install 'dagmoe-jax[wandb]'``). See ``dagmoe_jax/train/metrics.py``.
    wandb_mode: 'online' (default) or 'offline' (no network; ``wandb sync`` uploads later).
    mesh: the device mesh (``MeshConfig``: data / fsdp / expert / tensor sizes; default all
        devices data-parallel). Bind it in gin as ``MeshConfig.expert = 4``.
    allow_model_change: resume a run whose checkpoint was written with a different ModelConfig
        (array shapes must still match; fields such as ``top_k`` or ``score_fn`` keep them).
        Off by default: such a resume is a one-line error naming the fields, since it silently
        trains another model. How the model runs (remat, attention, ...) may always change.
    trainable: which parameters the optimiser updates: 'all' (default) or 'router' (only the
        routers' weights and biases, everything else frozen: DUME+ and BTX, DUME sec. 3.1;
        :data:`dagmoe_jax.train.step.TRAINABLE`). The optimiser holds state for those only.
    """

    steps: int = 1000
    grad_accum: int = 1
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int = 16
    task_eval_examples: int = 256
    save_every: int = 500
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    tensorboard: bool = True
    wandb_project: str = ""
    wandb_mode: str = "online"
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    allow_model_change: bool = False
    trainable: str = "all"

    def __post_init__(self):
        for name in ("steps", "grad_accum", "log_every", "save_every", "keep_checkpoints"):
            _positive("TrainConfig", name, getattr(self, name))
        for name in ("seed", "eval_every", "eval_batches", "task_eval_examples"):
            _nonneg_int(name, getattr(self, name))
        _check(isinstance(self.mesh, MeshConfig), "TrainConfig", "mesh", self.mesh,
               "a MeshConfig")
        _check(isinstance(self.allow_model_change, bool), "TrainConfig", "allow_model_change",
               self.allow_model_change, "True or False")
        _check(isinstance(self.wandb_project, str), "TrainConfig", "wandb_project",
               self.wandb_project, "a W&B project name ('' = no W&B logging)")
        _check(self.wandb_mode in ("online", "offline"), "TrainConfig", "wandb_mode",
               self.wandb_mode, "'online' or 'offline'")
        _choice("TrainConfig", "trainable", self.trainable, TRAINABLE_SETS)
        _check(isinstance(self.run_dir, str) and self.run_dir.strip() != "", "TrainConfig",
               "run_dir", self.run_dir, "a non-empty directory path")
