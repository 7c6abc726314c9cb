"""Instruction fine-tuning (SFT) batches: conversations packed whole, the loss on the
assistant's tokens only.

An ``instruct:`` source's records (:mod:`~dagmoe_jax.data.instruct_records`) are formatted
and tokenized by :class:`~dagmoe_jax.data.chat.ChatEncoder` into token ids and 0/1 loss
weights (1 on the assistant's tokens and the EOS ending each assistant turn). An example
longer than ``seq_len + 1`` tokens is truncated to its first ``seq_len + 1`` (the count is
reported by :func:`instruct_stats`). Examples are packed whole, first fit
(``grain.experimental.FirstFitPackIterDataset``, one bin per batch row), never split across
rows; with ``DataConfig.packing = False`` each row holds one example, padded. Every batch
holds:

* ``inputs``, ``targets`` int32 [B, seq_len]: a row of seq_len + 1 packed tokens shifted;
* ``segment_ids`` int32 [B, seq_len]: the examples of a row numbered 1, 2, ... aligned with
  ``inputs``, 0 on padding (the model confines attention within an example);
* ``mask`` bool [B, seq_len]: True where the target is a trained token of the input's own
  example: never across two examples, never on padding.

:func:`instruct_dataset` is finite with ``epochs`` (each epoch reshuffled with
``DataConfig.seed``; the last batch filled with empty rows) or endless without; its iterator
is checkpointable (``get_state`` / ``set_state``) like the pre-training stream's.
"""

from __future__ import annotations

import itertools
import os
from typing import Optional

import grain
import numpy as np

from dagmoe_jax.data.chat import ChatEncoder, hf_template
from dagmoe_jax.data.config import DataConfig, check_process, local_batch_size, parse_source
from dagmoe_jax.data.packing import global_batches
from dagmoe_jax.data.splits import eval_source, train_records
from dagmoe_jax.data.tokenizers import Tokenizer
from dagmoe_jax.data.workers import finish_stream

READ_OPTIONS = dict(num_threads=2, prefetch_buffer_size=64)


def is_instruct(cfg: DataConfig) -> bool:
    """Whether ``cfg.source`` is an ``instruct:`` source."""
    return parse_source(cfg.source)[0] == "instruct"


def chat_encoder(cfg: DataConfig, tokenizer: Tokenizer) -> ChatEncoder:
    """The :class:`ChatEncoder` that ``cfg.chat_template`` names (see :class:`DataConfig`)."""
    if cfg.chat_template == "plain":
        return ChatEncoder(tokenizer)
    if cfg.chat_template != "auto":
        path = os.path.expanduser(cfg.chat_template)
        if not os.path.isfile(path):
            raise ValueError(f"DataConfig.chat_template={cfg.chat_template!r} is not 'auto', "
                             "'plain' or a jinja file: point it at one")
        with open(path, encoding="utf-8") as f:
            template = f.read()
        bos, eos = (hf_template(cfg.tokenizer_path)[1:] if cfg.tokenizer == "hf"
                    else ("", ""))
        return ChatEncoder(tokenizer, template, bos, eos)
    if cfg.tokenizer == "hf":
        template, bos, eos = hf_template(cfg.tokenizer_path)
        if template:
            return ChatEncoder(tokenizer, template, bos, eos)
    return ChatEncoder(tokenizer)


class EncodeExample:
    """conversation -> {'tokens', 'weights'} int32, truncated to ``max_len`` tokens (a
    picklable grain map function)."""

    def __init__(self, encoder: ChatEncoder, max_len: int):
        self.encoder, self.max_len = encoder, int(max_len)

    def __call__(self, messages) -> dict:
        ids, weights = self.encoder.encode(messages)
        return {"tokens": np.asarray(ids[:self.max_len], np.int32),
                "weights": np.asarray(weights[:self.max_len], np.int32)}


class _Zeros:
    """length -> an example of that many zero tokens (to count batches without tokenizing)."""

    def __call__(self, n) -> dict:
        return {"tokens": np.zeros(int(n), np.int32), "weights": np.zeros(int(n), np.int32)}


def shift_packed(tokens, segment_ids, weights=None) -> dict:
    """A packed row (or rows) of seq_len + 1 -> ``inputs``, ``targets``, ``segment_ids`` and
    ``mask``: a target is trained iff it is in the input's own example (same nonzero segment
    id) and, with ``weights``, its weight is nonzero."""
    seg = np.asarray(segment_ids, np.int32)
    mask = (seg[..., 1:] != 0) & (seg[..., 1:] == seg[..., :-1])
    if weights is not None:
        mask &= np.asarray(weights)[..., 1:] != 0
    return {"inputs": np.asarray(tokens[..., :-1], np.int32),
            "targets": np.asarray(tokens[..., 1:], np.int32), "mask": mask,
            "segment_ids": seg[..., :-1]}


class _ShiftPacked:
    def __call__(self, row: dict) -> dict:
        return shift_packed(row["tokens"], row["tokens_segment_ids"], row["weights"])


class _FillBatch:
    """A batch of fewer than ``rows`` rows (the last of a finite stream) filled with empty
    rows (token 0, segment 0, mask False)."""

    def __init__(self, rows: int):
        self.rows = int(rows)

    def __call__(self, batch: dict) -> dict:
        n = next(iter(batch.values())).shape[0]
        if n == self.rows:
            return batch
        return {k: np.concatenate([v, np.zeros((self.rows - n,) + v.shape[1:], v.dtype)])
                for k, v in batch.items()}


class _PadExample:
    """An example -> a row of ``width`` tokens holding it alone (segment 1), padded with
    segment 0: the unpacked row of ``DataConfig.packing = False``."""

    def __init__(self, width: int):
        self.width = int(width)

    def __call__(self, ex: dict) -> dict:
        n = len(ex["tokens"])
        pad = lambda x: np.pad(np.asarray(x, np.int32), (0, self.width - n))  # noqa: E731
        return {"tokens": pad(ex["tokens"]), "weights": pad(ex["weights"]),
                "tokens_segment_ids": pad(np.ones(n, np.int32))}


def _packed(ds: grain.MapDataset, cfg: DataConfig, batch: int, epochs: Optional[int],
            encode) -> grain.IterDataset:
    """Batches of ``epochs`` passes over ``ds``: examples packed first fit into rows, or one
    per row when ``cfg.packing`` is False."""
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(epochs).map(encode)
    width = cfg.seq_len + 1
    if not cfg.packing:
        ds = ds.map(_PadExample(width))
    it = ds.to_iter_dataset(grain.ReadOptions(**READ_OPTIONS))
    if cfg.packing:
        it = grain.experimental.FirstFitPackIterDataset(
            it, length_struct={"tokens": width, "weights": width}, num_packing_bins=batch,
            seed=cfg.seed, shuffle_bins=cfg.shuffle)
    return it.map(_ShiftPacked()).batch(batch, drop_remainder=False).map(_FillBatch(batch))


def instruct_dataset(cfg: DataConfig, tokenizer: Tokenizer, *, epochs: Optional[int] = None,
                     process_index: int = 0, process_count: int = 1,
                     vocab_size: Optional[int] = None) -> grain.IterDataset:
    """This process's SFT batches (module docstring): ``epochs`` passes over its training
    records (None: endless), each pass in a new order from ``cfg.seed`` (unless
    ``cfg.shuffle`` is False). Packing bins are flushed as a pass goes on, so the last batch
    of a pass may hold examples of the next. ``iter(ds)`` is checkpointable like
    :func:`~dagmoe_jax.data.pipeline.train_dataset`'s (same ``worker_count`` to resume), and
    its batches' ids are checked against ``vocab_size`` as theirs are."""
    batch = local_batch_size(cfg, process_count)
    records = train_records(cfg, process_index=process_index, process_count=process_count)
    encode = EncodeExample(chat_encoder(cfg, tokenizer), cfg.seq_len + 1)
    it = _packed(records, cfg, batch, epochs, encode)
    return finish_stream(it, cfg.worker_count, vocab_size)


def instruct_stats(cfg: DataConfig, tokenizer: Tokenizer, *, epochs: int,
                   process_count: int = 1) -> dict:
    """What ``epochs`` passes of :func:`instruct_dataset` hold, found by tokenizing every
    training record once and packing their lengths the same way: ``examples`` (all
    processes'), ``truncated`` (examples longer than seq_len + 1), ``trained_tokens`` (per
    pass, after truncation), ``tokens`` (per pass) and ``batches`` (the fewest over the
    processes: what every process can step)."""
    encode = EncodeExample(chat_encoder(cfg, tokenizer), 10**9)
    local = local_batch_size(cfg, process_count)
    stats = {"examples": 0, "truncated": 0, "trained_tokens": 0, "tokens": 0}
    batches = []
    for p in range(process_count):
        records = train_records(cfg, process_index=p, process_count=process_count)
        lengths = []
        for i in range(len(records)):
            ex = encode(records[i])
            n = min(len(ex["tokens"]), cfg.seq_len + 1)
            lengths.append(n)
            stats["truncated"] += int(len(ex["tokens"]) > n)
            stats["trained_tokens"] += int(ex["weights"][1:n].sum())
            stats["tokens"] += n
        stats["examples"] += len(lengths)
        shapes = _packed(grain.MapDataset.source(np.asarray(lengths)), cfg.replace(
            worker_count=0), local, epochs, _Zeros())
        batches.append(sum(1 for _ in shapes))
    stats["batches"] = min(batches)
    return stats


def instruct_eval_batches(cfg: DataConfig, tokenizer: Tokenizer, *,
                          max_batches: Optional[int] = None, process_index: int = 0,
                          process_count: int = 1) -> list:
    """The evaluation conversations (:func:`~dagmoe_jax.data.splits.eval_source`) in order,
    each truncated to seq_len + 1 tokens and packed whole into rows by grain's first-fit
    packer with one bin (next fit: a new row when an example does not fit), grouped in global
    batches of ``batch_size`` rows (the last filled with empty rows) of which this process
    keeps its block of rows (:func:`~dagmoe_jax.data.packing.global_batches`). Same keys as
    :func:`instruct_dataset`; deterministic."""
    check_process(process_index, process_count)
    local_batch_size(cfg, process_count)
    width = cfg.seq_len + 1
    examples = grain.MapDataset.source(eval_source(cfg)).map(
        EncodeExample(chat_encoder(cfg, tokenizer), width))
    rows = grain.experimental.FirstFitPackIterDataset(       # one bin: next fit, in order
        examples.to_iter_dataset(), length_struct={"tokens": width, "weights": width},
        num_packing_bins=1, shuffle_bins=False).map(_ShiftPacked())
    limit = None if max_batches is None else int(max_batches) * cfg.batch_size
    return global_batches(itertools.islice(rows, limit), cfg.batch_size, process_index,
                          process_count)
