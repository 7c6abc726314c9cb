"""AdamW with a learning-rate schedule, global-norm clipping and a weight-decay mask.

``make_optimizer(OptimConfig(), total_steps)`` returns one ``optax.GradientTransformation`` for
``nnx.Optimizer(model, tx, wrt=nnx.Param)``. Build it once per run: the transformation is
static data of the optimizer's graph, so a new one (new closures) means a new trace of the
jitted train step.

Schedules (all warm up linearly from 0 to the peak over ``warmup_steps``; the step is the
optimizer's update count, so the first update uses the rate of step 0, which is 0 when
``warmup_steps`` > 0):

* ``'wsd'`` (warmup-stable-decay, the DAG-MoE paper's schedule): warm-up, then the peak until
  the last ``round(decay_fraction * total_steps)`` steps, then linear decay to
  ``min_lr_ratio * peak`` at ``total_steps``;
* ``'cosine'``: warm-up, then cosine decay to ``min_lr_ratio * peak`` at ``total_steps``;
* ``'constant'``: warm-up, then the peak.

Past ``total_steps`` every schedule stays at its final value.

A run shorter than its warm-up plus decay (a 6-step try of a config that warms up over 2,000
steps) warms up over a tenth of the run instead (:func:`fitted_warmup`); the training loop
prints a note saying so. A run of fewer than 10 steps has no warm-up then (a tenth rounds to
0): its first update is at the peak, rather than a 1-step warm-up whose update at rate 0 would
waste one of its few steps. A decay that leaves no room even then is a one-line error naming
the binding to change.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from dagmoe_jax.config import aggregation_of, experts_of, router_of
from dagmoe_jax.run.config import OptimConfig


# Leaf names (or substrings of any path component) that mark a parameter as a norm scale or a
# bias: these are not weight-decayed. See ``decay_mask``.
_NO_DECAY_NAME_PARTS = ("scale", "bias")
_NO_DECAY_PATH_PARTS = ("norm",)


def fitted_warmup(cfg: OptimConfig, total_steps: int) -> int:
    """The warm-up length a run of ``total_steps`` uses: ``cfg.warmup_steps`` when the warm-up
    and the decay fit in the run ('cosine': the warm-up is shorter than the run), otherwise a
    tenth of the run (``total_steps // 10``)."""
    warmup = cfg.warmup_steps
    if cfg.schedule == "cosine":
        fits = warmup < total_steps
    else:
        fits = warmup + cfg.decay_steps(total_steps) <= total_steps
    return warmup if fits else min(warmup, total_steps // 10)


def schedule_note(cfg: OptimConfig, total_steps: int) -> str:
    """What a short run changes of the schedule ('' when nothing): for the training loop to
    print."""
    warmup = fitted_warmup(cfg, total_steps)
    if warmup == cfg.warmup_steps:
        return ""
    instead = (f"warming up over {warmup} steps (a tenth of the run) instead" if warmup else
               "no warm-up instead (a tenth of the run is under a step): the first update is "
               "at the peak learning rate")
    return (f"note: OptimConfig.warmup_steps={cfg.warmup_steps} does not fit in this "
            f"{total_steps}-step run: {instead}; bind --gin.OptimConfig.warmup_steps=N to "
            "choose")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of the optimizer step (see the module docstring)."""
    if not (isinstance(total_steps, int) and not isinstance(total_steps, bool)
            and total_steps >= 1):
        raise ValueError(f"total_steps={total_steps!r} is invalid: expected an integer >= 1")
    peak = float(cfg.learning_rate)
    floor = cfg.min_lr_ratio * peak
    warmup = fitted_warmup(cfg, total_steps)

    if cfg.schedule == "cosine":                 # fitted_warmup < total_steps
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=total_steps,
            end_value=floor)

    decay = cfg.decay_steps(total_steps)
    if warmup + decay > total_steps:
        what = "decay_fraction"
        raise ValueError(
            f"OptimConfig.warmup_steps={warmup} + decay steps={decay} (decay_fraction="
            f"{cfg.decay_fraction} of {total_steps}) exceed total_steps={total_steps}: bind "
            f"--gin.OptimConfig.{what}=<smaller> or train for more steps")
    pieces, boundaries = [], []
    if warmup > 0:
        pieces.append(optax.linear_schedule(0.0, peak, warmup))
        boundaries.append(warmup)
    pieces.append(optax.constant_schedule(peak))
    if decay > 0:
        boundaries.append(total_steps - decay)
        pieces.append(optax.linear_schedule(peak, floor, decay))
    if len(pieces) == 1:
        return pieces[0]
    return optax.join_schedules(pieces, boundaries)


def param_names(path) -> tuple:
    """A pytree path as a tuple of names, without the trailing ``value`` of an nnx Variable."""
    names = tuple(jax.tree_util.keystr((k,), simple=True) for k in path)
    if len(names) > 1 and names[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        names = names[:-1]
    return names


def is_decayed(names: tuple) -> bool:
    """Whether the parameter at path ``names`` is weight-decayed (see ``decay_mask``)."""
    if not names:
        return True
    leaf = names[-1].lower()
    if any(part in leaf for part in _NO_DECAY_NAME_PARTS):
        return False
    return not any(part in str(n).lower() for n in names for part in _NO_DECAY_PATH_PARTS)


def decay_mask(params: Any) -> Any:
    """A pytree of bools with the structure of ``params``: True where weight decay applies.

    Decided by parameter name, not by rank (``nnx.scan`` stacks every per-layer parameter with a
    leading layer axis, so a norm scale is 2-D): a parameter whose own name contains 'scale' or
    'bias' (``scale``, ``ln_scale``, ``ln_bias``), or any of whose path components contains
    'norm' (``final_norm``, ``layers/attn_norm``), is not decayed; every other parameter (the
    weight matrices, the embedding and the LM head) is. Works on ``nnx.state(model, nnx.Param)``
    (Variables) and on its pure-array form alike, which is what optax passes it at init and
    at update.
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: is_decayed(param_names(path)), params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (``identity`` when 0), then AdamW with
    ``make_schedule`` and weight decay masked by ``decay_mask``. Create it once per run.

    The chain has the same state structure whatever the hyperparameters, so a run can be
    resumed with another learning rate, schedule or clipping threshold.
    """
    adamw = optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw)


# RunConfig.trainable -> the parameters the optimiser updates and gradients are taken of.
TRAINABLE = {
    "all": nnx.Param,
    "router": nnx.All(nnx.Param, nnx.PathContains("router")),
    "router_and_gates": nnx.All(nnx.Param, nnx.Any(
        nnx.PathContains("router"),
        nnx.All(nnx.PathContains("experts"), nnx.PathContains("w_gate")))),
    "non_experts": nnx.All(nnx.Param, nnx.Not(nnx.PathContains("experts"))),
    "aggregator": nnx.All(nnx.Param, nnx.PathContains("aggregator")),
    "shared": nnx.All(nnx.Param, nnx.PathContains("shared")),
}


def check_trainable(model_cfg, trainable: str) -> None:
    """One-line error when ``trainable`` leaves nothing to learn in ``model_cfg``: 'router' on
    a model without routers, or on softmax gates renormalised over top_k = 1 (the gate is
    always 1, so the router gets no gradient; DUME+ needs top_k >= 2); 'non_experts' or
    'router_and_gates' on a model without routed experts (dense, DoE). 'router_and_gates' at
    top_k = 1 is allowed: its experts' ``w_gate`` still learn (the authors' top-1 runs)."""
    experts, aggregation = experts_of(model_cfg.block), aggregation_of(model_cfg.block)
    if trainable in ("non_experts", "router_and_gates") and experts is None:
        raise ValueError(f"RunConfig.trainable={trainable!r} on a {model_cfg.block.label} "
                         f"model: it has no routed experts (use 'all')")
    if trainable == "aggregator" and (aggregation is None or aggregation.kind == "sum"):
        raise ValueError("RunConfig.trainable='aggregator' needs a DAG or MLP aggregator "
                         "(AggregationConfig.kind='dag' or 'mlp'): this model has none")
    if trainable == "shared" and (experts is None or experts.num_shared == 0):
        raise ValueError("RunConfig.trainable='shared' needs shared experts "
                         "(ExpertConfig.num_shared >= 1): this model has none")
    if trainable != "router":
        return
    if router_of(model_cfg.block) is None:
        raise ValueError(f"RunConfig.trainable='router' on a {model_cfg.block.label} model: "
                         f"it has no router (use 'all')")
    r = router_of(model_cfg.block)
    if r is not None and r.top_k == 1 and r.renormalize:
        raise ValueError("RunConfig.trainable='router' with RouterConfig.top_k=1 and "
                         "renormalize=True: the gate is always 1, so the router gets no "
                         "gradient; use top_k >= 2 (DUME+)")
