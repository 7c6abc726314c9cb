"""Validated configuration of a run: the run's own config (``RunConfig``: its directory, the
training loop's length and cadence, and the mesh and execution that training, evaluation,
sampling and compiling all read) and the optimiser's (``OptimConfig``;
:mod:`dagmoe_jax.run.optim` builds it). The model's and the data's have
their own modules (``dagmoe_jax/config/model.py``, ``dagmoe_jax/data/config.py``): every config
dataclass lives in a module named ``config.py`` beside the code it configures.

All are exposed to gin under their class names, so a run is described by gin files plus
``--gin.RunConfig.steps=2000``-style bindings (see ``train.py``). ``RunConfig`` was called
``TrainConfig`` before; gin files and bindings of that name (the gin files saved by earlier
runs) still configure it (:mod:`dagmoe_jax.run.gin`), and the Python name stays an alias.
"""

from __future__ import annotations

import dataclasses
import math

from dagmoe_jax.validate import check as _check
from dagmoe_jax.validate import choice as _choice
from dagmoe_jax.validate import in_range as _in_range
from dagmoe_jax.validate import nonnegative_int as _nonnegative_int
from dagmoe_jax.validate import positive as _positive
from dagmoe_jax.config.execution import ExecutionConfig
from dagmoe_jax.parallel.config import MeshConfig

SCHEDULES = ("wsd", "cosine", "constant")


TRAINABLE_SETS = ("all", "router", "router_and_gates", "non_experts", "aggregator", "shared")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The run's config: where it lives, how long to train and how often to log, evaluate and
    checkpoint, and the mesh and execution every program of the run is built with.

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
    execution: how the model runs on this machine and mesh (``ExecutionConfig``: remat,
        attention and grouped-matmul kernels, ...; default every choice 'auto', settled and
        printed when the run is built). Not architecture: a run may resume, be evaluated or
        sampled with it changed. Bind it in gin as ``ExecutionConfig.remat = 'dots'``.
    allow_model_change: resume a run whose checkpoint was written with a different ModelConfig
        (array shapes must still match; fields such as ``top_k`` or ``score_fn`` keep them).
        Off by default: such a resume is a one-line error naming the fields, since it silently
        trains another model. How the model runs (remat, attention, ...) may always change.
    trainable: which parameters the optimiser updates: 'all' (default) or 'router' (only the
        routers' weights and biases, everything else frozen: DUME+ and BTX, DUME sec. 3.1;
        :data:`dagmoe_jax.run.optim.TRAINABLE`). The optimiser holds state for those only.
        'router_and_gates': the routers plus each routed expert's gate projection ``w_gate``
        (the DUME authors' runs: they freeze every parameter whose name lacks "gate"; at
        top_k = 1 only the ``w_gate`` move, the renormalised gate being 1).
        'non_experts': everything but the routed experts' weights (attention, norms,
        embeddings, routers, aggregators and shared experts train; the experts stay frozen).
        'aggregator': the DAG (or MLP) aggregator only (DUME+'s analogue for an upcycled
        DAG-MoE); 'shared': the shared experts only (its parameter-matched baseline).
    init_from: where a new run's parameters come from: '' (default) initialises them from
        ``seed``; a run directory: its newest checkpoint's parameters; ``hf:<folder>``: a
        Hugging Face Llama folder (:func:`dagmoe_jax.hf.llama.load_hf_llama`). The
        model's architecture is the source's (a gin binding that changes it is a one-line
        error; execution fields may change), the optimiser starts fresh, and a run resumed
        from its own checkpoint ignores it. See :mod:`dagmoe_jax.train.init_from`.
    tokenizer_from_source: with ``init_from`` set, the run reads text with the source's
        tokenizer (True, default): ``DataConfig.tokenizer``, ``tokenizer_path``, ``eos_token``
        and ``chat_template`` come from the source run's config (a ``hf:`` folder: its
        tokenizer.json or tokenizer.model), and a gin binding naming another is a one-line
        error. False keeps the gin config's tokenizer, on purpose (a new vocabulary).
    epochs: 0 (default): train ``steps`` steps (the data repeats as long as needed). N > 0
        (an ``instruct:`` source only): N passes over the training records; ``steps`` is
        derived from the packed batch count of N passes (printed), the value bound ignored.
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
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    allow_model_change: bool = False
    trainable: str = "all"
    init_from: str = ""
    tokenizer_from_source: bool = True
    epochs: int = 0

    def __post_init__(self):
        for name in ("steps", "grad_accum", "log_every", "save_every", "keep_checkpoints"):
            _positive("RunConfig", name, getattr(self, name))
        for name in ("seed", "eval_every", "eval_batches", "task_eval_examples", "epochs"):
            _nonnegative_int("RunConfig", name, getattr(self, name))
        _check(isinstance(self.mesh, MeshConfig), "RunConfig", "mesh", self.mesh,
               "a MeshConfig")
        _check(isinstance(self.execution, ExecutionConfig), "RunConfig", "execution",
               self.execution, "an ExecutionConfig")
        _check(isinstance(self.allow_model_change, bool), "RunConfig", "allow_model_change",
               self.allow_model_change, "True or False")
        _check(isinstance(self.wandb_project, str), "RunConfig", "wandb_project",
               self.wandb_project, "a W&B project name ('' = no W&B logging)")
        _check(self.wandb_mode in ("online", "offline"), "RunConfig", "wandb_mode",
               self.wandb_mode, "'online' or 'offline'")
        _choice("RunConfig", "trainable", self.trainable, TRAINABLE_SETS)
        _check(isinstance(self.init_from, str), "RunConfig", "init_from", self.init_from,
               "'' (fresh), a run directory or 'hf:<folder>'")
        _check(isinstance(self.tokenizer_from_source, bool), "RunConfig",
               "tokenizer_from_source", self.tokenizer_from_source, "True or False")
        _check(isinstance(self.run_dir, str) and self.run_dir.strip() != "", "RunConfig",
               "run_dir", self.run_dir, "a non-empty directory path")


# The name before the run's config said what it holds (gin: ``TrainConfig.*`` bindings).
TrainConfig = RunConfig


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule.

    learning_rate: peak learning rate (default 3e-3).
    schedule: 'wsd' (default; warmup-stable-decay, the DAG-MoE paper's schedule), 'cosine' or
      'constant'. Every schedule warms up linearly from 0.
    warmup_steps: linear warm-up length in optimizer steps (default 100; 0 = start at the peak).
    decay_fraction: 'wsd' only: the last ``round(decay_fraction * total_steps)`` steps decay
      linearly from the peak to ``min_lr_ratio * learning_rate`` (default 0.2; 0 = no decay).
    min_lr_ratio: floor of 'wsd' and 'cosine' as a fraction of the peak (default 0.0).
    weight_decay: decoupled AdamW weight decay (default 0.1), applied to weight matrices only
      (see ``decay_mask``); as in optax and PyTorch it is multiplied by the current learning rate.
    b1, b2, eps: Adam moments' decay rates and denominator epsilon (defaults 0.9, 0.95, 1e-8).
    grad_clip: clip gradients to this global L2 norm before AdamW (default 1.0; 0 disables).
    """

    learning_rate: float = 3e-3
    schedule: str = "wsd"
    warmup_steps: int = 100
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        c = "OptimConfig"
        _in_range(c, "learning_rate", self.learning_rate, 0, math.inf, low_open=True)
        _choice(c, "schedule", self.schedule, SCHEDULES)
        _nonnegative_int(c, "warmup_steps", self.warmup_steps)
        _in_range(c, "decay_fraction", self.decay_fraction, 0, 1)
        _in_range(c, "min_lr_ratio", self.min_lr_ratio, 0, 1)
        _in_range(c, "weight_decay", self.weight_decay, 0, math.inf)
        _in_range(c, "b1", self.b1, 0, 1, high_open=True)
        _in_range(c, "b2", self.b2, 0, 1, low_open=True, high_open=True)
        _in_range(c, "eps", self.eps, 0, math.inf, low_open=True)
        _in_range(c, "grad_clip", self.grad_clip, 0, math.inf)

    def decay_steps(self, total_steps: int) -> int:
        """Length of the final linear decay of 'wsd' (0 for the other schedules)."""
        if self.schedule != "wsd":
            return 0
        return int(round(self.decay_fraction * total_steps))
