"""Validated model configuration, exposed to gin.

Every dataclass here is frozen and checks itself in ``__post_init__``: an invalid value or an
invalid combination raises ``ValueError`` naming the field and the range it accepts. Defaults
follow the DAG-MoE paper's small model (Table 3, Appendix B.1) unless a comment says otherwise.

gin binds these classes under the same names (``ModelConfig.d_model = 512``,
``ModelConfig.block = 'coe'``, ``RouterConfig.top_k = 8``) through :mod:`dagmoe_jax.run.gin`,
which registers them as external configurables: gin bindings never change what plain Python
construction gives. See ``configs/`` for the paper's models. The block families' configs are
in their families' packages (:mod:`dagmoe_jax.config.families`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from dagmoe_jax.config.blocks import (DISPATCH_MODES, RETIRED_DISPATCH, default_ffn_hidden,
                                      experts_of, nested_configs)
from dagmoe_jax.config.execution import ExecutionConfig
from dagmoe_jax.config.families import KINDS, all_families, family_of
from dagmoe_jax.validate import check as _check, choice as _choice, positive as _positive

DTYPES = ("float32", "bfloat16")
ROPE_SCALINGS = ("none", "llama3", "linear", "yarn")
# RMSNorm of the queries and keys before RoPE (ModelConfig.qk_norm).
QK_NORMS = ("none", "head", "full")
# A ModelConfig.block: the config of one block family (dagmoe_jax.config.families), a frozen
# dataclass registered there; the kinds, in the order ModelConfig.block lists them.
BlockConfig = Any
BLOCK_TYPES = KINDS
# The fields each block family held at the top level of a ModelConfig before ModelConfig.block
# held the family's config (ModelConfig.migrate moves them).
_LEGACY_BLOCK_FIELDS = ("router", "experts", "aggregation", "coe", "doe", "ffn_hidden")
# The keys of the execution choices a model config held before they moved beside the mesh.
_SAVED_EXECUTION_KEYS = ("execution", "fuse_gate_up",
                         *(f.name for f in dataclasses.fields(ExecutionConfig)))


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """RoPE frequency scaling for long contexts (Hugging Face ``rope_scaling``).

    kind: 'none' (default: plain RoPE, theta^(-2i/D)), 'llama3' (Llama 3.1/3.2: wavelengths
      longer than original_max_position / low_freq_factor are divided by ``factor``, shorter than
      original_max_position / high_freq_factor kept, the band between interpolated smoothly;
      :func:`dagmoe_jax.model.attention.llama3_inv_freq`), 'linear' (position interpolation:
      every frequency divided by ``factor``, Hugging Face's ``rope_type='linear'``) or 'yarn'
      (YaRN, as DeepSeek-V2-Lite/V3 and long-context Qwen3 checkpoints carry it: frequencies
      that turn fewer than ``beta_slow`` times over ``original_max_position`` divided by
      ``factor``, more than ``beta_fast`` times kept, a linear ramp between, and sin and cos
      scaled by the attention factor; :func:`dagmoe_jax.model.attention.yarn_inv_freq`).
    factor, low_freq_factor, high_freq_factor, original_max_position: the 'llama3' parameters
      (defaults: Llama 3.1's 8, 1, 4, 8192; 'linear' reads ``factor`` only, 'yarn'
      ``factor`` and ``original_max_position``); ignored for 'none'.
    beta_fast, beta_slow: YaRN's ramp bounds in rotations over ``original_max_position``
      (default 32 and 1, the paper's and Hugging Face's).
    mscale, mscale_all_dim: YaRN's attention factor is (0.1 mscale ln s + 1) / (0.1
      mscale_all_dim ln s + 1) with s = ``factor`` where both are set (> 0; DeepSeek's
      checkpoints set them), else 0.1 ln s + 1 (default 0 and 0: not set).
    attention_factor: the factor itself where a checkpoint states it (default 0: derived as
      above).
    truncate: round YaRN's ramp bounds to whole dimensions (default True, Hugging Face's;
      gpt-oss sets False).
    """

    kind: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0
    truncate: bool = True

    def __post_init__(self):
        c = "RopeScalingConfig"
        _choice(c, "kind", self.kind, ROPE_SCALINGS)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check(isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0, c,
                   name, getattr(self, name), "a number > 0")
        _check(self.high_freq_factor > self.low_freq_factor, c, "high_freq_factor",
               self.high_freq_factor, f"a number > low_freq_factor={self.low_freq_factor}")
        _positive(c, "original_max_position", self.original_max_position)
        for name in ("beta_fast", "beta_slow"):
            _check(isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0, c,
                   name, getattr(self, name), "a number > 0")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            _check(isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0, c,
                   name, getattr(self, name), "a number >= 0 (0: not set)")
        _check(isinstance(self.truncate, bool), c, "truncate", self.truncate, "True or False")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1; V3 keeps it) in place of grouped-query
    attention: keys and values of all heads come from one compressed latent per token, which is
    all a decoding cache holds, beside one small key carrying RoPE shared by the heads.

    kv_lora_rank: d_c, the latent's width (DeepSeek-V2/V3: 512). 0 (default): no MLA, the
      model's attention is grouped-query attention (``num_kv_heads``, ``head_dim``).
    q_lora_rank: d_c', the queries' own low-rank compression (V2 and V3: 1536); 0 (default,
      V2-Lite): queries are one projection of the hidden state.
    qk_nope_head_dim, qk_rope_head_dim: each head's query and key width without and with RoPE
      (d_h and d_h^R: 128 and 64); scores are scaled by (d_h + d_h^R)^(-1/2), times mscale^2 of
      a YaRN ``rope_scaling`` with ``mscale_all_dim`` (DeepSeek's).
    v_head_dim: each head's value width (128).
    With MLA, ``num_kv_heads``, ``head_dim`` and ``qk_norm`` play no part (``qk_norm`` must be
    'none'); RoPE turns ``qk_rope_head_dim`` dimensions. The latents' RMSNorms take epsilon
    1e-6 whatever ``norm_eps`` is, as DeepSeek's code and transformers' do.
    """

    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self):
        c = "MLAConfig"
        for name in ("kv_lora_rank", "q_lora_rank"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0, c, name,
                   getattr(self, name), "an integer >= 0 (0: none)")
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(c, name, getattr(self, name))
        _check(self.qk_rope_head_dim % 2 == 0, c, "qk_rope_head_dim", self.qk_rope_head_dim,
               "an even number (RoPE rotates pairs)")

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3 sec. 2.2, eq. 21-25): ``depth`` D sequential
    modules after the model, module k predicting the token k + 1 ahead from module k - 1's
    hidden state and the embedding of the token k ahead, each one layer of the model's block
    family; they share the embedding and the LM head, train with the model and are dropped at
    inference (generation and scoring never run them).

    depth: D (DeepSeek-V3: 1, its ``num_nextn_predict_layers``); 0 (default): none.
    loss_weight: lambda of L_MTP = lambda / D sum_k L_MTP^k (eq. 25; V3: 0.3 for its first 10T
      tokens, 0.1 after), added to the loss.
    """

    depth: int = 0
    loss_weight: float = 0.3

    def __post_init__(self):
        _check(isinstance(self.depth, int) and self.depth >= 0, "MTPConfig", "depth",
               self.depth, "an integer >= 0 (0: none)")
        _check(isinstance(self.loss_weight, (int, float)) and self.loss_weight >= 0,
               "MTPConfig", "loss_weight", self.loss_weight, "a number >= 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-3 style decoder (DAG-MoE Appendix B.1) with a choice of FFN block: what is
    computed. How it runs on a machine is an ``ExecutionConfig`` beside the mesh
    (``RunConfig.execution``), not a field here.

    vocab_size: embedding and LM-head rows (256 = bytes; the paper used Llama-3's 128,256).
    d_model, num_layers, num_heads, num_kv_heads: Table 3 (s: 512, 4, 32, 8).
    head_dim: None means d_model // num_heads.
    block: the FFN block's family and its config (:mod:`dagmoe_jax.config.families`):
      ``DenseConfig`` (one SwiGLU), ``MoEConfig`` (router + experts + aggregation: sum, DAG or
      MLP; the default, with the paper's small model's router and experts), ``CoEConfig``
      (Chain-of-Experts) or ``DoEConfig`` (Decoupling of Experts). A family's name ('dense',
      'moe', 'coe', 'doe') stands for its config at its defaults (how gin selects one).
    max_seq_len: longest sequence the model accepts (RoPE tables are built to this length).
    rope_theta: RoPE base (Llama-3: 500000).
    rope_scaling: RoPE frequency scaling (``RopeScalingConfig``; default none, as DAG-MoE).
    qk_norm: RMSNorm of the queries and keys before RoPE, with learned scales: 'none' (default,
      Llama, DAG-MoE), 'head' (each head over its head_dim, one scale shared by the heads:
      Qwen3 / Qwen3-MoE) or 'full' (over all heads' concatenated projection, one scale per
      channel: OLMoE). What imported checkpoints need (:mod:`dagmoe_jax.hf.moe`).
    mla: multi-head latent attention in place of grouped-query attention (``MLAConfig``;
      default off: ``kv_lora_rank`` 0), under every block family but DoE's.
    first_dense_layers: the first layers' block is a dense SwiGLU instead of ``block``
      (DeepSeek-V2/V3's ``first_k_dense_replace``: 1 in V2-Lite, 3 in V3); default 0. The
      others, ``routed_layers`` of them, have the family's block; the MoE and CoE families
      only.
    first_dense_ffn_hidden: those dense layers' hidden size (DeepSeek's ``intermediate_size``);
      None means 8/3 d_model rounded up to 128.
    mtp: multi-token prediction modules trained beside the model (``MTPConfig``; default
      none), under every block family but DoE's.
    norm_eps: epsilon of RMSNorm and of the DAG module's LayerNorm.
    init_std: standard deviation of the normal initialiser of every matrix.
    param_dtype, compute_dtype: 'float32' or 'bfloat16' (master weights stay float32 by default).
      param_dtype is every matrix's (embedding, attention, experts, dense and shared FFNs,
      the DAG and MLP aggregators, DoE's); norm scales and the router stay float32.
    """

    vocab_size: int = 256
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: Optional[int] = None
    block: BlockConfig = dataclasses.field(default_factory=lambda: family_of("moe").config(),
                                           metadata={"family": True})
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    qk_norm: str = "none"
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    first_dense_layers: int = 0
    first_dense_ffn_hidden: Optional[int] = None
    mtp: MTPConfig = dataclasses.field(default_factory=MTPConfig)

    def __post_init__(self):
        c = "ModelConfig"
        if isinstance(self.block, str):                 # a family's name: its defaults
            _choice(c, "block", self.block, BLOCK_TYPES)
            object.__setattr__(self, "block", family_of(self.block).config())
        configs = tuple(family.config for family in all_families().values())
        _check(isinstance(self.block, configs), c, "block", self.block,
               "a block family's config (" + ", ".join(
                   cls.__name__ for cls in configs) + ") or its name")
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
        _check(self.rope_theta > 0, c, "rope_theta", self.rope_theta, "a number > 0")
        _check(self.norm_eps > 0, c, "norm_eps", self.norm_eps, "a number > 0")
        _check(self.init_std > 0, c, "init_std", self.init_std, "a number > 0")
        _choice(c, "param_dtype", self.param_dtype, DTYPES)
        _choice(c, "compute_dtype", self.compute_dtype, DTYPES)
        _choice(c, "qk_norm", self.qk_norm, QK_NORMS)
        for name, cls in nested_configs(ModelConfig).items():
            if name != "block":
                _check(isinstance(getattr(self, name), cls), c, name, getattr(self, name),
                       f"a {cls.__name__}")
        _check(isinstance(self.first_dense_layers, int)
               and 0 <= self.first_dense_layers < self.num_layers, c, "first_dense_layers",
               self.first_dense_layers, f"an integer in [0, num_layers={self.num_layers})")
        if self.first_dense_ffn_hidden is not None:
            _positive(c, "first_dense_ffn_hidden", self.first_dense_ffn_hidden)
        if self.first_dense_layers:
            _check(experts_of(self.block) is not None
                   and not getattr(self.block, "inputs_per_layer", False), c,
                   "first_dense_layers", self.first_dense_layers,
                   f"0 with block={self.block.kind!r} (dense layers come before the routed "
                   f"layers of the MoE and CoE families)")
        if self.mtp.depth:
            _check(not getattr(self.block, "inputs_per_layer", False), c, "mtp",
                   f"depth={self.mtp.depth}", f"depth 0 with block={self.block.kind!r} (its "
                   f"layers take per-layer inputs of the family's shared module)")
        if self.mla.enabled:
            _check(self.qk_norm == "none", c, "qk_norm", self.qk_norm,
                   "'none' with MLAConfig.kv_lora_rank > 0 (MLA normalises its latents)")
            _check(not getattr(self.block, "routes_on_attention_heads", False), c, "block",
                   self.block.kind, "a family that does not route on grouped-query heads "
                   "with MLA (DoE's signal reads them)")

    @property
    def routed_layers(self) -> int:
        """The layers with the family's block: all but the ``first_dense_layers``."""
        return self.num_layers - self.first_dense_layers

    def first_dense_config(self) -> Optional["ModelConfig"]:
        """The config of the ``first_dense_layers`` (their block a ``DenseConfig`` of
        ``first_dense_ffn_hidden``), or None without them."""
        if not self.first_dense_layers:
            return None
        return dataclasses.replace(
            self, block=family_of("dense").config(ffn_hidden=self.first_dense_ffn_hidden),
            num_layers=self.first_dense_layers, first_dense_layers=0)

    @property
    def attention_head_dim(self) -> int:
        """The head width the attention kernel sees: MLA's keys or values, whichever is wider
        (the other zero-padded to it), else the head's."""
        if self.mla.enabled:
            return max(self.mla.qk_head_dim, self.mla.v_head_dim)
        return self.resolved_head_dim

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE turns per head: MLA's ``qk_rope_head_dim``, else the head's."""
        return self.mla.qk_rope_head_dim if self.mla.enabled else self.resolved_head_dim

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def resolved_ffn_hidden(self) -> int:
        """The dense FFN width: a dense block's ``ffn_hidden``, a DoE block's output FFN's, else
        Llama's 8/3 d_model rounded up to 128."""
        return getattr(self.block, "ffn_hidden", None) or default_ffn_hidden(self.d_model)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with fields changed. A nested config (``block`` included) accepts a dict of
        the fields to change in it, at any depth (``block={"router": {"top_k": 2}}``), and
        ``block`` a family's name (its defaults) or config."""
        return _replace(self, changes)

    @staticmethod
    def migrate(blob: dict, settled: Optional[dict] = None) -> dict:
        """A model config's JSON (``dataclasses.asdict`` of one) as this version writes it:

        * without the execution choices earlier versions kept in it (at the top level, then in
          ``execution``): they sit beside the mesh now (:meth:`saved_execution` reads them);
        * the block family's fields, which every config held at the top level before
          ``block`` held the family's config (``block: 'moe'`` beside ``router``,
          ``experts``, ``aggregation``, ``coe``, ``doe`` and ``ffn_hidden``), moved into it,
          the other families' dropped;
        * the dispatch values of earlier versions: ``'auto'`` (settled per machine then) to
          what ``settled`` (the same config as that machine settled it) records, else to
          ``'dropless'``, what a CPU settled it to; ``'dense'`` to ``'dropless'`` (run as
          ``grouped_matmul='einsum'``: :meth:`saved_execution`).
        """
        blob = {k: v for k, v in blob.items() if k not in _SAVED_EXECUTION_KEYS}
        if isinstance(blob.get("block", "moe"), str):
            blob["block"] = _legacy_block(blob)
            for name in _LEGACY_BLOCK_FIELDS:
                blob.pop(name, None)
        experts = dict(blob["block"].get("experts") or {})
        if experts.get("dispatch") in RETIRED_DISPATCH:
            was = ((ModelConfig.migrate(settled)["block"] if settled else {}).get("experts")
                   or {}).get("dispatch")
            blob["block"] = {**blob["block"], "experts": {**experts, "dispatch": (
                was if experts["dispatch"] == "auto" and was in DISPATCH_MODES else "dropless")}}
        return blob

    @staticmethod
    def saved_execution(blob: dict) -> dict:
        """The execution choices (``ExecutionConfig`` fields) a model config's JSON of an
        earlier version holds: at its top level (before ``ExecutionConfig`` existed), in its
        ``execution`` (before it moved beside the mesh), ``fuse_gate_up`` by its name now
        (``fuse_projections``), and ``grouped_matmul='einsum'`` for the retired ``'dense'``
        dispatch (every expert on every token). Empty for this version's configs."""
        saved = {k: blob[k] for k in _SAVED_EXECUTION_KEYS if k in blob and k != "execution"}
        saved.update(blob.get("execution") or {})
        if "fuse_gate_up" in saved:                          # its name before it fused q/k/v
            saved["fuse_projections"] = saved.pop("fuse_gate_up")
        block = blob.get("block")
        experts = (block.get("experts") if isinstance(block, dict) else blob.get("experts")) or {}
        if experts.get("dispatch") == "dense" and saved.get("grouped_matmul", "auto") == "auto":
            saved["grouped_matmul"] = "einsum"
        return saved

    @classmethod
    def from_dict(cls, blob: dict, settled: Optional[dict] = None) -> "ModelConfig":
        """The config of a JSON dict (``dataclasses.asdict`` of one, as ``config.json`` and the
        checkpoints' metadata hold it, of this version or an earlier one: :meth:`migrate`, with
        ``settled``): nested configs as dicts, the block's family by its ``kind``, absent
        fields at their defaults (a run saved before the field existed). A key that is no
        field raises ``TypeError``, as the constructor does."""
        blob = cls.migrate(blob, settled)
        block = dict(blob["block"])
        kind = block.pop("kind", "moe")
        _choice("ModelConfig", "block", kind, BLOCK_TYPES)
        blob["block"] = _build(family_of(kind).config, block)
        return _build(cls, blob)


def _legacy_block(blob: dict) -> dict:
    """The ``block`` of a config saved while the block families' fields sat at the top level
    (the family's name in ``block``; :meth:`ModelConfig.migrate`)."""
    kind = blob.get("block", "moe")
    if kind not in KINDS:                   # the family check that follows names the choices
        return {"kind": kind}
    return {"kind": kind, **family_of(kind).config.from_legacy(blob)}


def _build(cls, blob: dict):
    """``cls`` from a JSON dict whose nested configs are dicts (or already configs); the fields
    no constructor takes (a family config's ``kind``) are left out."""
    blob = {k: v for k, v in blob.items()
            if not any(f.name == k and not f.init for f in dataclasses.fields(cls))}
    for name, nested in nested_configs(cls).items():
        if isinstance(blob.get(name), dict) or name not in blob:
            blob[name] = _build(nested, blob.get(name) or {})
    return cls(**blob)


def _replace(config, changes: dict):
    """``dataclasses.replace`` that takes a dict for a nested config (the fields to change in
    it); a family's name for ``block`` is the constructor's to read."""
    changes = dict(changes)
    for name, value in changes.items():
        current = getattr(config, name, None)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            changes[name] = _replace(current, value)
    return dataclasses.replace(config, **changes)
