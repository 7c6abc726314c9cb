"""Validated model configuration, exposed to gin.

Every dataclass here is frozen and checks itself in ``__post_init__``: an invalid value or an
invalid combination raises ``ValueError`` naming the field and the range it accepts. Defaults
follow the DAG-MoE paper's small model (Table 3, Appendix B.1) unless a comment says otherwise.

gin binds these classes under the same names (``ModelConfig.d_model = 512``,
``ModelConfig.router = @RouterConfig()``) through :mod:`dagmoe_jax.run.gin`, which registers
them as external configurables: gin bindings never change what plain Python construction gives.
See ``configs/`` for the paper's models.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from dagmoe_jax.budget import dag_params_per_layer, matched_shared_hidden  # noqa: F401
from dagmoe_jax.config.doe import DoEConfig
from dagmoe_jax.config.execution import ExecutionConfig
from dagmoe_jax.validate import (check as _check, choice as _choice, nonnegative as _nonnegative,
                                 positive as _positive)

BLOCK_TYPES = ("dense", "moe", "coe", "doe")
SCORE_FNS = ("sigmoid", "softmax")
DISPATCH_MODES = ("dropless", "capacity")
AGGREGATORS = ("sum", "dag", "mlp")
EDGE_ACTIVATIONS = ("silu", "sigmoid")
DAG_EDGES = ("all", "ranked", "self")
DAG_READINGS = ("once", "literal")
COE_RESIDUALS = ("inner", "outer", "init")
COE_READINGS = ("once", "literal", "reference")
BALANCE_LOADS = ("tokens", "slots")
BALANCE_PROBS = ("softmax", "score_share")
# What ExpertConfig.dispatch values of earlier versions became (ModelConfig.from_dict migrates).
RETIRED_DISPATCH = {
    "auto": "whether experts drop tokens is architecture, the same on every machine: write "
            "ExpertConfig.dispatch='dropless' (exact, the default) or 'capacity'",
    "dense": "every expert on every token is now how dropless dispatch runs: write "
             "ExpertConfig.dispatch='dropless' and ExecutionConfig.grouped_matmul='einsum'"}
DTYPES = ("float32", "bfloat16")
ROPE_SCALINGS = ("none", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Token-choice router (docs/design.md section 2).

    score_fn: 'sigmoid' (DAG-MoE default) or 'softmax' (Switch, CoE reference code).
    top_k: experts selected per token (K).
    renormalize: divide the selected gates by their sum (off in DAG-MoE).
    balance_coef: Switch balance-loss coefficient (paper: 0.01).
    balance_load: f_i of the balance loss ``N sum_i f_i P_i``. 'tokens' (default; the paper's
      training stack, Hugging Face's ``load_balancing_loss_func``): the share of tokens that
      chose expert i, so f sums to K and the loss is K at balance. 'slots': the share of the
      T * K routing slots, f sums to 1 and the loss is 1 at balance (K times less pressure at
      the same coefficient; this library's convention before it followed the paper's stack).
    balance_prob: P_i of the balance loss. 'softmax' (default; Hugging Face's function takes the
      softmax of the router logits whatever the score function): mean over tokens of
      softmax(z)_i. 'score_share': mean of s_i / sum_j s_j (equal to 'softmax' for softmax
      scores; for sigmoid scores the share of each expert in the token's summed scores).
    z_loss_coef: router z-loss coefficient (paper: 0.001).
    bias: give the router a learned bias, logits ``x W + b`` (DUME sec. 2.2, where the ridge
      solution's last row is the bias; off by default: DAG-MoE's router has none).
    temperature: T of ``logits / T`` before the score function (DUME sec. 2.2; 1 = none).
      DUME's gate softmax(top-k(logits / T)) is score_fn='softmax' with renormalize=True.
    """

    score_fn: str = "sigmoid"
    top_k: int = 4
    renormalize: bool = False
    balance_coef: float = 0.01
    balance_load: str = "tokens"
    balance_prob: str = "softmax"
    z_loss_coef: float = 0.001
    bias: bool = False
    temperature: float = 1.0

    def __post_init__(self):
        _choice("RouterConfig", "score_fn", self.score_fn, SCORE_FNS)
        _choice("RouterConfig", "balance_load", self.balance_load, BALANCE_LOADS)
        _choice("RouterConfig", "balance_prob", self.balance_prob, BALANCE_PROBS)
        _positive("RouterConfig", "top_k", self.top_k)
        _nonnegative("RouterConfig", "balance_coef", self.balance_coef)
        _nonnegative("RouterConfig", "z_loss_coef", self.z_loss_coef)
        _check(isinstance(self.bias, bool), "RouterConfig", "bias", self.bias, "True or False")
        _check(isinstance(self.temperature, (int, float)) and self.temperature > 0,
               "RouterConfig", "temperature", self.temperature, "a number > 0")


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequency scaling for long contexts (Hugging Face ``rope_scaling``).

    kind: 'none' (default: plain RoPE, theta^(-2i/D)), 'llama3' (Llama 3.1/3.2: wavelengths
      longer than original_max_position / low_freq_factor are divided by ``factor``, shorter than
      original_max_position / high_freq_factor kept, the band between interpolated smoothly;
      :func:`dagmoe_jax.model.attention.llama3_inv_freq`) or 'linear' (position interpolation:
      every frequency divided by ``factor``, Hugging Face's ``rope_type='linear'``).
    factor, low_freq_factor, high_freq_factor, original_max_position: the 'llama3' parameters
      (defaults: Llama 3.1's 8, 1, 4, 8192; 'linear' reads ``factor`` only); ignored for
      'none'.
    """

    kind: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        c = "RopeScalingConfig"
        _choice(c, "kind", self.kind, ROPE_SCALINGS)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check(isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0, c,
                   name, getattr(self, name), "a number > 0")
        _check(self.high_freq_factor > self.low_freq_factor, c, "high_freq_factor",
               self.high_freq_factor, f"a number > low_freq_factor={self.low_freq_factor}")
        _positive(c, "original_max_position", self.original_max_position)


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    """Routed and shared experts and how tokens reach them (docs/design.md section 3).

    num_experts: routed experts N (paper s: 32, or 64 fine-grained).
    expert_hidden: SwiGLU hidden size d_r of each routed expert (paper s: 256).
    num_shared: shared experts applied to every token (0 = none; the paper's parity baseline uses 1).
    shared_hidden: hidden size of each shared expert.
    dispatch: whether experts drop tokens, part of the architecture (saved, the same on every
      machine): 'dropless' (default: every assignment computed; exact) or 'capacity' (C slots
      per expert, the overflow dropped; einsum over [N, C, d]). How 'dropless' runs on a
      machine is ``ExecutionConfig.grouped_matmul``.
    capacity_factor: C = ceil(capacity_factor * T * K / N) slots per expert for 'capacity'.
    """

    num_experts: int = 32
    expert_hidden: int = 256
    num_shared: int = 0
    shared_hidden: int = 256
    dispatch: str = "dropless"
    capacity_factor: float = 1.25

    def __post_init__(self):
        _positive("ExpertConfig", "num_experts", self.num_experts)
        _positive("ExpertConfig", "expert_hidden", self.expert_hidden)
        _check(isinstance(self.num_shared, int) and self.num_shared >= 0, "ExpertConfig", "num_shared",
               self.num_shared, "an integer >= 0")
        _positive("ExpertConfig", "shared_hidden", self.shared_hidden)
        if self.dispatch in RETIRED_DISPATCH:
            raise ValueError(f"ExpertConfig.dispatch={self.dispatch!r} is no longer a choice: "
                             f"{RETIRED_DISPATCH[self.dispatch]}")
        _choice("ExpertConfig", "dispatch", self.dispatch, DISPATCH_MODES)
        _check(isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0,
               "ExpertConfig", "capacity_factor", self.capacity_factor, "a number > 0")


@dataclasses.dataclass(frozen=True)
class AggregationConfig:
    """How the K expert outputs become the block output (docs/design.md section 4).

    kind: 'sum' (eq. 1), 'dag' (DAG-MoE eq. 6-12) or 'mlp' (the MLP-mixing ablation).
    dag_dim: hidden size d_g of the DAG module (and of the MLP mixer).
    dag_iters: DAG iterations L (depth of the learned DAG).
    edge_act: sigma of eq. 10: 'silu' (the paper: the experts' activation) or 'sigmoid'.
    dag_edges: 'all' (eq. 9-11: node i aggregates from all K nodes of the previous depth) or
      'ranked' (node i aggregates only from nodes the router ranked at or above it). With 'all'
      the update of node i depends on x_i and the *set* of nodes, so the module's output does
      not depend on the node order; 'ranked' makes the graph follow the router's ranking and
      the output order-sensitive (our extension, not in the paper). 'self': the edge-free
      ablation (ours): node i hears only itself, e_(i,i) * W_node [u_i; u_i], no message passing.
    dag_shared_weights: False (default): each iteration has its own weights, as eq. 8-11's
      superscript l writes them; True: one module applied in all L iterations, as the text's
      "each iteration applies the same module" (DAG-MoE sec. 3.3) reads.
    dag_residual: how the residual ``x / K`` of eq. 6 meets the decoder's own residual stream
      (x = RMSNorm(h) is the block input, the layer computes h + block output):
      'once' (default): x is counted once. The block returns sum_i x_i^L - x, the nodes'
        updates without the residual that eq. 12 sums back in, so the layer is
        h + sum_i (x_i^L - x / K); with W_up = 0 (its initialisation) this is exactly the MoE
        layer h + sum_k g_k E_k(x). The nodes themselves, and so every equation's inputs, are
        as written.
      'literal': the block returns eq. 12's sum_i x_i^L, so the layer is h + x + ...: every DAG
        layer adds a whole RMSNorm(h) (norm ~sqrt(d)) to the stream, which no other block
        does. Kept for comparison; it trains worse (docs/training.md, quality benchmark).
    """

    kind: str = "sum"
    dag_dim: int = 128
    dag_iters: int = 2
    edge_act: str = "silu"
    dag_edges: str = "all"
    dag_residual: str = "once"
    dag_shared_weights: bool = False

    def __post_init__(self):
        _choice("AggregationConfig", "kind", self.kind, AGGREGATORS)
        _positive("AggregationConfig", "dag_dim", self.dag_dim)
        _positive("AggregationConfig", "dag_iters", self.dag_iters)
        _choice("AggregationConfig", "edge_act", self.edge_act, EDGE_ACTIVATIONS)
        _choice("AggregationConfig", "dag_edges", self.dag_edges, DAG_EDGES)
        _choice("AggregationConfig", "dag_residual", self.dag_residual, DAG_READINGS)
        _check(isinstance(self.dag_shared_weights, bool), "AggregationConfig",
               "dag_shared_weights", self.dag_shared_weights, "True or False")


@dataclasses.dataclass(frozen=True)
class CoEConfig:
    """Chain-of-Experts block (docs/design.md section 5; CoE eq. 4-10).

    iterations: communication steps C.
    top_k_per_iter: experts per iteration K_t; None means router.top_k // iterations.
    shared_router: reuse the first iteration's routing decision in every iteration (CoE eq. 8
      ablation) instead of one router per iteration.
    residual: 'inner' (eq. 5, default), 'outer' (eq. 9) or 'init' (eq. 10).
    stream: how the chain's own residual (its output contains x^(0) = x = RMSNorm(h) in every
      residual mode) meets the decoder's residual stream h:
      'once' (default): the block returns its output minus x^(0), the experts' updates only, so
        the layer is h + updates and equals the standard layer when the experts output zero.
      'literal': the block returns the chain's output, so the layer is h + x + updates (x
        counted twice, as in this library before the fix).
      'reference': the CoE authors' code: the layer's output *is* the chain's output,
        RMSNorm(h) + updates, replacing the stream h instead of adding to it.
    score_fn: the iterations' routers' score function: None (default) the model's
      ``RouterConfig.score_fn``; 'softmax' is CoE eq. 7 (softmax over N, then top-K_t).
    """

    iterations: int = 2
    top_k_per_iter: Optional[int] = None
    shared_router: bool = False
    residual: str = "inner"
    stream: str = "once"
    score_fn: Optional[str] = None

    def __post_init__(self):
        _positive("CoEConfig", "iterations", self.iterations)
        if self.score_fn is not None:
            _choice("CoEConfig", "score_fn", self.score_fn, SCORE_FNS)
        if self.top_k_per_iter is not None:
            _positive("CoEConfig", "top_k_per_iter", self.top_k_per_iter)
        _choice("CoEConfig", "residual", self.residual, COE_RESIDUALS)
        _choice("CoEConfig", "stream", self.stream, COE_READINGS)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-3 style decoder (DAG-MoE Appendix B.1) with a choice of FFN block.

    vocab_size: embedding and LM-head rows (256 = bytes; the paper used Llama-3's 128,256).
    d_model, num_layers, num_heads, num_kv_heads: Table 3 (s: 512, 4, 32, 8).
    head_dim: None means d_model // num_heads.
    ffn_hidden: hidden size of the 'dense' block's SwiGLU; None means 8/3 d rounded up to 128.
    block: 'dense', 'moe' (router + experts + aggregator), 'coe' (Chain-of-Experts) or 'doe'
      (Decoupling of Experts: knowledge state, Attention Gating Control, VAE router; ``doe``).
    max_seq_len: longest sequence the model accepts (RoPE tables are built to this length).
    rope_theta: RoPE base (Llama-3: 500000).
    rope_scaling: RoPE frequency scaling (``RopeScalingConfig``; default none, as DAG-MoE).
    norm_eps: epsilon of RMSNorm and of the DAG module's LayerNorm.
    init_std: standard deviation of the normal initialiser of every matrix.
    execution: how the model runs on a machine, not what it computes (``ExecutionConfig``;
      every 'auto' there is settled by :mod:`dagmoe_jax.run.settle` at the run's build).
    param_dtype, compute_dtype: 'float32' or 'bfloat16' (master weights stay float32 by default).
    """

    vocab_size: int = 256
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: Optional[int] = None
    ffn_hidden: Optional[int] = None
    block: str = "moe"
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    experts: ExpertConfig = dataclasses.field(default_factory=ExpertConfig)
    aggregation: AggregationConfig = dataclasses.field(default_factory=AggregationConfig)
    coe: CoEConfig = dataclasses.field(default_factory=CoEConfig)
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    doe: DoEConfig = dataclasses.field(default_factory=DoEConfig)
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig,
                                                   metadata={"execution": True})

    def __post_init__(self):
        c = "ModelConfig"
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "max_seq_len"):
            _positive(c, name, getattr(self, name))
        if self.head_dim is not None:
            _positive(c, "head_dim", self.head_dim)
        else:
            _check(self.d_model % self.num_heads == 0, c, "num_heads", self.num_heads,
                   f"a divisor of d_model={self.d_model} (or set head_dim)")
        _check(self.num_heads % self.num_kv_heads == 0, c, "num_kv_heads", self.num_kv_heads,
               f"a divisor of num_heads={self.num_heads}")
        _check(self.resolved_head_dim % 2 == 0, c, "head_dim", self.resolved_head_dim,
               "an even number (RoPE rotates pairs)")
        if self.ffn_hidden is not None:
            _positive(c, "ffn_hidden", self.ffn_hidden)
        _choice(c, "block", self.block, BLOCK_TYPES)
        _check(self.rope_theta > 0, c, "rope_theta", self.rope_theta, "a number > 0")
        _check(self.norm_eps > 0, c, "norm_eps", self.norm_eps, "a number > 0")
        _check(self.init_std > 0, c, "init_std", self.init_std, "a number > 0")
        _choice(c, "param_dtype", self.param_dtype, DTYPES)
        _choice(c, "compute_dtype", self.compute_dtype, DTYPES)
        for name, cls in nested_configs(ModelConfig).items():
            _check(isinstance(getattr(self, name), cls), c, name, getattr(self, name),
                   f"a {cls.__name__}")
        n = self.experts.num_experts
        if self.block == "moe":
            _check(self.router.top_k <= n, "RouterConfig", "top_k", self.router.top_k,
                   f"an integer in [1, num_experts={n}]")
        if self.block == "coe":
            _check(self.aggregation.kind == "sum", "AggregationConfig", "kind",
                   self.aggregation.kind, "'sum' when block='coe' (CoE sums each iteration)")
            k_t = self.coe_top_k
            _check(k_t >= 1, "CoEConfig", "top_k_per_iter", k_t,
                   f"an integer >= 1 (router.top_k={self.router.top_k} // "
                   f"iterations={self.coe.iterations} is 0; set top_k_per_iter)")
            _check(k_t <= n, "CoEConfig", "top_k_per_iter", k_t,
                   f"an integer in [1, num_experts={n}]")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def resolved_ffn_hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return int(math.ceil(8 * self.d_model / 3 / 128) * 128)

    @property
    def coe_top_k(self) -> int:
        """Experts per CoE iteration (K_t; CoE eq. 7 uses K / C)."""
        if self.coe.top_k_per_iter is not None:
            return self.coe.top_k_per_iter
        return self.router.top_k // self.coe.iterations

    @property
    def unsettled(self) -> tuple:
        """The execution fields still 'auto' (settled by :func:`dagmoe_jax.run.settle.settle`)."""
        return self.execution.unsettled

    def replace(self, **changes) -> "ModelConfig":
        """A copy with fields changed; nested configs accept dicts of their own fields."""
        for name in nested_configs(ModelConfig):
            if isinstance(changes.get(name), dict):
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    @staticmethod
    def migrate(blob: dict, settled: Optional[dict] = None) -> dict:
        """A model config's JSON (``dataclasses.asdict`` of one) as this version writes it: the
        execution fields that runs written before :class:`ExecutionConfig` existed kept at the
        top level moved into it (``fuse_gate_up`` by its name now, ``fuse_projections``), and
        the dispatch values of earlier versions migrated: ``'auto'`` (settled per machine then)
        to what ``settled`` (the same config as that machine settled it) records, else to
        ``'dropless'``, what a CPU settled it to; ``'dense'`` to dropless run as
        ``grouped_matmul='einsum'``."""
        blob = dict(blob)
        legacy = {f.name: blob.pop(f.name) for f in dataclasses.fields(ExecutionConfig)
                  if f.name in blob}
        blob["execution"] = {**legacy, **(blob.get("execution") or {})}
        if "fuse_gate_up" in blob["execution"]:                # its name before it fused q/k/v
            blob["execution"]["fuse_projections"] = blob["execution"].pop("fuse_gate_up")
        experts = dict(blob.get("experts") or {})
        if experts.get("dispatch") in RETIRED_DISPATCH:
            if (experts["dispatch"] == "dense"
                    and blob["execution"].get("grouped_matmul", "auto") == "auto"):
                blob["execution"]["grouped_matmul"] = "einsum"
            was = ((settled or {}).get("experts") or {}).get("dispatch")
            blob["experts"] = {**experts, "dispatch": (
                was if experts["dispatch"] == "auto" and was in DISPATCH_MODES else "dropless")}
        return blob

    @classmethod
    def from_dict(cls, blob: dict, settled: Optional[dict] = None) -> "ModelConfig":
        """The config of a JSON dict (``dataclasses.asdict`` of one, as ``config.json`` and the
        checkpoints' metadata hold it, of this version or an earlier one: :meth:`migrate`, with
        ``settled``): nested configs as dicts, absent fields at their defaults (a run saved
        before the field existed). A key that is no field raises ``TypeError``, as the
        constructor does."""
        blob = cls.migrate(blob, settled)
        for name, nested in nested_configs(cls).items():
            blob[name] = nested(**(blob.get(name) or {}))
        return cls(**blob)


def nested_configs(cls) -> dict:
    """{field name: config class} of a config dataclass's nested configs (found by walking
    ``dataclasses.fields``: each is a field whose default is built by its class)."""
    return {f.name: f.default_factory for f in dataclasses.fields(cls)
            if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory)}


def execution_fields(cls=None) -> tuple:
    """The names of ``cls``'s (default ModelConfig's) fields that hold execution choices
    (field metadata ``{"execution": True}``): a run may resume with them changed."""
    return tuple(f.name for f in dataclasses.fields(cls or ModelConfig)
                 if f.metadata.get("execution"))
