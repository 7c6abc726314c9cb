"""What the block families' configs share: the router's and the experts' configs (MoE and
CoE route with them), and the questions any layer may ask of a family config without naming
its family (:func:`experts_of`, :func:`router_of`, :func:`aggregation_of`).

``ModelConfig.block`` holds one family's config, each in its family's package
(``dagmoe_jax.families.<kind>.config``, registered in :mod:`dagmoe_jax.config.families`) and
holding only its own fields:

* ``DenseConfig``: one SwiGLU (Llama's FFN);
* ``MoEConfig``: a router, routed (and shared) experts and the aggregation of their outputs
  (``AggregationConfig``: the sum of eq. 1, DAG-MoE's DAG module, or an MLP);
* ``CoEConfig``: Chain-of-Experts, a router and experts iterated;
* ``DoEConfig``: Decoupling of Experts.

Every family config has a ``kind`` (its name in ``BLOCK_TYPES``, not an argument), which its
JSON carries so that ``ModelConfig.from_dict`` knows which family a saved config is; a
``label`` (its name in progress lines: 'DAG-MoE', 'CoE', ...) and a ``describe()`` (its shape
in a few words).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from dagmoe_jax.validate import (check as _check, choice as _choice, nonnegative as _nonnegative,
                                 positive as _positive)

SCORE_FNS = ("sigmoid", "softmax")
DISPATCH_MODES = ("dropless", "capacity")
BALANCE_LOADS = ("tokens", "slots")
BALANCE_PROBS = ("softmax", "score_share")
BALANCE_SCOPES = ("batch", "sequence")
GROUP_SCORES = ("max", "top2_sum")
# RouterConfig fields that say how a router is trained, not what it computes (the selection
# bias of aux_free_bias_rate starts at zero): a run fine-tuned from another may set its own.
ROUTER_TRAINING_FIELDS = ("balance_coef", "balance_load", "balance_prob", "balance_scope",
                          "z_loss_coef", "aux_free_bias_rate")
# What ExpertConfig.dispatch values of earlier versions became (ModelConfig.from_dict migrates).
RETIRED_DISPATCH = {
    "auto": "whether experts drop tokens is architecture, the same on every machine: write "
            "ExpertConfig.dispatch='dropless' (exact, the default) or 'capacity'",
    "dense": "every expert on every token is now how dropless dispatch runs: write "
             "ExpertConfig.dispatch='dropless' and ExecutionConfig.grouped_matmul='einsum'"}


def default_ffn_hidden(d_model: int) -> int:
    """Llama's FFN width for ``d_model``: 8/3 d rounded up to a multiple of 128."""
    return -(-8 * d_model // (3 * 128)) * 128


def block_summary(block) -> str:
    """A block family config in a few words for progress lines: ``block=moe aggregation=dag``."""
    aggregation = aggregation_of(block)
    return f"block={block.kind}" + (f" aggregation={aggregation.kind}" if aggregation else "")


def experts_of(block) -> Optional["ExpertConfig"]:
    """The routed experts' config of a family that routes tokens to experts (MoE, CoE), else
    None (dense, DoE)."""
    return getattr(block, "experts", None)


def router_of(block) -> Optional["RouterConfig"]:
    """The router's config of a family that routes (MoE, CoE: its losses' coefficients, top-k),
    else None (dense, DoE)."""
    return getattr(block, "router", None)


def routing_steps(block) -> int:
    """How many times a layer of the family routes each token: CoE's iterations C, 1 for a
    family that routes once (MoE), 0 for one without a router (dense, DoE)."""
    return getattr(block, "iterations", 1) if router_of(block) is not None else 0


def aggregation_of(block) -> Optional["AggregationConfig"]:
    """How the routed experts' outputs are combined (sum, DAG, MLP) in the family that
    aggregates (MoE), else None (dense, DoE, and CoE, whose chain sums)."""
    return getattr(block, "aggregation", None)


def dag_aggregation_of(block) -> Optional["AggregationConfig"]:
    """The aggregation config when the family aggregates its experts with the DAG module
    (DAG-MoE eq. 6-12), else None."""
    agg = aggregation_of(block)
    return agg if agg is not None and agg.kind == "dag" else None


def nested_configs(cls) -> dict:
    """{field name: config class} of a config dataclass's nested configs (found by walking
    ``dataclasses.fields``: each is a field whose default is built by its class, or, marked
    ``metadata={'family': True}``, by a block family found in the registry)."""
    nested = {}
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if f.metadata.get("family"):        # ModelConfig.block: the default family's config
            factory = type(factory())
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            nested[f.name] = factory
    return nested


def check_nested(config) -> None:
    """Check that each nested config field of ``config`` holds an instance of its class."""
    name = type(config).__name__
    for field, cls in nested_configs(type(config)).items():
        _check(isinstance(getattr(config, field), cls), name, field, getattr(config, field),
               f"a {cls.__name__}")


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
    balance_scope: over which tokens f_i and P_i are counted. 'batch' (default): all T tokens
      of the call (the batch, or a micro-batch under gradient accumulation). 'sequence': within
      each row of the batch, the loss averaged over rows: DeepSeek-V2's expert-level balance
      loss (sec. 2.2.3, T "the number of tokens in a sequence"), DeepSeek-V3's complementary
      sequence-wise balance loss (eq. 17-20) and the ``seq_aux=True`` branch of DeepSeek's
      ``MoEGate`` that the CoE authors train with; theirs is balance_load='slots' with softmax
      scores (DeepSeek-V3's sigmoid router: balance_prob='score_share'). A row of packed
      examples is one sequence, as in their pre-training.
    z_loss_coef: router z-loss coefficient (paper: 0.001).
    aux_free_bias_rate: auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2, eq. 16; Wang et
      al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"): > 0 gives
      each router a per-expert bias b_i added to the scores for the top-K selection only (the
      gates are the unbiased scores), and after each optimizer step the training step moves it
      by ``b_i += rate * sign(mean_j c_j - c_i)``, c_i the step's assignments to expert i. The
      rate is DeepSeek-V3's bias update speed gamma (0.001 for most of its training). 0
      (default): no bias, the router as before.
    bias: give the router a learned bias, logits ``x W + b`` (DUME sec. 2.2, where the ridge
      solution's last row is the bias; off by default: DAG-MoE's router has none).
    temperature: T of ``logits / T`` before the score function (DUME sec. 2.2; 1 = none).
      DUME's gate softmax(top-k(logits / T)) is score_fn='softmax' with renormalize=True.
    n_group, topk_group: group-limited selection (DeepSeek-V2 sec. 2.2.2, device-limited
      routing; DeepSeek-V3 sec. 2.1.2, node-limited routing; Hugging Face's ``n_group`` and
      ``topk_group``): the N experts form ``n_group`` groups of consecutive ids, each token
      keeps the ``topk_group`` groups of highest group score and takes its top-K among their
      experts (:func:`dagmoe_jax.model.routed.router.group_limited_top_k`). Default 1 and 1: no
      groups.
    group_score: a group's score, 'max' (default; DeepSeek-V2's group-limited greedy: its
      highest expert score) or 'top2_sum' (DeepSeek-V3: the sum of its two highest scores,
      with the selection bias, K / topk_group = 8 / 4 in V3).
    routed_scaling_factor: the gates are multiplied by it after renormalisation (DeepSeek-V2
      and V3's ``routed_scaling_factor``, e.g. 2.5 in V3; default 1).
    """

    score_fn: str = "sigmoid"
    top_k: int = 4
    renormalize: bool = False
    balance_coef: float = 0.01
    balance_load: str = "tokens"
    balance_prob: str = "softmax"
    balance_scope: str = "batch"
    z_loss_coef: float = 0.001
    aux_free_bias_rate: float = 0.0
    bias: bool = False
    temperature: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        _choice("RouterConfig", "score_fn", self.score_fn, SCORE_FNS)
        _positive("RouterConfig", "n_group", self.n_group)
        _check(isinstance(self.topk_group, int) and 1 <= self.topk_group <= self.n_group,
               "RouterConfig", "topk_group", self.topk_group,
               f"an integer in [1, n_group={self.n_group}]")
        _choice("RouterConfig", "group_score", self.group_score, GROUP_SCORES)
        _check(isinstance(self.routed_scaling_factor, (int, float))
               and self.routed_scaling_factor > 0, "RouterConfig", "routed_scaling_factor",
               self.routed_scaling_factor, "a number > 0")
        _choice("RouterConfig", "balance_load", self.balance_load, BALANCE_LOADS)
        _choice("RouterConfig", "balance_prob", self.balance_prob, BALANCE_PROBS)
        _choice("RouterConfig", "balance_scope", self.balance_scope, BALANCE_SCOPES)
        _positive("RouterConfig", "top_k", self.top_k)
        _nonnegative("RouterConfig", "balance_coef", self.balance_coef)
        _nonnegative("RouterConfig", "z_loss_coef", self.z_loss_coef)
        _nonnegative("RouterConfig", "aux_free_bias_rate", self.aux_free_bias_rate)
        _check(isinstance(self.bias, bool), "RouterConfig", "bias", self.bias, "True or False")
        _check(isinstance(self.temperature, (int, float)) and self.temperature > 0,
               "RouterConfig", "temperature", self.temperature, "a number > 0")


def check_groups(router: "RouterConfig", num_experts: int, top_k: int) -> None:
    """One-line ValueError unless ``router``'s groups fit ``num_experts`` experts and ``top_k``
    choices of them (a block config's check: the router config alone knows neither)."""
    g = router.n_group
    if g == 1:
        return
    _check(num_experts % g == 0, "RouterConfig", "n_group", g,
           f"a divisor of num_experts={num_experts} (groups of equal size)")
    _check(top_k <= router.topk_group * (num_experts // g), "RouterConfig", "topk_group",
           router.topk_group, f"enough groups for top_k={top_k}: topk_group * num_experts / "
           f"n_group >= {top_k}")
    _check(router.group_score != "top2_sum" or num_experts // g >= 2, "RouterConfig",
           "group_score", router.group_score, "'max' for groups of one expert")


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    """Routed and shared experts and how tokens reach them (docs/design.md section 3).

    num_experts: routed experts N (paper s: 32, or 64 fine-grained).
    expert_hidden: SwiGLU hidden size d_r of each routed expert (paper s: 256).
    num_shared: shared experts applied to every token (0 = none; the paper's parity baseline
      uses 1).
    shared_hidden: hidden size of each shared expert.
    dispatch: whether experts drop tokens, part of the architecture (saved, the same on every
      machine): 'dropless' (default: every assignment computed; exact) or 'capacity' (C slots
      per expert, the overflow dropped; einsum over [N, C, d]). How 'dropless' runs on a
      machine is ``ExecutionConfig.grouped_matmul``.
    capacity_factor: C = ceil(capacity_factor * T * K / N) slots per expert for 'capacity'.
    exchange_buffer: with 'dropless' dispatch across E expert shards, how many routed rows each
      shard may receive, as a factor f of the balanced share: B = ceil(f * T_loc * K) rows (T_loc
      tokens a device, K per token; MaxText's ``ragged_buffer_factor``). None (default): the
      worst case E * T_loc * K, so nothing drops. A factor bounds the exchange's buffers and
      sorts (their size grows with E otherwise); the rows that overflow a shard's buffer are
      dropped by a fixed rule: each shard keeps the first B rows in the order (sending device
      along the expert axis, local expert, the sender's token order), the rest compute nothing
      (output 0, ``keep`` False) and count in ``dropped_fraction``. With one expert shard (no
      expert axis, one device) f >= 1 never drops. A factor >= E is today's dropless dispatch
      exactly. At least 1.
    """

    num_experts: int = 32
    expert_hidden: int = 256
    num_shared: int = 0
    shared_hidden: int = 256
    dispatch: str = "dropless"
    capacity_factor: float = 1.25
    exchange_buffer: Optional[float] = None

    def __post_init__(self):
        _positive("ExpertConfig", "num_experts", self.num_experts)
        _positive("ExpertConfig", "expert_hidden", self.expert_hidden)
        _check(isinstance(self.num_shared, int) and self.num_shared >= 0, "ExpertConfig",
               "num_shared", self.num_shared, "an integer >= 0")
        _positive("ExpertConfig", "shared_hidden", self.shared_hidden)
        if self.dispatch in RETIRED_DISPATCH:
            raise ValueError(f"ExpertConfig.dispatch={self.dispatch!r} is no longer a choice: "
                             f"{RETIRED_DISPATCH[self.dispatch]}")
        _choice("ExpertConfig", "dispatch", self.dispatch, DISPATCH_MODES)
        _check(isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0,
               "ExpertConfig", "capacity_factor", self.capacity_factor, "a number > 0")
        if self.exchange_buffer is not None:
            _check(isinstance(self.exchange_buffer, (int, float))
                   and not isinstance(self.exchange_buffer, bool) and self.exchange_buffer >= 1,
                   "ExpertConfig", "exchange_buffer", self.exchange_buffer,
                   "None (the worst case: dropless) or a number >= 1")
            _check(self.dispatch == "dropless", "ExpertConfig", "exchange_buffer",
                   self.exchange_buffer, "None with dispatch='capacity' (its capacity_factor "
                   "bounds each expert's slots)")
