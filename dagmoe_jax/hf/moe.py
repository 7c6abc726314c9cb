"""Hugging Face MoE checkpoints (Mixtral, OLMoE, Qwen3-MoE) as the library's MoE block.

Each family is a :class:`MoEFamily`: where its ``config.json`` keeps the expert count, the
routed experts' hidden size and its routing, which attention details it adds (q/k norms) and
how its tensors are named. :func:`~dagmoe_jax.hf.llama.model_config_from_hf` and
:func:`~dagmoe_jax.hf.llama.load_hf_llama` read the attention, norms, embeddings and RoPE as
for a Llama and the feed-forward block from here. The mapping (docs/design.md section 7):

* Routing: all three take a softmax over every expert's logit (float32) and keep the top k;
  Mixtral renormalises the kept weights (its softmax over the top-k logits is the same
  numbers), OLMoE and Qwen3-MoE renormalise only with ``norm_topk_prob``. That is
  ``RouterConfig(score_fn='softmax', renormalize=...)`` with the sum aggregation. Their
  training loss is Switch's balance loss as transformers' ``load_balancing_loss_func``
  computes it (``balance_load='tokens'``, ``balance_prob='softmax'``) at
  ``router_aux_loss_coef``, without a z-loss.
* Experts: SwiGLU, ``gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral's ``w1`` / ``w3`` /
  ``w2``), stacked [experts, in, out]; the router's ``gate`` is [experts, d], transposed.
* Attention: OLMoE normalises the whole q and k projections (``ModelConfig.qk_norm='full'``),
  Qwen3-MoE each head (``'head'``), Mixtral neither.

What the MoE block cannot express (dense layers between sparse ones, shared experts, a
sliding window, clipped q/k/v, router jitter) is a one-line ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, Iterator, Tuple

import numpy as np

from dagmoe_jax.config import ExpertConfig, ModelConfig, RouterConfig
from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig


@dataclasses.dataclass(frozen=True)
class MoEFamily:
    """What one Hugging Face MoE architecture writes.

    experts_keys: config keys of the routed-expert count, the first present read.
    hidden_key: config key of each routed expert's hidden size.
    always_renormalize: the top-k weights are renormalised whatever ``norm_topk_prob`` says.
    qk_norm: ``ModelConfig.qk_norm`` of its attention.
    mlp: the block's module name in a layer; router: the router's, under ``mlp``.
    projections: the tensor names of (gate, up, down) in one expert.
    fields: config fields read here beside Llama's; refusals: fields refused unless at the
      value given (what the block cannot express).
    architecture: the ``architectures`` entry an export writes.
    """

    experts_keys: Tuple[str, ...]
    hidden_key: str
    always_renormalize: bool
    qk_norm: str
    mlp: str
    projections: Tuple[str, str, str]
    fields: frozenset
    refusals: Tuple[Tuple[str, object, str], ...] = ()
    architecture: str = ""


_MOE_FIELDS = frozenset({"num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
                         "output_router_logits"})
FAMILIES: Dict[str, MoEFamily] = {
    "mixtral": MoEFamily(
        experts_keys=("num_local_experts",), hidden_key="intermediate_size",
        always_renormalize=True, qk_norm="none", mlp="block_sparse_moe",
        projections=("w1", "w3", "w2"),
        fields=_MOE_FIELDS | {"num_local_experts", "router_jitter_noise"},
        refusals=(("router_jitter_noise", 0.0, "the library's router adds no noise"),),
        architecture="MixtralForCausalLM"),
    "olmoe": MoEFamily(
        experts_keys=("num_experts",), hidden_key="intermediate_size",
        always_renormalize=False, qk_norm="full", mlp="mlp",
        projections=("gate_proj", "up_proj", "down_proj"),
        fields=_MOE_FIELDS | {"num_experts", "clip_qkv"},
        refusals=(("clip_qkv", None, "the library does not clip q, k and v"),),
        architecture="OlmoeForCausalLM"),
    "qwen3_moe": MoEFamily(
        experts_keys=("num_experts", "num_local_experts"), hidden_key="moe_intermediate_size",
        always_renormalize=False, qk_norm="head", mlp="mlp",
        projections=("gate_proj", "up_proj", "down_proj"),
        fields=_MOE_FIELDS | {"num_experts", "num_local_experts", "moe_intermediate_size",
                              "decoder_sparse_step", "mlp_only_layers", "use_sliding_window",
                              "max_window_layers", "layer_types"},
        refusals=(("decoder_sparse_step", 1, "every layer must be sparse (the library's "
                   "layers are one block family)"),
                  ("mlp_only_layers", [], "every layer must be sparse (the library's layers "
                   "are one block family)"),
                  ("use_sliding_window", False, "the library's attention is full causal")),
        architecture="Qwen3MoeForCausalLM"),
}


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {field}={json.dumps(value)} is not supported: {why}")


def moe_block_config(hf: dict, family: MoEFamily) -> Tuple[MoEConfig, dict]:
    """(the ``MoEConfig`` of ``hf``, the ModelConfig fields the family sets: ``qk_norm``).
    One-line ValueError for what the block cannot express."""
    for field, allowed, why in family.refusals:
        value = hf.get(field, allowed)
        if value != allowed and not (allowed == [] and value is None):
            raise _refuse(field, value, why)
    experts = next((hf[k] for k in family.experts_keys if hf.get(k) is not None), None)
    for name, value in (("/".join(family.experts_keys), experts),
                        (family.hidden_key, hf.get(family.hidden_key)),
                        ("num_experts_per_tok", hf.get("num_experts_per_tok"))):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Hugging Face config {name} is missing or not a positive integer: "
                             f"is this a {hf.get('model_type')} config.json?")
    renormalize = family.always_renormalize or bool(hf.get("norm_topk_prob", False))
    router = RouterConfig(score_fn="softmax", top_k=hf["num_experts_per_tok"],
                          renormalize=renormalize,
                          balance_coef=float(hf.get("router_aux_loss_coef", 0.01)),
                          balance_load="tokens", balance_prob="softmax", z_loss_coef=0.0)
    block = MoEConfig(router=router,
                      experts=ExpertConfig(num_experts=experts,
                                           expert_hidden=hf[family.hidden_key], num_shared=0),
                      aggregation=AggregationConfig(kind="sum"))
    return block, {"qk_norm": family.qk_norm}


def layer_tensor_names(family: MoEFamily, num_experts: int, i: int) -> Dict[str, str]:
    """The Hugging Face names of layer ``i``'s MoE tensors: ``router`` and, per expert j,
    ``(gate|up|down, j)`` (keys as strings ``'gate.j'``)."""
    p = f"model.layers.{i}.{family.mlp}."
    names = {"router": p + "gate.weight"}
    for j in range(num_experts):
        for ours, theirs in zip(("gate", "up", "down"), family.projections):
            names[f"{ours}.{j}"] = f"{p}experts.{j}.{theirs}.weight"
    return names


def moe_block_params(cfg: ModelConfig, family: MoEFamily,
                     read: Callable[[str, Tuple[int, ...]], np.ndarray]
                     ) -> Iterator[Tuple[Tuple[str, ...], np.ndarray]]:
    """(library parameter path, float32 array) of every layer's MoE block, stacked
    [layers, ...]; ``read(name, shape)`` reads one Hugging Face tensor of that shape."""
    e, d = cfg.block.experts.num_experts, cfg.d_model
    f = cfg.block.experts.expert_hidden
    layers = range(cfg.num_layers)
    names = [layer_tensor_names(family, e, i) for i in layers]
    yield ("layers", "block", "router", "w_router"), np.stack(
        [read(names[i]["router"], (e, d)).T for i in layers])
    for ours, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
        yield ("layers", "block", "experts", f"w_{ours}"), np.stack(
            [np.stack([read(names[i][f"{ours}.{j}"], shape).T for j in range(e)])
             for i in layers])


# The family an MoE of the library exports to, by its attention's q/k norms (the one field in
# which the three differ that the routing does not decide).
EXPORT_FAMILY = {family.qk_norm: name for name, family in FAMILIES.items()}


def export_family(cfg: ModelConfig) -> str:
    """The Hugging Face family an MoE model of ``cfg`` is written as (``EXPORT_FAMILY``), or a
    one-line ValueError naming the field none of the three can express."""
    block = cfg.block
    if block.aggregation.kind != "sum":
        raise ValueError(f"AggregationConfig.kind={block.aggregation.kind!r} has no Hugging Face "
                         f"family: Mixtral, OLMoE and Qwen3-MoE sum their experts' gated "
                         f"outputs (aggregation 'sum')")
    r, e = block.router, block.experts
    for field, value, allowed, why in (
            ("RouterConfig.score_fn", r.score_fn, "softmax", "their routers take a softmax "
             "over the experts"),
            ("RouterConfig.temperature", r.temperature, 1.0, "their routers divide by none"),
            ("RouterConfig.bias", r.bias, False, "their routers have no bias"),
            ("RouterConfig.aux_free_bias_rate", r.aux_free_bias_rate, 0.0, "their routers "
             "select by the unbiased scores, so the selection bias would be lost"),
            ("RouterConfig.n_group", r.n_group, 1, "their routers select among all experts"),
            ("ModelConfig.first_dense_layers", cfg.first_dense_layers, 0, "every layer of "
             "theirs is an MoE layer"),
            ("RouterConfig.routed_scaling_factor", r.routed_scaling_factor, 1.0,
             "their routers do not scale the gates"),
            ("ExpertConfig.num_shared", e.num_shared, 0, "none of the three has shared experts"),
            ("ExpertConfig.dispatch", e.dispatch, "dropless", "their experts take every token "
             "routed to them")):
        if value != allowed:
            raise ValueError(f"{field}={value!r} cannot be exported to a Hugging Face MoE: "
                             f"{why} ({field}={allowed!r} can)")
    name = EXPORT_FAMILY[cfg.qk_norm]
    if FAMILIES[name].always_renormalize and not r.renormalize:
        raise ValueError(f"RouterConfig.renormalize=False cannot be exported with "
                         f"ModelConfig.qk_norm={cfg.qk_norm!r}: that is {name}, which always "
                         f"renormalises the top-k weights (the families of the other q/k "
                         f"norms follow norm_topk_prob)")
    return name


def moe_hf_config(cfg: ModelConfig, name: str) -> dict:
    """The ``config.json`` fields of family ``name`` for the MoE block of ``cfg`` (beside the
    Llama ones), the inverse of :func:`moe_block_config`."""
    family, r, e = FAMILIES[name], cfg.block.router, cfg.block.experts
    hf = {"architectures": [family.architecture], "model_type": name,
          # every key a version of transformers reads the count from (Qwen3-MoE: 4.x's
          # num_experts, 5.x's num_local_experts)
          **{key: e.num_experts for key in family.experts_keys},
          family.hidden_key: e.expert_hidden,
          "num_experts_per_tok": r.top_k, "router_aux_loss_coef": r.balance_coef,
          "output_router_logits": False}
    hf.update({field: allowed for field, allowed, _ in family.refusals})
    if not family.always_renormalize:
        hf["norm_topk_prob"] = r.renormalize
    if name == "qwen3_moe":   # the width of its dense MLPs (mlp_only_layers: none) and window
        hf.update(intermediate_size=e.expert_hidden, sliding_window=None)
    return hf


def moe_block_tensors(cfg: ModelConfig, name: str,
                      param: Callable[[Tuple[str, ...]], np.ndarray]
                      ) -> Iterator[Tuple[str, np.ndarray]]:
    """(Hugging Face tensor name, float32 array) of every layer's MoE block in family
    ``name``, the inverse of :func:`moe_block_params`; ``param(path)`` reads one of the
    library's stacked parameters."""
    family, e = FAMILIES[name], cfg.block.experts.num_experts
    stacked = {key: param(("layers", "block", *path)) for key, path in (
        ("router", ("router", "w_router")), ("gate", ("experts", "w_gate")),
        ("up", ("experts", "w_up")), ("down", ("experts", "w_down")))}
    for i in range(cfg.num_layers):
        names = layer_tensor_names(family, e, i)
        yield names["router"], np.ascontiguousarray(stacked["router"][i].T)
        for ours in ("gate", "up", "down"):
            for j in range(e):
                yield names[f"{ours}.{j}"], np.ascontiguousarray(stacked[ours][i, j].T)
