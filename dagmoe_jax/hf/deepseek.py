"""Hugging Face DeepSeek-V2 and DeepSeek-V3 checkpoints as the library's MoE model with
multi-head latent attention, and back (docs/design.md section 7).

:func:`~dagmoe_jax.hf.llama.model_config_from_hf` reads the embeddings, final norm, RoPE and
the checks every family shares; this module reads what DeepSeek adds. The mapping, as
transformers 5 computes it (``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py``):

* Attention: MLA (``ModelConfig.mla``): ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` /
  ``q_b_proj``, ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``. The
  RoPE dimensions of the query and of the shared key are stored interleaved, pairs (x0, x1),
  (x2, x3), ... (V2 always; V3 with ``rope_interleave``, its default); the library rotates
  halves, so those columns are de-interleaved on the way in (:func:`rope_order`) and
  interleaved again on the way out.
* Layers: the first ``first_k_dense_replace`` are dense SwiGLUs of ``intermediate_size``
  (``ModelConfig.first_dense_layers``); the others are MoE layers: ``n_routed_experts``
  experts of ``moe_intermediate_size`` and ``n_shared_experts`` shared experts as one SwiGLU
  of ``n_shared_experts * moe_intermediate_size`` (``ExpertConfig.num_shared``).
* Routing, V2: softmax scores, ``topk_method`` 'greedy' or 'group_limited_greedy' (a group's
  score its best expert's: ``group_score='max'``), gates the top-k scores times
  ``routed_scaling_factor``. transformers' V2 never renormalises them, whatever
  ``norm_topk_prob`` says, while DeepSeek's own code does when it is true: such a folder is
  refused, the two disagreeing. V3: sigmoid scores, the top-k chosen by the scores plus
  ``e_score_correction_bias`` among the ``topk_group`` of ``n_group`` groups with the highest
  sum of their two best biased scores (``group_score='top2_sum'``), gates the unbiased scores,
  renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``. The correction bias
  is the router's selection bias (``RouterConfig.aux_free_bias_rate``, which fine-tuning moves
  at DeepSeek-V3's gamma = 0.001).
* Training loss (transformers computes none): V2's expert-level balance loss, V3's
  complementary sequence-wise one, both per sequence over slots (``RouterConfig``'s
  ``balance_scope='sequence'``, ``balance_load='slots'``) at ``aux_loss_alpha`` where DeepSeek's
  own config.json names it (else V2-Lite's 0.001 and V3's 0.0001), without a z-loss.

Multi-token prediction (V3's ``num_nextn_predict_layers``, ``ModelConfig.mtp``): module k is
stored as layer ``num_hidden_layers + k - 1``, a routed layer's tensors beside ``enorm``,
``hnorm``, ``eh_proj`` (M_k, the embedding's columns first) and ``shared_head.norm``, with
copies of the embedding and the head, which the library shares with the model. They are read
where the checkpoint holds them (DeepSeek's release; transformers saves none, and its
``num_nextn_predict_layers`` then reads as 0: :func:`mtp_layers_held`) and written with the
model's.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, Iterator, Tuple

import numpy as np

from dagmoe_jax.config import (ExpertConfig, MLAConfig, ModelConfig, MTPConfig, RouterConfig,
                               default_ffn_hidden)
from dagmoe_jax.families.moe.config import AggregationConfig, MoEConfig

TYPES = ("deepseek_v2", "deepseek_v3")
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
FIELDS = frozenset({
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "moe_intermediate_size", "n_routed_experts", "num_local_experts",
    "num_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
    "n_group", "topk_group", "topk_method", "norm_topk_prob", "routed_scaling_factor",
    "rope_interleave", "num_nextn_predict_layers", "output_router_logits",
    # DeepSeek's own config.json (its remote code) beside transformers'
    "scoring_func", "aux_loss_alpha", "seq_aux", "moe_layer_freq", "ep_size"})
_DEFAULT_ALPHA = {"deepseek_v2": 0.001, "deepseek_v3": 0.0001}
_TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"),
                 "deepseek_v3": ("noaux_tc",)}
_SCORING = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}
_LAYER_NORMS = ("attn_norm", "block_norm")     # the layer's norms; the others are MLA's
AUX_FREE_GAMMA = 0.001
"""DeepSeek-V3's bias update speed (sec. 4.2), the rate an imported V3's bias moves at."""


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"Hugging Face config {field}={json.dumps(value)} is not supported: {why}")


def _int(hf: dict, field: str, minimum: int = 1) -> int:
    value = hf.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"Hugging Face config {field} is missing or not an integer >= "
                         f"{minimum}: is this a {hf.get('model_type')} config.json?")
    return value


def deepseek_fields(hf: dict) -> Dict[str, object]:
    """The ModelConfig fields a DeepSeek ``config.json`` sets beside Llama's: ``mla``, the
    first dense layers, the MoE ``block``; one-line ValueError for what the library does not
    compute."""
    kind = hf["model_type"]
    method = hf.get("topk_method", _TOPK_METHODS[kind][0])
    if method not in _TOPK_METHODS[kind]:
        raise _refuse("topk_method", method, f"{kind} routes by "
                      f"{' or '.join(map(repr, _TOPK_METHODS[kind]))}")
    if hf.get("scoring_func", _SCORING[kind]) != _SCORING[kind]:
        raise _refuse("scoring_func", hf["scoring_func"], f"{kind} scores by "
                      f"{_SCORING[kind]!r}")
    if hf.get("moe_layer_freq", 1) != 1:
        raise _refuse("moe_layer_freq", hf["moe_layer_freq"], "every layer after the first "
                      "dense ones must be an MoE layer")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) not in (None, heads):
        raise _refuse("num_key_value_heads", hf["num_key_value_heads"], f"MLA gives every "
                      f"head its own key and value (num_attention_heads={heads})")
    if kind == "deepseek_v2" and hf.get("norm_topk_prob"):
        raise _refuse("norm_topk_prob", True, "transformers' DeepseekV2 does not renormalise "
                      "the top-k gates while DeepSeek's own code does; the two disagree")
    experts = next((hf[k] for k in ("n_routed_experts", "num_local_experts", "num_experts")
                    if hf.get(k) is not None), None)
    routed, shared = experts, _int(hf, "n_shared_experts")
    if not isinstance(routed, int) or routed < 1:
        raise ValueError(f"Hugging Face config n_routed_experts is missing or not a positive "
                         f"integer: is this a {kind} config.json?")
    groups = 1 if method == "greedy" else _int(hf, "n_group")
    top_k, hidden = _int(hf, "num_experts_per_tok"), _int(hf, "moe_intermediate_size")
    v3 = kind == "deepseek_v3"
    router = RouterConfig(
        score_fn=_SCORING[kind], top_k=top_k, renormalize=v3 and bool(hf.get("norm_topk_prob")),
        n_group=groups, topk_group=1 if groups == 1 else _int(hf, "topk_group"),
        group_score="top2_sum" if v3 else "max",
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        aux_free_bias_rate=AUX_FREE_GAMMA if v3 else 0.0,
        balance_coef=float(hf.get("aux_loss_alpha", _DEFAULT_ALPHA[kind])),
        balance_scope="sequence" if hf.get("seq_aux", True) else "batch",
        balance_load="slots", balance_prob="score_share" if v3 else "softmax", z_loss_coef=0.0)
    block = MoEConfig(router=router, aggregation=AggregationConfig(kind="sum"),
                      experts=ExpertConfig(num_experts=routed, expert_hidden=hidden,
                                           num_shared=shared, shared_hidden=hidden))
    dense_ffn = _int(hf, "intermediate_size")
    depth = hf.get("num_nextn_predict_layers") or 0 if v3 else 0
    if not isinstance(depth, int) or depth < 0:
        raise _refuse("num_nextn_predict_layers", depth, "expected an integer >= 0")
    return dict(
        mtp=MTPConfig(depth=depth),
        block=block, num_kv_heads=heads, head_dim=None,
        first_dense_layers=_int(hf, "first_k_dense_replace", 0),
        first_dense_ffn_hidden=None if dense_ffn == default_ffn_hidden(hf["hidden_size"])
        else dense_ffn,
        mla=MLAConfig(kv_lora_rank=_int(hf, "kv_lora_rank"),
                      q_lora_rank=hf.get("q_lora_rank") or 0,
                      qk_nope_head_dim=_int(hf, "qk_nope_head_dim"),
                      qk_rope_head_dim=_int(hf, "qk_rope_head_dim"),
                      v_head_dim=_int(hf, "v_head_dim")))


def interleaved(hf: dict) -> bool:
    """Whether a folder stores the RoPE dimensions as pairs (V2 always, V3 unless
    ``rope_interleave`` is false)."""
    return hf["model_type"] == "deepseek_v2" or bool(hf.get("rope_interleave", True))


def rope_order(n: int, pairs: bool) -> np.ndarray:
    """Where each of the library's ``n`` RoPE dimensions (halves: x_0..x_{n/2-1} rotate with
    x_{n/2}..) sits in a checkpoint's row: pairs (x0, x1), ... are the even dimensions then
    the odd ones; without ``pairs`` the same order."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)]) if pairs else np.arange(n)


def _head_order(m: MLAConfig, pairs: bool) -> np.ndarray:
    """The order of a query head's ``nope + rope`` columns (the RoPE part re-ordered)."""
    return np.concatenate([np.arange(m.qk_nope_head_dim),
                           m.qk_nope_head_dim + rope_order(m.qk_rope_head_dim, pairs)])


def layer_names(cfg: ModelConfig, i: int) -> Dict[str, str]:
    """The Hugging Face names of layer ``i``'s tensors, by the library's short key; an MoE
    layer's experts ``expert.{gate|up|down}.{j}``."""
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    names = {"attn_norm": p + "input_layernorm.weight",
             "block_norm": p + "post_attention_layernorm.weight",
             "w_kv_a": a + "kv_a_proj_with_mqa.weight", "kv_a_norm": a + "kv_a_layernorm.weight",
             "w_kv_b": a + "kv_b_proj.weight", "w_o": a + "o_proj.weight"}
    if cfg.mla.q_lora_rank:
        names.update(w_q_a=a + "q_a_proj.weight", q_a_norm=a + "q_a_layernorm.weight",
                     w_q_b=a + "q_b_proj.weight")
    else:
        names["w_q"] = a + "q_proj.weight"
    m = p + "mlp."
    if i < cfg.first_dense_layers:
        names.update({k: f"{m}{k}_proj.weight" for k in ("gate", "up", "down")})
        return names
    names["router"] = m + "gate.weight"
    if cfg.block.router.aux_free_bias_rate > 0:
        names["bias"] = m + "gate.e_score_correction_bias"
    for k in ("gate", "up", "down"):
        names[f"shared.{k}"] = f"{m}shared_experts.{k}_proj.weight"
        names.update({f"expert.{k}.{j}": f"{m}experts.{j}.{k}_proj.weight"
                      for j in range(cfg.block.experts.num_experts)})
    return names


def _attention_maps(cfg: ModelConfig, pairs: bool):
    """{key: (Hugging Face shape, checkpoint -> library, library -> checkpoint)} of one
    layer's attention and norms."""
    m, h, d = cfg.mla, cfg.num_heads, cfg.d_model
    r, qk, v = m.kv_lora_rank, m.qk_head_dim, m.v_head_dim
    kv_cols = np.concatenate([np.arange(r), r + rope_order(m.qk_rope_head_dim, pairs)])
    q_cols = _head_order(m, pairs)
    back_kv, back_q = np.argsort(kv_cols), np.argsort(q_cols)
    same = (lambda w: w, lambda w: w)
    maps = {"attn_norm": ((d,),) + same, "block_norm": ((d,),) + same,
            "kv_a_norm": ((r,),) + same,
            "w_kv_a": ((r + m.qk_rope_head_dim, d), lambda w: w.T[:, kv_cols],
                       lambda w: w[:, back_kv].T),
            "w_kv_b": ((h * (m.qk_nope_head_dim + v), r), lambda w: w.T.reshape(r, h, -1),
                       lambda w: w.reshape(r, -1).T),
            "w_o": ((d, h * v), lambda w: w.T.reshape(h, v, d), lambda w: w.reshape(-1, d).T)}
    rows = m.q_lora_rank or d
    q = ((h * qk, rows), lambda w: w.T.reshape(rows, h, qk)[..., q_cols],
         lambda w: w[..., back_q].reshape(rows, -1).T)
    if m.q_lora_rank:
        maps.update(w_q_a=((m.q_lora_rank, d), lambda w: w.T, lambda w: w.T),
                    q_a_norm=((m.q_lora_rank,),) + same, w_q_b=q)
    else:
        maps["w_q"] = q
    return maps


def _block_maps(cfg: ModelConfig, dense: bool):
    """{(key, library path under the layer): (Hugging Face shape, transposed?)} of one
    layer's feed-forward block (the expert keys without their index)."""
    d = cfg.d_model
    if dense:
        f = cfg.first_dense_config().resolved_ffn_hidden
        return {(k, ("block", f"w_{k}")): ((d, f) if k == "down" else (f, d))
                for k in ("gate", "up", "down")}
    e = cfg.block.experts
    maps = {("router", ("block", "router", "w_router")): (e.num_experts, d)}
    if cfg.block.router.aux_free_bias_rate > 0:
        maps[("bias", ("block", "router", "selection_bias"))] = (e.num_experts,)
    s = e.num_shared * e.shared_hidden
    for k in ("gate", "up", "down"):
        maps[(f"shared.{k}", ("block", "shared", f"w_{k}"))] = (d, s) if k == "down" else (s, d)
        maps[(f"expert.{k}", ("block", "experts", f"w_{k}"))] = (
            (d, e.expert_hidden) if k == "down" else (e.expert_hidden, d))
    return maps


def _stacks(cfg: ModelConfig):
    """(the stack's parameter path, its Hugging Face layer indices, whether dense) of the
    model's layers, the multi-token prediction modules' layers last (V3 stores module k as
    layer ``num_hidden_layers + k - 1``)."""
    k, n = cfg.first_dense_layers, cfg.num_layers
    return [s for s in ((("dense_layers",), range(k), True), (("layers",), range(k, n), False),
                        (("mtp", "layer"), range(n, n + cfg.mtp.depth), False)) if len(s[1])]


def mtp_names(cfg: ModelConfig, i: int) -> Dict[str, str]:
    """The names of the multi-token prediction module stored as layer ``i`` beside its
    layer's: its two norms, M_k, the norm before the head, and the copies of the embedding
    and head V3 keeps there (``embed``, ``head``: the library shares the model's)."""
    p = f"model.layers.{i}."
    return {"enorm": p + "enorm.weight", "hnorm": p + "hnorm.weight",
            "w_eh": p + "eh_proj.weight", "norm": p + "shared_head.norm.weight",
            "embed": p + "embed_tokens.weight", "head": p + "shared_head.head.weight"}


_MTP_OWN = {"enorm": ("enorm", "scale"), "hnorm": ("hnorm", "scale"), "w_eh": ("w_eh",),
            "norm": ("norm", "scale")}


def mtp_layers_held(names, hf: dict) -> int:
    """How many of a V3 folder's ``num_nextn_predict_layers`` modules its checkpoint holds
    (``names``: its tensor names): transformers saves none, DeepSeek's release all."""
    n, layers = hf.get("num_nextn_predict_layers") or 0, hf.get("num_hidden_layers", 0)
    return sum(f"model.layers.{layers + k}.eh_proj.weight" in names for k in range(n))


def deepseek_params(cfg: ModelConfig, read: Callable[[str, Tuple[int, ...]], np.ndarray],
                    pairs: bool) -> Iterator[Tuple[Tuple[str, ...], np.ndarray]]:
    """(library parameter path, float32 array) of every layer, each stack's layers stacked;
    ``read(name, shape)`` reads one Hugging Face tensor; ``pairs``: :func:`interleaved`."""
    attention = _attention_maps(cfg, pairs)
    for stack, layers, dense in _stacks(cfg):
        names = [layer_names(cfg, i) for i in layers]
        for key, (shape, to_ours, _) in attention.items():
            path = (key, "scale") if key in _LAYER_NORMS else ("attn", key)
            yield stack + path, np.stack([to_ours(read(n[key], shape)) for n in names])
        for (key, path), shape in _block_maps(cfg, dense).items():
            if key.startswith("expert."):
                e = cfg.block.experts.num_experts
                value = np.stack([np.stack([read(n[f"{key}.{j}"], shape).T for j in range(e)])
                                  for n in names])
            else:
                value = np.stack([read(n[key], shape) if len(shape) == 1 else
                                  read(n[key], shape).T for n in names])
            yield stack + path, value
    d, n = cfg.d_model, cfg.num_layers
    for key, path in _MTP_OWN.items():        # each module's own, stacked over the depths
        shape = (d, 2 * d) if key == "w_eh" else (d,)
        values = [read(mtp_names(cfg, n + k)[key], shape) for k in range(cfg.mtp.depth)]
        if values:
            yield ("mtp",) + path, np.stack([v.T if key == "w_eh" else v for v in values])


def tensor_names(cfg: ModelConfig) -> set:
    """Every layer tensor name a DeepSeek of ``cfg`` holds (its MTP modules' too)."""
    n = cfg.num_layers
    return ({name for i in range(n + cfg.mtp.depth) for name in layer_names(cfg, i).values()}
            | {name for i in range(n, n + cfg.mtp.depth)
               for name in mtp_names(cfg, i).values()})


def export_type(cfg: ModelConfig) -> str:
    """'deepseek_v3' for sigmoid routing, 'deepseek_v2' for softmax; a one-line ValueError
    naming the field that neither computes."""
    b = cfg.block
    r, e = b.router, b.experts
    v3 = r.score_fn == "sigmoid"
    kind = "deepseek_v3" if v3 else "deepseek_v2"
    checks = [("AggregationConfig.kind", b.aggregation.kind, "sum", "DeepSeek sums its "
               "experts' gated outputs"),
              ("ExpertConfig.dispatch", e.dispatch, "dropless", "its experts take every token "
               "routed to them"),
              ("RouterConfig.temperature", r.temperature, 1.0, "its router divides by none"),
              ("RouterConfig.bias", r.bias, False, "its router has no learned bias"),
              ("ModelConfig.qk_norm", cfg.qk_norm, "none", "MLA has no q/k norms"),
              ("RouterConfig.group_score", r.group_score, "top2_sum" if v3 else "max",
               f"{kind}'s group score is that")]
    if not v3:
        checks += [("RouterConfig.renormalize", r.renormalize, False, "transformers' "
                    "DeepseekV2 does not renormalise the gates (a sigmoid router exports as "
                    "DeepseekV3, which does)"),
                   ("RouterConfig.aux_free_bias_rate", r.aux_free_bias_rate, 0.0,
                    "DeepseekV2 has no selection bias (a sigmoid router exports as DeepseekV3, "
                    "which has)"),
                   ("MTPConfig.depth", cfg.mtp.depth, 0, "DeepseekV2 has no multi-token "
                    "prediction (a sigmoid router exports as DeepseekV3, which has)")]
    for field, value, allowed, why in checks:
        if value != allowed:
            raise ValueError(f"{field}={value!r} cannot be exported to a Hugging Face {kind}: "
                             f"{why} ({field}={allowed!r} can)")
    if e.num_shared == 0 or (e.num_shared * e.shared_hidden) % e.expert_hidden:
        raise ValueError(f"ExpertConfig.num_shared={e.num_shared} with shared_hidden="
                         f"{e.shared_hidden} cannot be exported to a Hugging Face {kind}: its "
                         f"shared experts are n_shared_experts >= 1 of the routed experts' "
                         f"width (expert_hidden={e.expert_hidden})")
    return kind


def deepseek_hf_config(cfg: ModelConfig, kind: str) -> dict:
    """The ``config.json`` fields of ``kind`` beside Llama's, the inverse of
    :func:`deepseek_fields`."""
    m, r, e = cfg.mla, cfg.block.router, cfg.block.experts
    v3 = kind == "deepseek_v3"
    hf = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
          "num_key_value_heads": cfg.num_heads, "head_dim": m.qk_rope_head_dim,
          "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
          "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
          "qk_head_dim": m.qk_head_dim, "v_head_dim": m.v_head_dim,
          "first_k_dense_replace": cfg.first_dense_layers,
          "intermediate_size": (cfg.first_dense_config().resolved_ffn_hidden
                                if cfg.first_dense_layers else e.expert_hidden),
          "moe_intermediate_size": e.expert_hidden, "n_routed_experts": e.num_experts,
          "n_shared_experts": e.num_shared * e.shared_hidden // e.expert_hidden,
          "num_experts_per_tok": r.top_k, "n_group": r.n_group, "topk_group": r.topk_group,
          "norm_topk_prob": r.renormalize, "routed_scaling_factor": r.routed_scaling_factor,
          "output_router_logits": False}
    if v3:
        hf.update(rope_interleave=True, num_nextn_predict_layers=cfg.mtp.depth)
    else:
        hf.update(topk_method="greedy" if r.n_group == 1 else "group_limited_greedy",
                  mlp_bias=False)
    return hf


def deepseek_tensors(cfg: ModelConfig, param: Callable[[Tuple[str, ...]], np.ndarray]
                     ) -> Iterator[Tuple[str, np.ndarray]]:
    """(Hugging Face tensor name, float32 array) of every layer, the inverse of
    :func:`deepseek_params` (written interleaved, as DeepSeek's checkpoints are)."""
    attention = _attention_maps(cfg, pairs=True)
    for stack, layers, dense in _stacks(cfg):
        blocks = _block_maps(cfg, dense)
        values = {key: param(stack + ((key, "scale") if key in _LAYER_NORMS
                                      else ("attn", key))) for key in attention}
        values.update({key: param(stack + path) for key, path in blocks})
        for j, i in enumerate(layers):
            names = layer_names(cfg, i)
            for key, (_, _, to_hf) in attention.items():
                yield names[key], np.ascontiguousarray(to_hf(values[key][j]))
            for key, _ in blocks:
                w = values[key][j]
                if key.startswith("expert."):
                    for x in range(w.shape[0]):
                        yield names[f"{key}.{x}"], np.ascontiguousarray(w[x].T)
                else:
                    yield names[key], np.ascontiguousarray(w if w.ndim == 1 else w.T)
    own = {key: param(("mtp",) + path) for key, path in _MTP_OWN.items()} if cfg.mtp.depth else {}
    for k in range(cfg.mtp.depth):
        names = mtp_names(cfg, cfg.num_layers + k)
        for key, w in own.items():
            yield names[key], np.ascontiguousarray(w[k].T if key == "w_eh" else w[k])
        yield names["embed"], param(("embed",))            # V3's copies of the shared two
        yield names["head"], np.ascontiguousarray(param(("lm_head",)).T)
