"""Validated configuration of Decoupling of Experts (docs/design.md section 6): the DoE block
(``DoEConfig``, the family config ``ModelConfig.block`` holds) and Stage 1's LDA
(``TopicConfig``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from dagmoe_jax.config.families import register
from dagmoe_jax.validate import check as _check
from dagmoe_jax.validate import choice as _choice
from dagmoe_jax.validate import nonnegative as _nonnegative
from dagmoe_jax.validate import positive as _positive

DOE_GATES = ("relu", "softmax")
DOE_SIGNALS = ("v", "k", "q")
DOE_VAE_SHARING = ("hierarchical", "per_layer")
DOE_EXPERTS = ("composed", "blocks")
DOE_KNOWLEDGE_SCALES = ("d_model", "topic_dim", "head_dim")
DOE_FIRST_INPUTS = ("topic_id", "theta")


@register(__package__)
@dataclasses.dataclass(frozen=True)
class DoEConfig:
    """Decoupling-of-Experts block (docs/design.md section 6; DoE sec. 3, Appendix A).

    num_topics: K, the LDA topics = knowledge fields = rows of the knowledge state Z (paper:
      128). Topic id K is the null id (tokens before any complete word; its own embedding).
    topic_dim: d_k of the topic embedding E_know [K + 1, d_k] of Algorithm 1 (paper: not given);
      E_know is initialised like the token embedding (normal, init_std).
    vae_hidden: hidden width of the VAE encoder (mu_phi, sigma_phi of eq. 5 share one SiLU
      hidden layer; paper: "neural networks", no size given).
    latent_dim: size of the VAE latent z (eq. 5-6; paper: not given).
    gate: 'relu' (G = ReLU(W_g z + b), the paper's choice, Table 3 C) or 'softmax' (the
      VAE-softmax ablation, Table 3 B). No top-k and no balance loss either way.
    signal: the attention tensor whose causal running mean the router sees (Appendix B.1, H.1):
      'v' (the paper's choice, Table 10), 'k' or 'q' (the ablations). K and Q are taken after
      RoPE, as attention uses them; 'q' cannot be decoded incrementally (a KV cache holds no
      queries) and is for training / scoring only.
    vae_sharing: 'hierarchical' (sec. 3.3: the first layer's VAE, one VAE shared by the middle
      layers, the last layer's VAE) or 'per_layer' (every layer its own VAE; ablation).
    alpha: weight of L_expert in (1 - alpha) L_ntp + alpha L_expert (eq. 4; paper: 0.001).
    kl_coef: weight of the VAE's KL(q(z|h) || N(0, I)) (eq. 7), added to the loss (default 0:
      the paper's 2-component loss, Appendix H.3); logged either way, with the mean log sigma
      of the posterior (``vae_log_sigma``: without the KL term the noise can shrink to the clip).
    recon_coef: weight of the VAE's reconstruction loss (eq. 7; the 3-component loss of
      Appendix H.3, which did not help in the paper); computed only when > 0.
    use_topics: False is the no-LDA ablation (Appendix E, "end to end"): the model ignores topic
      ids (every token gets the null id) and alpha must be 0 (there are no labels).
    ffn_hidden: hidden size of the block's output FFN([H_enriched ; e_context]) (input 2d);
      None means Llama's 8/3 d_model rounded up to 128 (``ModelConfig.resolved_ffn_hidden``).
    expert: what an expert is (docs/design.md section 6). 'composed' (default): e = G^T Z
      (Appendix A.1) fed with H_enriched into one dense FFN, every weight active. 'blocks': each
      knowledge block owns an FFN slice (SwiGLU d -> block_hidden -> d) whose output is scaled
      by its gate, out = sum_k G_k FFN_k(H_enriched) over the active blocks only (Top-N, zero
      gates skipped): sec. 4.5's active parameters, Table 13's Top-N, Appendix I.3's isolation.
    top_n: with expert='blocks', the most blocks a token runs (its N largest gates; 0 = all K).
    block_hidden: with expert='blocks', the hidden width of one block's FFN slice; None means
      (ffn_hidden or its default) // num_topics.
    knowledge_scale: the sqrt(d_k) of eq. 2: 'd_model' (default; the width of Q and Z),
      'topic_dim' (Algorithm 1's d_k, the topic embedding's width) or 'head_dim'.
    shared_knowledge: False (default): every layer its own knowledge state Z; True: one Z
      shared by every layer (sec. 3.4's "global memory of all topics" read across depth).
    first_input: the topic term of the first layer's VAE input (sec. 3.3: "conditioned on the
      static LDA topic priors"). 'topic_id' (default): the embedding of the token's one causal
      topic id, E_know[id_t] (Algorithm 1's H_know). 'theta': the causal topic distribution
      theta(<t)^T E_know, theta(<t) the running distribution over the K + 1 ids (null included)
      of the topic ids at positions j <= t
      (:func:`dagmoe_jax.families.doe.block.causal_topic_mixture`). Every id_j is computed from the
      text strictly before token j, so this is the topic distribution of the text before t; leaving
      id_t out would drop the latest complete word (the default's whole signal) and leave position 0
      with no distribution. The dual-input embedding keeps the id either way. The text leans to
      'theta' (Stage 1's document-level theta_i is otherwise unused, and "priors ... to select the
      initial set of relevant topics" is a distribution, not an id; docs/design.md section 6); the
      default stays the ids Algorithm 1 spells out. Needs use_topics=True (with no topics theta is
      the null id's one-hot, the default's input).
    """

    # No Hugging Face family holds this block (a class attribute, not a field).
    hf_family = None
    # Class attributes the model config asks: DoE's signal reads each grouped-query head's
    # queries, keys or values (so no multi-head latent attention beneath it), and its shared
    # module gives every layer inputs of its own (so no dense layers before its own).
    routes_on_attention_heads = True
    inputs_per_layer = True
    kind: str = dataclasses.field(default="doe", init=False)
    num_topics: int = 128
    topic_dim: int = 64
    vae_hidden: int = 256
    latent_dim: int = 64
    gate: str = "relu"
    signal: str = "v"
    vae_sharing: str = "hierarchical"
    alpha: float = 0.001
    kl_coef: float = 0.0
    recon_coef: float = 0.0
    use_topics: bool = True
    ffn_hidden: Optional[int] = None
    expert: str = "composed"
    top_n: int = 0
    block_hidden: Optional[int] = None
    knowledge_scale: str = "d_model"
    shared_knowledge: bool = False
    first_input: str = "topic_id"

    def __post_init__(self):
        c = "DoEConfig"
        for name in ("num_topics", "topic_dim", "vae_hidden", "latent_dim"):
            _positive(c, name, getattr(self, name))
        _choice(c, "gate", self.gate, DOE_GATES)
        _choice(c, "signal", self.signal, DOE_SIGNALS)
        _choice(c, "vae_sharing", self.vae_sharing, DOE_VAE_SHARING)
        _check(isinstance(self.alpha, (int, float)) and 0 <= self.alpha < 1, c, "alpha",
               self.alpha, "a number in [0, 1)")
        _nonnegative(c, "kl_coef", self.kl_coef)
        _nonnegative(c, "recon_coef", self.recon_coef)
        _check(isinstance(self.use_topics, bool), c, "use_topics", self.use_topics, "True or False")
        _check(self.use_topics or self.alpha == 0, c, "alpha", self.alpha,
               "0 when use_topics=False (the no-LDA ablation has no expert labels)")
        if self.ffn_hidden is not None:
            _positive(c, "ffn_hidden", self.ffn_hidden)
        _choice(c, "expert", self.expert, DOE_EXPERTS)
        _check(isinstance(self.top_n, int) and 0 <= self.top_n <= self.num_topics, c, "top_n",
               self.top_n, f"an integer in [0, num_topics={self.num_topics}] (0 = all)")
        _check(self.top_n == 0 or self.expert == "blocks", c, "top_n", self.top_n,
               "0 unless expert='blocks' (the composed expert has no blocks to skip)")
        if self.block_hidden is not None:
            _positive(c, "block_hidden", self.block_hidden)
            _check(self.expert == "blocks", c, "block_hidden", self.block_hidden,
                   "None unless expert='blocks'")
        _choice(c, "knowledge_scale", self.knowledge_scale, DOE_KNOWLEDGE_SCALES)
        _check(isinstance(self.shared_knowledge, bool), c, "shared_knowledge",
               self.shared_knowledge, "True or False")
        _choice(c, "first_input", self.first_input, DOE_FIRST_INPUTS)
        _check(self.use_topics or self.first_input == "topic_id", c, "first_input",
               self.first_input, "'topic_id' when use_topics=False (no topics: theta would be "
               "the null id's one-hot, the same input)")

    @staticmethod
    def from_legacy(blob: dict) -> dict:
        """This block's fields in a model config saved while they sat at its top level (under
        ``doe``; ``ModelConfig.migrate``): its FFN defaulted to the model's ``ffn_hidden``."""
        doe = dict(blob.get("doe") or {})
        return {**doe, "ffn_hidden": doe.get("ffn_hidden") or blob.get("ffn_hidden")}

    @property
    def label(self) -> str:
        """The family's name in progress lines."""
        return "DoE"

    def describe(self) -> str:
        """The block in a few words: 'DoE of 128 topics, composed experts'."""
        return f"DoE of {self.num_topics} topics, {self.expert} experts"


@dataclasses.dataclass(frozen=True)
class TopicConfig:
    """How Stage 1's LDA is fitted (DoE sec. 3.2; docs/design.md section 6).

    vocab_size: words kept (the most frequent; scikit-learn ``max_features``).
    min_df: a word must occur in at least this many documents.
    stop_words: drop scikit-learn's English stop words (they carry no topic).
    max_documents: fit on at most this many training documents (the first ones in source
      order; 0 = all). The fitted model labels every document.
    max_iter: passes over the documents (``LatentDirichletAllocation.max_iter``).
    batch_size: documents per online update (``batch_size``; scikit-learn's default 128).
    learning_decay, learning_offset: the online learning rate ``(offset + t)^-decay``
      (scikit-learn's defaults 0.7 and 10).
    doc_topic_prior: Dirichlet alpha of theta_d; 0 means scikit-learn's 1 / K.
    topic_word_prior: Dirichlet eta of beta_k; 0 means 1 / K.
    seed: scikit-learn ``random_state``.
    """

    vocab_size: int = 20000
    min_df: int = 2
    stop_words: bool = True
    max_documents: int = 0
    max_iter: int = 10
    batch_size: int = 128
    learning_decay: float = 0.7
    learning_offset: float = 10.0
    doc_topic_prior: float = 0.0
    topic_word_prior: float = 0.0
    seed: int = 0

    def __post_init__(self):
        c = "TopicConfig"
        for name in ("vocab_size", "min_df", "max_iter", "batch_size"):
            _positive(c, name, getattr(self, name))
        _check(isinstance(self.max_documents, int) and self.max_documents >= 0, c,
               "max_documents", self.max_documents, "an integer >= 0 (0 = all)")
        _check(0.5 < self.learning_decay <= 1.0, c, "learning_decay", self.learning_decay,
               "a number in (0.5, 1] (online LDA's convergence condition)")
        _check(self.learning_offset > 1.0, c, "learning_offset", self.learning_offset,
               "a number > 1")
        for name in ("doc_topic_prior", "topic_word_prior"):
            _nonnegative(c, name, getattr(self, name))
