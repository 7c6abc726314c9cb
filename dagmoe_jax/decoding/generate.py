"""Batched autoregressive generation with a KV cache, for every block type.

``generate(model, prompts, max_new_tokens=...)`` continues a batch of prompts
(``dagmoe_jax.run.load_run`` loads a run directory's newest checkpoint for it);
``python -m dagmoe_jax.cli.sample`` is the command line. Design:

* **Prompts of different lengths are right-padded.** Row b's token p sits at position p and at
  cache slot p, so every row's positions start at 0 exactly as in training and the prefill is the
  training forward pass itself (plain causal attention: a real token never sees the padding
  after it). Decoding then advances each row from its own length: the decode step takes one
  position per row, writes that row's key and value into its slot (over the padding's) and
  attends to slots ``<= position`` only. Rows never interact, so a row gives the same tokens
  batched as alone (greedy; up to float rounding in the logits).
* **Routing drops nothing while generating.** Capacity dispatch sizes its buffers from the number
  of tokens in the call, so what it drops depends on the batch (and on padding): a one-token
  decode step would route differently from the full forward pass. Generation therefore runs the
  MoE / CoE blocks with ``dispatch='dropless'`` by default (exact, every assignment kept; the
  model's parameters are shared, only the config differs). This equals the model's own forward
  pass whenever that drops nothing (e.g. a large enough ``capacity_factor``); where training
  dropped tokens, generation computes what the model would output without drops. ``'dense'``
  (every expert on every token) is also exact; ``'capacity'`` reproduces the batch-dependent
  drops and is not recommended.
* **One compiled program per shape.** Prefill, the first sample and a ``jax.lax.while_loop`` of
  one-token decode steps (stopping early once every row has finished) are a single jitted
  function of (batch, padded prompt length, max_new_tokens, greedy or not); temperature, top-k,
  top-p, stop tokens and the seed are traced values, so changing them does not recompile.
* **Sampling** (``sample_logits``): greedy when ``temperature == 0``; otherwise the logits are
  divided by the temperature, cut to the ``top_k`` best (0: all) and then to the smallest set
  whose probability reaches ``top_p`` (the nucleus; the best token always stays), and sampled
  with a key folded from ``seed``, the step and the row, so a given seed reproduces the output.
  Ties rank the lower token id first, so ``top_k=1`` or a tiny ``top_p`` is exactly greedy.
* **Stop tokens**: a row that emits one is finished; the stop token is kept as its last token
  and the rest of its row is ``pad_id``.
* **Stop rules on the text** (``stop_when``): a host predicate on a row's generated ids so far,
  asked after each new token of a live row through an ordered host callback inside the same
  loop; True finishes the row as a stop token does. The harness gives lm-eval's stop-string
  rule, so decoding ends at a stop string instead of running on to ``max_new_tokens``.
* **Tracked features**: a model family whose tokens carry features that depend on the text so
  far (DoE's causal topic ids) decodes with ``generate(..., features=tracker)``, a
  :class:`~dagmoe_jax.data.extension.FeatureTracker` (``extension_for(cfg).decoding_features(...)``)
  that gives the prompt's features and, through an ordered host callback inside the same
  decoding loop, each new token's: one loop for every model.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable, List, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from dagmoe_jax.config import ExecutionConfig, ModelConfig, experts_of
from dagmoe_jax.model import Transformer
from dagmoe_jax.model.settle import settle

DEFAULT_DISPATCH = "dropless"


class Generation(NamedTuple):
    """What ``generate`` returns for an array of prompts.

    tokens [B, max_new_tokens] int32: the new tokens of each row; after a stop token, ``pad_id``.
    lengths [B]: tokens generated per row (including the stop token, if one was emitted).
    finished [B] bool: whether the row emitted a stop token.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    finished: np.ndarray

    def as_lists(self) -> List[List[int]]:
        """Each row's generated tokens, cut at its length."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


# ------------------------------------------------------------------------------ sampling (pure)


def sample_logits(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """Draw one token per row from ``logits`` [B, V] with temperature, top-k and top-p.

    temperature > 0 (a scalar); top_k: keep the k most likely tokens (<= 0: all); top_p: then
    keep the smallest prefix of the ranked tokens whose probability reaches top_p (>= 1: all).
    The vocabulary is ranked once (``lax.top_k``, ties to the lower id) and the draw is made in
    rank order; each row gets its own key (``fold_in(key, row)``). Returns ids [B] int32.
    """
    b, v = logits.shape
    ranked, ids = jax.lax.top_k(logits.astype(jnp.float32), v)          # descending
    ranked = ranked / temperature
    rank = jnp.arange(v)
    keep = (top_k <= 0) | (rank < top_k)
    ranked = jnp.where(keep, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                    # exclusive cumsum
    keep = keep & ((top_p >= 1.0) | (mass_before < top_p))
    ranked = jnp.where(keep, ranked, -jnp.inf)
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(b))
    choice = jax.vmap(jax.random.categorical)(keys, ranked)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _next_tokens(logits, key, step, greedy: bool, temperature, top_k, top_p):
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_logits(logits, jax.random.fold_in(key, step), temperature, top_k, top_p)


# ------------------------------------------------------------------------------ the decoding loop


# The feature tracker and the stop rule of the generate call in progress, read by the decoding
# loop's host callbacks (one such generation at a time: the lock is held for the whole call).
_TRACKING = {"tracker": None, "stops": None}
_TRACKING_LOCK = threading.Lock()


def _track_step(tokens):
    """Host callback: the features of the tokens just generated (the active tracker's)."""
    features = _TRACKING["tracker"].step(np.asarray(tokens))
    return {k: np.asarray(v, np.int32) for k, v in features.items()}


class RowStops:
    """The host side of ``generate(..., stop_when=...)``: each row's generated ids so far, and
    whether ``stop_when`` has finished it.

    ``step(tokens, live)`` appends ``tokens[b]`` to every row ``b`` that was still live when it
    emitted it and asks ``stop_when(ids)`` of that row; it returns which rows are finished.
    """

    def __init__(self, stop_when: Callable[[List[int]], bool], batch: int):
        self.stop_when = stop_when
        self.ids: List[List[int]] = [[] for _ in range(batch)]
        self.stopped = np.zeros((batch,), bool)

    def step(self, tokens, live) -> np.ndarray:
        """Record one token per live row; the rows ``stop_when`` has finished, [B] bool."""
        for b in np.flatnonzero(np.asarray(live) & ~self.stopped):
            self.ids[b].append(int(tokens[b]))
            self.stopped[b] = bool(self.stop_when(self.ids[b]))
        return self.stopped.copy()


class StopStrings:
    """A ``stop_when`` rule for stop strings, lm-eval's own (``MultiTokenEOSCriteria``, which
    its Hugging Face model hands to ``transformers``' ``generate``): a row is finished once the
    text of its last ``len(tokenizer.encode(s)) + 2`` generated ids, decoded with the special
    tokens, contains a stop string ``s`` of ``until``. In a batch, lm-eval stops only once
    every row has met the same string (so a row's text can depend on its neighbours); row by
    row, as here, is what it does at its default ``batch_size=1``. The caller cuts the text at
    the first stop string; the tokens after the stop are not decoded."""

    def __init__(self, until: Sequence[str], tokenizer):
        self.windows = [(s, len(tokenizer.encode(s)) + 2) for s in until if s]
        self.decode = tokenizer.decode

    def __call__(self, ids: List[int]) -> bool:
        return any(s in self.decode(ids[-n:]) for s, n in self.windows)


def _gathered(*arrays):
    """``arrays`` replicated over the active mesh's devices (unchanged off a mesh): what a host
    callback reads from device 0 is then already whole there, so the partitioner does not
    rematerialise a sharded row array for it in every decode step."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return arrays
    return tuple(jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec())
                 for a in arrays)


def _stop_step(tokens, live):
    """Host callback: which rows the active stop rule has finished."""
    return _TRACKING["stops"].step(np.asarray(tokens), np.asarray(live))


def prefill(model: Transformer, tokens: jax.Array, lengths: jax.Array, features, *,
            cache_len: int):
    """The prefill of generation: the forward pass over right-padded prompts ``tokens`` [B, P]
    into a fresh KV cache of ``cache_len`` slots; (logits at each row's last prompt token
    [B, V], the filled cache). ``dagmoe_jax.compile`` compiles this for a TPU topology."""
    cache = model.init_cache(tokens.shape[0], cache_len)
    logits, aux = model(tokens, features=features, cache=cache, logit_positions=lengths - 1)
    return logits, aux["cache"]


def decode_step(model: Transformer, tok: jax.Array, cache, start: jax.Array, features=None):
    """One decode step: each row's newest token ``tok`` [B] at position ``start`` [B] against
    ``cache``; (logits [B, 1, V], the cache with that position written)."""
    logits, aux = model(tok[:, None], features=features, cache=cache, start=start)
    return logits, aux["cache"]


@functools.partial(jax.jit,
                   static_argnames=("graphdef", "max_new_tokens", "greedy", "ask_stops"))
def _generate(graphdef, state, tokens, lengths, features, key, temperature, top_k, top_p,
              stop_tokens, pad_id, *, max_new_tokens: int, greedy: bool, ask_stops: bool):
    """Prefill + while_loop of decode steps; returns (tokens [B, N], lengths [B], finished [B]).

    ``features``: the prompt's tracked features (None: the model has none); each decode step
    then asks the active tracker for the new tokens' features through an ordered host
    callback, in the loop itself. ``ask_stops``: after each token, the active
    :class:`RowStops` says (another ordered callback) which rows its rule has finished."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    n = max_new_tokens
    logits, cache = prefill(model, tokens, lengths, features, cache_len=p + n - 1)
    sample = functools.partial(_next_tokens, key=key, greedy=greedy, temperature=temperature,
                               top_k=top_k, top_p=top_p)
    step_features = (None if features is None else
                     {k: jax.ShapeDtypeStruct((b, 1) + v.shape[2:], jnp.int32)
                      for k, v in features.items()})

    def record(step, tok, out, count, finished):
        tok = jnp.where(finished, pad_id, tok)
        out = out.at[:, step].set(tok)
        count = jnp.where(finished, count, step + 1)
        live = ~finished
        finished = finished | jnp.any(tok[:, None] == stop_tokens[None, :], axis=-1)
        if ask_stops:
            finished = finished | io_callback(_stop_step, jax.ShapeDtypeStruct((b,), bool),
                                              *_gathered(tok, live), ordered=True)
        return tok, out, count, finished

    out = jnp.full((b, n), pad_id, jnp.int32)
    count = jnp.zeros((b,), jnp.int32)
    finished = jnp.zeros((b,), bool)
    tok, out, count, finished = record(0, sample(logits, step=0), out, count, finished)

    def cond(carry):
        step, finished = carry[0], carry[-1]
        return (step < n) & ~jnp.all(finished)

    def body(carry):
        # the parameters ride in the carry: nnx needs them traced at the loop's level
        step, params, tok, cache, out, count, finished = carry
        new = (None if step_features is None
               else io_callback(_track_step, step_features, *_gathered(tok), ordered=True))
        logits, cache = decode_step(nnx.merge(graphdef, params), tok, cache,
                                    lengths + step - 1, new)
        tok, out, count, finished = record(step, sample(logits[:, 0], step=step), out, count,
                                           finished)
        return step + 1, params, tok, cache, out, count, finished

    carry = (jnp.int32(1), state, tok, cache, out, count, finished)
    *_, out, count, finished = jax.lax.while_loop(cond, body, carry)
    return out, count, finished


def _padded_ids(ids: Sequence[int]) -> jax.Array:
    """``ids`` padded with -1 (never a token) to a power-of-two length >= 8, so that the number
    of stop tokens rarely changes the compiled program's shapes."""
    ids = [int(i) for i in ids]
    size = max(8, 1 << max(len(ids) - 1, 0).bit_length())
    return jnp.asarray(ids + [-1] * (size - len(ids)), jnp.int32)


@functools.lru_cache(maxsize=32)
def _graphdef_for(cfg: ModelConfig, execution: ExecutionConfig):
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, execution=execution,
                                                           rngs=nnx.Rngs(0))))


def decoding_model(model: Transformer, dispatch: str = DEFAULT_DISPATCH) -> Transformer:
    """``model`` with its MoE / CoE blocks using ``dispatch`` (the same parameter arrays).

    Returns ``model`` itself when nothing changes (a dense model, or the same dispatch).
    """
    cfg = model.cfg
    experts = experts_of(cfg.block)
    if experts is None or experts.dispatch == dispatch:
        return model
    return nnx.merge(_graphdef_for(cfg.replace(block=dict(experts=dict(dispatch=dispatch))),
                                   model.execution), nnx.state(model))


def computing_in(model: Transformer, dtype: str) -> Transformer:
    """``model`` computing in ``dtype`` ('float32', 'bfloat16'; the same parameter arrays, the
    LM head's products still accumulated in float32), its execution settled again for that
    dtype (the CPU kernels run float32 only). Returns ``model`` itself when nothing changes."""
    cfg = model.cfg
    if jnp.dtype(cfg.compute_dtype) == jnp.dtype(dtype):
        return model
    new = cfg.replace(compute_dtype=str(dtype))
    execution = settle(new, dataclasses.replace(model.execution, attention="auto",
                                                grouped_matmul="auto", dag_module="auto"))
    return nnx.merge(_graphdef_for(new, execution), nnx.state(model))


def _as_batch(prompts, lengths, pad_id: int):
    """(tokens [B, P] right-padded to the longest prompt, lengths [B], valid mask [B, P])."""
    if isinstance(prompts, (list, tuple)):
        if lengths is not None:
            raise ValueError("generate: pass lengths only with an array of prompts")
        if not prompts:
            raise ValueError("generate: prompts is empty")
        rows = [np.asarray(r, np.int64).reshape(-1) for r in prompts]
        lens = np.array([len(r) for r in rows], np.int64)
        width = max(int(lens.max()), 1)
        tokens = np.full((len(rows), width), pad_id, np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
    else:
        tokens = np.asarray(prompts)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"generate: prompts must be a list of token lists or an integer "
                             f"array [B, S], got shape {tokens.shape} dtype {tokens.dtype}")
        if tokens.shape[0] == 0:
            raise ValueError("generate: prompts is empty")
        lens = (np.full((tokens.shape[0],), tokens.shape[1], np.int64) if lengths is None
                else np.asarray(lengths, np.int64).reshape(-1))
        if lens.shape != (tokens.shape[0],):
            raise ValueError(f"generate: lengths has {lens.size} entries for {tokens.shape[0]} "
                             f"prompts")
        if np.any(lens > tokens.shape[1]):
            raise ValueError(f"generate: a length ({int(lens.max())}) exceeds the prompt array's "
                             f"width {tokens.shape[1]}")
        tokens = tokens[:, :max(int(lens.max()), 1)]
    if np.any(lens < 1):
        raise ValueError(f"generate: prompt {int(np.argmin(lens))} is empty: every prompt needs at "
                         f"least one token (e.g. the tokenizer's EOS as a start token)")
    valid = np.arange(tokens.shape[1])[None, :] < lens[:, None]
    return tokens, lens, valid


def check_settings(max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0) -> None:
    """One-line ValueError for an invalid generation setting (``generate`` calls it)."""
    is_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool)
    for name, value, ok, want in (
            ("max_new_tokens", max_new_tokens, is_int(max_new_tokens) and max_new_tokens >= 1,
             "an integer >= 1"),
            ("temperature", temperature, temperature >= 0, "a number >= 0 (0: greedy)"),
            ("top_k", top_k, is_int(top_k) and top_k >= 0, "an integer >= 0 (0: off)"),
            ("top_p", top_p, 0 < top_p <= 1, "a number in (0, 1] (1: off)")):
        if not ok:
            raise ValueError(f"{name}={value!r} is invalid: expected {want}")


def generate(model: Transformer, prompts: Union[Sequence[Sequence[int]], np.ndarray, jax.Array],
             lengths: Optional[Sequence[int]] = None, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_tokens: Sequence[int] = (), seed: int = 0, pad_id: int = 0,
             dispatch: str = DEFAULT_DISPATCH, features=None,
             stop_when: Optional[Callable[[List[int]], bool]] = None):
    """Continue each prompt by up to ``max_new_tokens`` tokens (module docstring: the design).

    prompts: a list of token-id lists (any lengths), or an integer array [B, S] with ``lengths``
      [B] (default: all S) of right-padded prompts. Every prompt needs at least one token.
    temperature: 0 is greedy (argmax); > 0 samples. top_k (0: off), top_p (1: off): filters.
    stop_tokens: ids that finish a row (kept as its last token). seed: the PRNG seed.
    pad_id: written after a row's stop token and used to pad the prompts.
    dispatch: the MoE / CoE dispatch used while generating ('dropless': exact, the default).
    features: a :class:`~dagmoe_jax.data.extension.FeatureTracker` for a model family whose tokens
      carry tracked features (a DoE model with topics:
      ``extension_for(cfg).decoding_features(run_dir, data_cfg, tokenizer)``).
    stop_when: a predicate on a row's generated ids so far (a list, the newest last), asked on
      the host after each of its tokens; True finishes the row, its last token kept (e.g. a
      stop string's rule: :class:`StopStrings`). None: none.

    Returns, for a list of prompts, a list of generated-token lists (each cut after its stop
    token); for an array, a :class:`Generation` (tokens [B, max_new_tokens], lengths, finished).
    Raises ValueError for an empty prompt, ids outside the vocabulary, a prompt longer than
    ``max_seq_len`` or more new tokens than ``max_seq_len`` leaves room for, and bad settings.
    """
    cfg = model.cfg
    check_settings(max_new_tokens, temperature, top_k, top_p)
    as_list = isinstance(prompts, (list, tuple))
    tokens, lens, valid = _as_batch(prompts, lengths, pad_id)
    bad = valid & ((tokens < 0) | (tokens >= cfg.vocab_size))
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"generate: prompt {row} has token id {int(tokens[row, col])} outside the "
                         f"model's vocabulary [0, {cfg.vocab_size})")
    longest = int(lens.max())
    if longest > cfg.max_seq_len:
        raise ValueError(f"a prompt of {longest} tokens is longer than the model's "
                         f"max_seq_len={cfg.max_seq_len}: shorten it")
    if longest + max_new_tokens - 1 > cfg.max_seq_len:
        raise ValueError(f"max_new_tokens={max_new_tokens} after a prompt of {longest} tokens "
                         f"exceeds the model's max_seq_len={cfg.max_seq_len}: at most "
                         f"{cfg.max_seq_len + 1 - longest} new tokens fit")
    stop_tokens = [int(i) for i in stop_tokens]
    if any(i < 0 for i in stop_tokens):
        raise ValueError(f"generate: stop_tokens={stop_tokens} must be non-negative token ids")
    if not 0 <= pad_id < cfg.vocab_size:
        raise ValueError(f"generate: pad_id={pad_id} is outside the model's vocabulary "
                         f"[0, {cfg.vocab_size}) (padding is fed to the model)")

    graphdef, state = nnx.split(decoding_model(model, dispatch))
    prompts = np.where(valid, tokens, pad_id)
    with _TRACKING_LOCK:
        _TRACKING["tracker"] = features
        _TRACKING["stops"] = None if stop_when is None else RowStops(stop_when, len(prompts))
        try:
            prompt_features = (None if features is None else
                               {k: jnp.asarray(v, jnp.int32)
                                for k, v in features.prompt(prompts, lens).items()})
            out, count, finished = _generate(
                graphdef, state, jnp.asarray(prompts, jnp.int32), jnp.asarray(lens, jnp.int32),
                prompt_features, jax.random.key(seed), jnp.float32(max(temperature, 1e-6)),
                jnp.int32(top_k), jnp.float32(top_p), _padded_ids(stop_tokens),
                jnp.int32(pad_id), max_new_tokens=int(max_new_tokens), greedy=temperature == 0,
                ask_stops=stop_when is not None)
            out, count, finished = jax.block_until_ready((out, count, finished))
        finally:
            _TRACKING["tracker"] = _TRACKING["stops"] = None
    result = Generation(np.asarray(out), np.asarray(count), np.asarray(finished))
    return result.as_lists() if as_list else result
