"""Scoring and continuing token sequences for evaluation requests, for any model of the library.

:class:`Scorer` answers the two questions every downstream benchmark asks of a language model,
in token ids (the harness's model class, :mod:`dagmoe_jax.harness.lm`, turns text into ids and
back):

* :meth:`Scorer.loglikelihood`: for (context, continuation) pairs, log p(continuation |
  context) summed over the continuation's tokens, and whether every continuation token is the
  model's argmax (lm-evaluation-harness's ``is_greedy``). Pairs longer than the model's window
  lose tokens from the left, as the harness's Hugging Face model does: the input is
  ``(context + continuation)[-(max_length + 1):][:-1]``.
* :meth:`Scorer.generate`: continuations of prompts by the KV-cache decoding loop
  (:func:`dagmoe_jax.decoding.generate`), greedy or sampled, batched.

Design, so that results never depend on how requests are batched:

* **Dropless routing.** Capacity dispatch drops tokens by how many share a call, so padding and
  neighbouring rows would change a row's score; the scorer runs MoE / CoE blocks with
  ``dispatch='dropless'`` (:func:`dagmoe_jax.decoding.decoding_model`), exact and row-local.
* **Right padding.** Rows are right-padded; causal attention keeps every real position blind to
  the padding after it, so a row scores the same alone, batched or padded (up to float
  rounding of differently shaped matmuls).
* **Few compiled shapes.** The batch is always ``batch_size`` rows (the last batch padded with
  empty rows) and the width is rounded up to a power of two (at least 16, at most
  ``max_length``, :func:`padded_width`): a handful of programs serve a whole evaluation.
* **Longest first**, as the harness orders requests: the first batch is the widest, so running
  out of memory happens at once, not at the end.

A model family whose tokens carry features (DoE's causal topic ids) passes its
:class:`~dagmoe_jax.data.extension.FeatureTracker`: scoring computes the features of each padded
batch from the same tracker that generation uses.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dagmoe_jax.decoding.generate import decoding_model, generate
from dagmoe_jax.evaluation.step import token_scores
from dagmoe_jax.model import Transformer
from dagmoe_jax.parallel import activate

MIN_WIDTH = 16


def padded_width(length: int, max_length: int) -> int:
    """The compiled width for a batch whose longest row has ``length`` inputs: the next power
    of two (at least :data:`MIN_WIDTH`), capped at ``max_length`` (few compiled shapes serve
    every row: the harness's scoring, DUME's prompt statistics)."""
    return min(max(MIN_WIDTH, 1 << max(length - 1, 0).bit_length()), max_length)


def program_bytes(compiled) -> int:
    """Device bytes a compiled program needs (``memory_analysis()``): its arguments, outputs
    and temporaries, less the outputs written over arguments."""
    memory = compiled.memory_analysis()
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
               + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_scores(graphdef, state, inputs, targets, features):
    """Per position: log p(targets | inputs so far) [B, S] float32 and whether the target is
    the argmax [B, S] bool, from evaluation's loglikelihood function."""
    losses, predictions = token_scores(nnx.merge(graphdef, state), inputs, targets,
                                       features=features)
    return -losses, predictions == targets


def free_device_bytes(fraction: float = 0.9) -> int:
    """``fraction`` of the memory free on the first device: what its allocator reports on a GPU
    or TPU, the host's available memory (``MemAvailable``) on CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(fraction * available)


class Scorer:
    """Scores and continues token sequences with ``model`` (module docstring: the design).

    batch_size: rows per compiled call (rounded up to a multiple of the mesh's devices).
    max_length: the longest input the model sees (default and maximum: its ``max_seq_len``).
    features: the model family's :class:`~dagmoe_jax.data.extension.FeatureTracker` (None: none).
    mesh: run the calls inside this device mesh (rows sharded data-parallel; None: one device).
    dispatch: the MoE / CoE dispatch while scoring ('dropless', exact, is the default).
    progress: called with the number of rows finished after each batch.
    """

    def __init__(self, model: Transformer, *, batch_size: int = 8,
                 max_length: Optional[int] = None, features=None, mesh=None,
                 dispatch: str = "dropless",
                 progress: Callable[[int], None] = lambda _rows: None):
        cfg = model.cfg
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid: expected an integer >= 1")
        max_length = cfg.max_seq_len if max_length is None else int(max_length)
        if not 1 <= max_length <= cfg.max_seq_len:
            raise ValueError(f"max_length={max_length} is invalid: expected 1..{cfg.max_seq_len} "
                             f"(the model's max_seq_len)")
        devices = 1 if mesh is None else mesh.size
        self.batch_size = -(-batch_size // devices) * devices
        self.model = decoding_model(model, dispatch)
        self.graphdef, self.state = nnx.split(self.model)
        self.max_length, self.features, self.mesh = max_length, features, mesh
        self.dispatch, self.progress = dispatch, progress
        self.vocab_size = cfg.vocab_size

    def _context(self):
        return contextlib.nullcontext() if self.mesh is None else activate(self.mesh)

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"{what} has token id {bad[0]} outside the model's vocabulary "
                             f"[0, {self.vocab_size}): the tokenizer does not match the model")

    def call_bytes(self, rows: int) -> int:
        """Device bytes one scoring call of ``rows`` rows at the full window needs (arguments,
        outputs and temporaries of the compiled program, per device: a mesh's rows are
        counted on one device)."""
        devices = 1 if self.mesh is None else self.mesh.size
        per_device = max(rows // devices, 1)
        ids = jax.ShapeDtypeStruct((per_device, self.max_length), jnp.int32)
        features = None
        if self.features is not None:
            features = {k: jax.ShapeDtypeStruct(np.shape(v), jnp.int32) for k, v in
                        self.features.prompt(np.zeros(ids.shape, np.int32),
                                             np.ones((per_device,), np.int32)).items()}
        return program_bytes(_token_scores.lower(self.graphdef, self.state, ids, ids,
                                                 features).compile())

    def fit_batch_size(self, largest: int = 64, budget: Optional[int] = None) -> int:
        """The largest power of two up to ``largest`` rows (a multiple of the mesh's devices)
        whose scoring call at the full window (:meth:`call_bytes`) fits ``budget`` bytes
        (default: :func:`free_device_bytes`); the smallest when none does. What the harness's
        ``batch_size='auto'`` asks for: a size chosen from the compiled program's memory, not
        by running out of it."""
        if largest < 1:
            raise ValueError(f"max_batch_size={largest} is invalid: expected >= 1")
        devices = 1 if self.mesh is None else self.mesh.size
        budget = free_device_bytes() if budget is None else budget
        rows = 1 << (int(largest).bit_length() - 1)
        while rows > 1 and self.call_bytes(-(-rows // devices) * devices) > budget:
            rows //= 2
        return -(-rows // devices) * devices

    def token_scores(self, rows: Sequence[Sequence[int]]) -> List[Tuple[np.ndarray, np.ndarray]]:
        """For each row of ids (2 to ``max_length + 1`` of them): the log-probability of ids[i
        + 1] after ids[:i + 1] and whether it is the argmax, for every i (two arrays of
        len(row) - 1), in the order given; computed in batches of the longest rows first."""
        out: List[Optional[Tuple[np.ndarray, np.ndarray]]] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        with self._context():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                width = padded_width(max(len(rows[i]) - 1 for i in chunk), self.max_length)
                inputs = np.zeros((self.batch_size, width), np.int32)
                targets = np.zeros((self.batch_size, width), np.int32)
                lengths = np.ones((self.batch_size,), np.int32)
                for r, i in enumerate(chunk):
                    row = list(rows[i])
                    if not 2 <= len(row) <= self.max_length + 1:
                        raise ValueError(f"a scored row has {len(row)} tokens: expected 2 to "
                                         f"max_length + 1 = {self.max_length + 1}")
                    self._check_ids(row, "a scored row")
                    inputs[r, :len(row) - 1], targets[r, :len(row) - 1] = row[:-1], row[1:]
                    lengths[r] = len(row) - 1
                features = None
                if self.features is not None:
                    features = {k: jnp.asarray(v, jnp.int32) for k, v in
                                self.features.prompt(inputs, lengths).items()}
                logp, greedy = _token_scores(self.graphdef, self.state, jnp.asarray(inputs),
                                             jnp.asarray(targets), features)
                logp, greedy = np.asarray(logp), np.asarray(greedy)
                for r, i in enumerate(chunk):
                    n = len(rows[i]) - 1
                    out[i] = (logp[r, :n], greedy[r, :n])
                self.progress(len(chunk))
        return out

    def loglikelihood(self, pairs: Sequence[Tuple[Sequence[int], Sequence[int]]]
                      ) -> List[Tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) for each (context ids, continuation ids)
        pair: the context non-empty, the continuation 1 to ``max_length`` tokens; a pair
        longer than ``max_length + 1`` loses tokens from the left of its context."""
        rows, counts = [], []
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("loglikelihood needs a non-empty context and continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than "
                                 f"max_length={self.max_length}")
            rows.append((list(context) + list(continuation))[-(self.max_length + 1):])
            counts.append(len(continuation))
        scores = self.token_scores(rows)
        return [(float(np.sum(logp[-n:], dtype=np.float64)), bool(np.all(greedy[-n:])))
                for (logp, greedy), n in zip(scores, counts)]

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_tokens: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, pad_id: int = 0,
                 stop_when=None) -> List[List[int]]:
        """Up to ``max_new_tokens`` new ids for each prompt (cut after a stop token, or after
        the token for which ``stop_when`` holds), by :func:`dagmoe_jax.decoding.generate` in
        batches of ``batch_size`` (the last one padded with copies of its first prompt, whose
        outputs are dropped). A prompt longer than
        ``max_length - max_new_tokens`` keeps its last tokens, so prompt and continuation fit
        the model's window."""
        keep = max(self.max_length - max_new_tokens, 1)
        rows = [list(p)[-keep:] for p in prompts]
        for row in rows:
            if not row:
                raise ValueError("generate: a prompt is empty (give it at least one token)")
            self._check_ids(row, "a prompt")
        new = min(max_new_tokens, self.model.cfg.max_seq_len + 1 - max(map(len, rows), default=1))
        out: List[List[int]] = []
        with self._context():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                filled = chunk + [chunk[0]] * (self.batch_size - len(chunk))
                result = generate(self.model, filled, max_new_tokens=new,
                                  temperature=temperature, top_k=top_k, top_p=top_p,
                                  stop_tokens=stop_tokens, seed=seed + start, pad_id=pad_id,
                                  dispatch=self.dispatch, features=self.features,
                                  stop_when=stop_when)
                out.extend(result[:len(chunk)])
                self.progress(len(chunk))
        return out
