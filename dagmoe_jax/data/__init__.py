"""Input pipeline: sources of text, tokenizers, and grain pipelines of packed batches.

``DataConfig`` says where text comes from (synthetic DP tasks, text / jsonl / ArrayRecord
files, or a prepared TFDS dataset), how it is tokenized and batched. ``train_dataset`` is the
endless, checkpointable training stream; ``eval_batches`` the held-out data;
``task_eval_batches`` the synthetic tasks' examples whose answers evaluation scores;
``unigram_entropy`` is the baseline a model's held-out loss should beat.
Every stream yields the one typed batch of :mod:`~dagmoe_jax.data.batch`.
"""

from dagmoe_jax.data.batch import MODEL_INPUTS, Batch
from dagmoe_jax.data.config import DataConfig, parse_source
from dagmoe_jax.data.pipeline import (eval_batches, task_eval_batches, task_names,
                                      train_dataset, unigram_entropy)
from dagmoe_jax.data.splits import eval_source, train_records, train_source
from dagmoe_jax.data.tasks import TASKS, Example, generate
from dagmoe_jax.data.tokenizers import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                        Tokenizer, check_tokens, make_tokenizer)

__all__ = ["Batch", "MODEL_INPUTS", "DataConfig", "parse_source", "make_tokenizer", "Tokenizer",
           "ByteTokenizer",
           "SentencePieceTokenizer", "HFTokenizer", "train_dataset", "eval_batches",
           "task_eval_batches", "task_names", "check_tokens", "unigram_entropy", "train_records",
           "train_source", "eval_source",
           "TASKS", "Example", "generate"]
