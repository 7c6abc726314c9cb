"""Instruction fine-tuning (SFT) batches: conversations packed whole, the loss on the
assistant's tokens only.

An ``instruct:`` source's records (:mod:`~dagmoe_jax.data.instruct_records`) are formatted
and tokenized by :class:`~dagmoe_jax.data.chat.ChatEncoder` into token ids and 0/1 loss
weights (1 on the assistant's tokens and the EOS ending each assistant turn). An example
longer than ``seq_len + 1`` tokens is cut as ``DataConfig.truncation`` says (the count is
reported by :func:`instruct_stats`): its first ``seq_len + 1`` tokens ('head'), or turn by
turn as LlamaFactory cuts, prompt and answer in proportion ('llamafactory'). Examples are
packed whole, first fit (``grain.experimental.FirstFitPackIterDataset``, one bin per batch
row), never split across rows; with ``DataConfig.packing = False`` each row holds one
example, padded. Every batch holds:

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
from dagmoe_jax.data.eval_batching import global_batches
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


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple:
    """(source, target) lengths kept of a turn within ``cutoff_len`` tokens, as LlamaFactory
    (``data/processor/processor_utils.py``) decides: a short answer is kept whole and the
    prompt cut, a short prompt is kept whole and the answer cut, else both in proportion."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def turns(weights) -> list:
    """[(start, source_end, end)] of a tokenized conversation: each turn's untrained tokens
    (the prompt, the template's headers) [start, source_end) and its trained ones (the answer
    up to its last trained token) [source_end, end); a last turn with no answer has
    source_end == end."""
    w = np.asarray(weights) != 0
    out, start, n = [], 0, len(w)
    while start < n:
        first = start + int(np.argmax(w[start:])) if w[start:].any() else n
        end = first
        while end < n and w[end]:
            end += 1
        out.append((start, first, end))
        start = end
    return out


def truncate_example(ids, weights, max_len: int, how: str = "head") -> tuple:
    """(ids, weights) of a tokenized conversation cut to at most ``max_len`` tokens: 'head'
    keeps the first ``max_len``; 'llamafactory' cuts turn by turn as LlamaFactory's
    supervised processor does (each turn's prompt and answer shortened by
    :func:`infer_seqlen` within what the earlier turns left, each kept from its start), so a
    long prompt keeps a share of its answer."""
    ids, weights = list(ids), list(weights)
    if len(ids) <= max_len or how == "head":
        return ids[:max_len], weights[:max_len]
    kept_ids, kept_w, left = [], [], max_len
    for start, source_end, end in turns(weights):
        if left <= 0:
            break
        s, t = infer_seqlen(source_end - start, end - source_end, left)
        keep = list(range(start, start + s)) + list(range(source_end, source_end + t))
        kept_ids += [ids[i] for i in keep]
        kept_w += [weights[i] for i in keep]
        left -= s + t
    return kept_ids, kept_w


class EncodeExample:
    """conversation -> {'tokens', 'weights'} int32, cut to ``max_len`` tokens as
    ``truncation`` says (:func:`truncate_example`; a picklable grain map function)."""

    def __init__(self, encoder: ChatEncoder, max_len: int, truncation: str = "head"):
        self.encoder, self.max_len, self.truncation = encoder, int(max_len), truncation

    def __call__(self, messages) -> dict:
        ids, weights = truncate_example(*self.encoder.encode(messages), self.max_len,
                                        self.truncation)
        return {"tokens": np.asarray(ids, np.int32), "weights": np.asarray(weights, np.int32)}


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
    encode = EncodeExample(chat_encoder(cfg, tokenizer), cfg.seq_len + 1, cfg.truncation)
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
            ids, weights = truncate_example(ex["tokens"], ex["weights"], cfg.seq_len + 1,
                                            cfg.truncation)
            n = len(ids)
            lengths.append(n)
            stats["truncated"] += int(len(ex["tokens"]) > n)
            stats["trained_tokens"] += int(np.sum(weights[1:]))
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
    keeps its block of rows (:func:`~dagmoe_jax.data.eval_batching.global_batches`). Same keys
    as :func:`instruct_dataset`; deterministic."""
    check_process(process_index, process_count)
    local_batch_size(cfg, process_count)
    width = cfg.seq_len + 1
    examples = grain.MapDataset.source(eval_source(cfg)).map(
        EncodeExample(chat_encoder(cfg, tokenizer), width, cfg.truncation))
    rows = grain.experimental.FirstFitPackIterDataset(       # one bin: next fit, in order
        examples.to_iter_dataset(), length_struct={"tokens": width, "weights": width},
        num_packing_bins=1, shuffle_bins=False).map(_ShiftPacked())
    limit = None if max_batches is None else int(max_batches) * cfg.batch_size
    return global_batches(itertools.islice(rows, limit), cfg.batch_size, process_index,
                          process_count)
