"""Batches for training and evaluation.

Every batch is a dict of NumPy arrays: ``inputs`` and ``targets`` int32 [B, seq_len] (targets
are the inputs shifted left by one within a window of seq_len + 1 tokens) and ``mask`` bool
[B, seq_len] (False where the target is padding, or, for task batches, not an answer token).
With an annotator (``annotate=``, :class:`dagmoe_jax.data.extension.Annotator`: the per-token
arrays a model family reads, e.g. DoE's topic ids and labels) batches also carry each of its
``keys``, int32 [B, seq_len] aligned with ``inputs`` (its ``pad`` value where the input is
padding), computed per record and packed, shuffled and checkpointed together with the tokens.

* :func:`train_dataset`: an endless, shuffled, packed ``grain.IterDataset``; its iterator is
  checkpointable (``get_state`` / ``set_state``, or Orbax with ``grain.checkpoint``).
* :func:`eval_batches`: the held-out / eval data, packed the same way, finite, in order.
* :func:`task_eval_batches`: one synthetic task example per row, the mask on its answer, to
  score greedy exact answers (:mod:`dagmoe_jax.evaluation.accuracy`).
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from typing import Callable, Optional, Sequence, Union

import grain
import numpy as np

from dagmoe_jax.data.config import DataConfig, check_process, local_batch_size, parse_source
from dagmoe_jax.data.eval_batching import global_batches
from dagmoe_jax.data.instruct import (EncodeExample, chat_encoder, instruct_eval_batches,
                                      is_instruct, shift_packed)
from dagmoe_jax.data.sources import TASK_EVAL_STREAM
from dagmoe_jax.data.splits import (eval_source, mixed_train_records, mixture,
                                    train_records, train_source)
from dagmoe_jax.data.tasks import generate
from dagmoe_jax.data.tokenizers import Tokenizer, check_tokens
from dagmoe_jax.data.workers import finish_stream

# Threads that read + tokenize records ahead of the packer, and how far ahead they go.
READ_OPTIONS = dict(num_threads=2, prefetch_buffer_size=64)


def encode_record(tokenizer: Tokenizer, text: str) -> list:
    """A record's token ids, EOS appended unless the record is a piece of a longer document
    that continues in the next record (:class:`~dagmoe_jax.data.sources.Piece`)."""
    ids = tokenizer.encode(text)
    if not getattr(text, "continues", False):
        ids.append(tokenizer.eos_id)
    return ids


class _Encode:
    """text -> {'tokens': ids (+ [eos])}, plus the annotator's arrays (a picklable grain map
    function)."""

    def __init__(self, tokenizer: Tokenizer, annotate=None):
        self.tokenizer, self.annotate = tokenizer, annotate

    def __call__(self, text: str) -> dict:
        ids = encode_record(self.tokenizer, text)
        out = {"tokens": np.asarray(ids, np.int32)}
        if self.annotate is not None:
            out.update({k: np.asarray(v, np.int32) for k, v in self.annotate(ids).items()})
        return out


def _annotation_keys(annotate) -> tuple:
    return () if annotate is None else tuple(annotate.keys)


class _Shift:
    """A packed window of seq_len + 1 -> inputs w[:-1], targets w[1:], the mask of real
    targets, and each annotation aligned with the inputs (its pad value on padding). With
    ``segments`` (``DataConfig.segment_packing``) also ``segment_ids`` (the window's documents
    numbered 1, 2, ..., 0 on padding; aligned with the inputs) and the mask drops the
    predictions across a document boundary."""

    def __init__(self, annotate=None, segments: bool = False):
        self.pad = {} if annotate is None else dict(annotate.pad)
        self.segments = segments

    def __call__(self, window: dict) -> dict:
        tokens, segments = window["tokens"], window["tokens_segment_ids"]
        if self.segments:
            out = shift_packed(tokens, segments)
        else:
            out = {"inputs": tokens[:-1], "targets": tokens[1:], "mask": segments[1:] != 0}
        for key, pad in self.pad.items():
            out[key] = np.where(segments[:-1] != 0, window[key][:-1], pad).astype(np.int32)
        return out


def train_dataset(cfg: DataConfig, tokenizer: Tokenizer, *, process_index: int = 0,
                  process_count: int = 1, annotate=None, vocab_size: Optional[int] = None,
                  log: Optional[Callable[[str], None]] = None) -> grain.IterDataset:
    """The endless training stream of this process: batches of ``batch_size // process_count``.

    Records of this process (:func:`~dagmoe_jax.data.splits.train_records`) -> shuffled with
    ``cfg.seed`` (a new order each epoch) and repeated forever (a ``mix:`` source: each
    component so, then drawn by weight, :func:`~dagmoe_jax.data.splits.mixed_train_records`)
    -> tokenized with EOS appended -> packed end to end (``ConcatThenSplitIterDataset``) into windows of seq_len + 1 -> inputs
    w[:-1], targets w[1:] -> batched. ``iter(ds)`` is a grain ``DatasetIterator``: save its
    ``get_state()`` (or use ``grain.checkpoint.CheckpointSave`` with Orbax) and ``set_state`` an
    iterator of an identically built dataset to continue with exactly the same batches.

    With ``cfg.worker_count`` W > 0, W grain processes each read and pack every W-th record of
    this process and batches alternate between them: a different (equally valid) stream from
    W = 0 or 1, so a saved state resumes only with the same ``worker_count``. ``annotate``: an
    :class:`~dagmoe_jax.data.extension.Annotator` whose arrays every batch carries.
    ``vocab_size`` (the model's): each batch's token ids are checked against it as the batch
    is made (:class:`CheckTokens`). ``log`` hears what a ``mix:`` source draws (each
    component's weight and size, :func:`~dagmoe_jax.data.splits.describe_mixture`).
    """
    batch = local_batch_size(cfg, process_count)
    if mixture(cfg):
        ds = mixed_train_records(cfg, process_index=process_index, process_count=process_count,
                                 log=log)
    else:
        ds = train_records(cfg, process_index=process_index, process_count=process_count)
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        ds = ds.repeat()
    ds = ds.map(_Encode(tokenizer, annotate))
    it = ds.to_iter_dataset(grain.ReadOptions(**READ_OPTIONS))
    it = grain.experimental.ConcatThenSplitIterDataset(
        it, length_struct={k: cfg.seq_len + 1 for k in ("tokens",) + _annotation_keys(annotate)})
    it = it.map(_Shift(annotate, cfg.segment_packing)).batch(batch, drop_remainder=True)
    return finish_stream(it, cfg.worker_count, vocab_size)


def eval_batches(cfg: DataConfig, tokenizer: Tokenizer, *, max_batches: Optional[int] = None,
                 process_index: int = 0, process_count: int = 1, annotate=None) -> list:
    """The evaluation data (:func:`~dagmoe_jax.data.splits.eval_source`) as a list of batches.

    Records in order, each tokenized with EOS appended (after a long document's last piece),
    packed end to end into windows of seq_len + 1 by grain's concat-then-split packer, as the
    training stream packs them (the last window padded, its padding masked), grouped into
    global batches of ``batch_size`` rows (the last filled with fully masked rows) of which
    this process keeps rows ``[process_index * B, (process_index + 1) * B)``, B = batch_size
    // process_count (:func:`~dagmoe_jax.data.eval_batching.global_batches`). Every process gets
    the same number of batches. ``max_batches`` stops after that many
    global batches. Deterministic; no shuffle. ``annotate``: as :func:`train_dataset`.
    With ``segment_packing`` batches carry ``segment_ids`` (the rows' documents numbered) and
    the mask drops predictions across documents. An ``instruct:`` source's evaluation
    batches are :func:`~dagmoe_jax.data.instruct.instruct_eval_batches`.
    """
    if is_instruct(cfg):
        return instruct_eval_batches(cfg, tokenizer, max_batches=max_batches,
                                     process_index=process_index, process_count=process_count)
    check_process(process_index, process_count)
    local_batch_size(cfg, process_count)
    width = cfg.seq_len + 1
    records = grain.MapDataset.source(eval_source(cfg)).map(_Encode(tokenizer, annotate))
    windows = grain.experimental.ConcatThenSplitIterDataset(
        records.to_iter_dataset(), length_struct={k: width for k in ("tokens",)
                                                  + _annotation_keys(annotate)})
    rows = windows.map(_Shift(annotate, cfg.segment_packing))
    limit = None if max_batches is None else int(max_batches) * cfg.batch_size
    return global_batches(itertools.islice(rows, limit), cfg.batch_size, process_index,
                          process_count, None if annotate is None else dict(annotate.pad))


def task_names(cfg: DataConfig) -> tuple:
    """The synthetic tasks of ``cfg.source`` in order (``task_id`` indexes this tuple)."""
    kind, args = parse_source(cfg.source)
    if kind != "synthetic":
        raise ValueError(f"DataConfig.source={cfg.source!r} has no synthetic tasks: pass tasks= "
                         "to task_eval_batches or use a 'synthetic:' source")
    return args


def _answer_ids(tokenizer: Tokenizer, prompt: str, answer: str) -> tuple:
    """(prompt ids, answer ids), the split of the joint tokenization when it has one."""
    head, full = tokenizer.encode(prompt), tokenizer.encode(prompt + answer)
    if full[:len(head)] == head and len(full) > len(head):
        return head, full[len(head):]
    return head, tokenizer.encode(answer)


def task_eval_batches(cfg: DataConfig, tokenizer: Tokenizer, *, num_examples: int,
                      size: Union[None, int, Sequence[int]] = None, batch_size: int,
                      tasks: Optional[Sequence[str]] = None,
                      seq_len: Optional[int] = None) -> list:
    """Synthetic task examples, one per row, for exact-answer accuracy.

    Example i is task ``tasks[i % len(tasks)]`` (default: the tasks of ``cfg.source``) with a
    size uniform in ``size`` (None: ``[task_min_size, task_max_size]``; an int: that size; a
    pair: that inclusive range), drawn from ``(synthetic_seed, TASK_EVAL_STREAM, lo, hi, i)``.
    A row is EOS (as after the previous record in training), the prompt and the answer; it is
    right-padded to ``seq_len`` (default ``cfg.seq_len``). ``mask`` is True exactly on the
    targets that are answer tokens (the answer's digits and its '\\n'). Batches carry
    ``task_id`` (int32 [B], index into ``tasks``) and ``size`` (int32 [B]); the last batch has
    ``num_examples % batch_size`` rows when that is not 0.
    """
    tasks = tuple(tasks) if tasks is not None else task_names(cfg)
    if size is None:
        lo, hi = cfg.task_min_size, cfg.task_max_size
    elif isinstance(size, numbers.Integral):
        lo = hi = int(size)
    else:
        lo, hi = (int(s) for s in size)
    if not 1 <= lo <= hi:
        raise ValueError(f"size={size!r} is invalid: expected an int >= 1 or a pair 1 <= lo <= hi")
    for name, value in (("num_examples", num_examples), ("batch_size", batch_size)):
        if not (isinstance(value, numbers.Integral) and value >= 1):
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
    seq_len = cfg.seq_len if seq_len is None else int(seq_len)
    rows = []
    for i in range(int(num_examples)):
        rng = np.random.default_rng([cfg.synthetic_seed, TASK_EVAL_STREAM, lo, hi, i])
        task_id = i % len(tasks)
        n = int(rng.integers(lo, hi + 1))
        example = generate(tasks[task_id], rng, n)
        head, answer = _answer_ids(tokenizer, example.prompt, example.answer)
        ids = [tokenizer.eos_id] + head + answer
        if len(ids) - 1 > seq_len:
            raise ValueError(f"a {tasks[task_id]!r} example of size {n} needs {len(ids) - 1} "
                             f"tokens > seq_len={seq_len}: raise DataConfig.seq_len (or pass a "
                             "larger seq_len) or use smaller sizes")
        rows.append((ids, len(head), task_id, n))
    batches = []
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        window = np.full((len(chunk), seq_len + 1), tokenizer.pad_id, np.int32)
        mask = np.zeros((len(chunk), seq_len), bool)
        for r, (ids, n_head, _, _) in enumerate(chunk):
            window[r, :len(ids)] = ids
            mask[r, n_head:len(ids) - 1] = True  # targets ids[1 + n_head:] are the answer
        batches.append({"inputs": window[:, :-1], "targets": window[:, 1:], "mask": mask,
                        "task_id": np.asarray([c[2] for c in chunk], np.int32),
                        "size": np.asarray([c[3] for c in chunk], np.int32)})
    return batches


_UNIGRAM_BASELINES: dict = {}


def unigram_entropy(cfg: DataConfig, tokenizer: Tokenizer, max_tokens: int = 1_000_000) -> float:
    """The unigram baseline in nats/token: cross-entropy of the eval targets (up to
    ``max_tokens``, those :func:`eval_batches` masks in) under add-one-smoothed unigram
    frequencies counted on up to ``max_tokens`` tokens of training records (with EOS), read in
    an order shuffled by ``cfg.seed``. A model's held-out loss should be well below it.

    Computed once per process for each (config, tokenizer size, ``max_tokens``): runs of one
    data config in one process (a benchmark's variants and seeds of the same data) read the
    corpus once."""
    key = (cfg, tokenizer.vocab_size, max_tokens)
    if key not in _UNIGRAM_BASELINES:
        _UNIGRAM_BASELINES[key] = _unigram_entropy(cfg, tokenizer, max_tokens)
    return _UNIGRAM_BASELINES[key]


def _unigram_entropy(cfg: DataConfig, tokenizer: Tokenizer, max_tokens: int) -> float:
    vocab = tokenizer.vocab_size
    counts, total = np.zeros(vocab, np.int64), 0
    records = grain.MapDataset.source(train_source(cfg)).shuffle(seed=cfg.seed)
    if is_instruct(cfg):
        encode = EncodeExample(chat_encoder(cfg, tokenizer), cfg.seq_len + 1, cfg.truncation)
    else:
        encode = functools.partial(encode_record, tokenizer)
    for i in range(len(records)):
        ids = np.asarray(encode(records[i])["tokens"] if is_instruct(cfg) else encode(records[i]),
                         np.int64)
        check_tokens({"inputs": ids, "targets": ids}, vocab)
        counts += np.bincount(ids, minlength=vocab)
        total += ids.size
        if total >= max_tokens:
            break
    log_p = np.log(counts + 1.0) - math.log(total + vocab)
    per_batch = cfg.batch_size * cfg.seq_len
    nll, n = 0.0, 0
    for batch in eval_batches(cfg, tokenizer, max_batches=max(1, -(-max_tokens // per_batch))):
        targets = batch["targets"][batch["mask"]]
        check_tokens({"inputs": targets, "targets": targets}, vocab)
        nll -= float(log_p[targets].sum())
        n += targets.size
    if n == 0:
        raise ValueError("the evaluation data has no target tokens: check DataConfig.eval_source")
    return nll / n
