"""Validated input-pipeline configuration.

``DataConfig`` is a frozen dataclass of plain fields (str / int / float / bool), so gin can bind
it like the model configs. It checks itself in ``__post_init__``: an invalid value raises a
one-line ``ValueError`` naming the field and what it accepts. Sources are spec strings
``KIND:ARG`` (see :func:`parse_source`).
"""

from __future__ import annotations

import dataclasses
import math
import os

from dagmoe_jax.validate import check

from dagmoe_jax.data.formats import FORMATS, check_format
from dagmoe_jax.data.tasks import TASKS

SOURCE_KINDS = ("synthetic", "text", "jsonl", "parquet", "array_record", "tfds", "instruct",
                "mix")
MIXABLE = ("synthetic", "text", "jsonl", "parquet", "array_record", "tfds")
TOKENIZERS = ("byte", "sentencepiece", "hf")
_SOURCE_HELP = ("'synthetic:<task>[,<task>...]', 'text:<glob>[,<glob>...]', "
                "'jsonl:<glob>[,...]', 'parquet:<glob>[,...]', 'array_record:<glob>[,...]', "
                "'tfds:<name>', 'instruct:<glob>[,...]' or 'mix:<w>*<spec>,<w>*<spec>[,...]'")
CHAT_TEMPLATES = ("auto", "plain")
TRUNCATIONS = ("head", "llamafactory")          # data.instruct.truncate_example


def _check(ok: bool, field: str, value, valid: str) -> None:
    check(ok, "DataConfig", field, value, valid)


def _int(field: str, value, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    ok = ok and (high is None or value < high)
    _check(ok, field, value, f"an integer >= {low}" + ("" if high is None else f" and < {high}"))


def _str(field: str, value, nonempty: bool = True) -> None:
    _check(isinstance(value, str) and (bool(value) or not nonempty), field, value,
           "a non-empty string" if nonempty else "a string")


def parse_source(spec: str, field: str = "source") -> tuple[str, tuple[str, ...]]:
    """Split a source spec ``KIND:ARG`` into ``(kind, args)``.

    ``synthetic``, ``text``, ``jsonl`` and ``array_record`` take comma-separated arguments (task
    names or file globs; so paths cannot contain commas); ``tfds`` takes one dataset name
    (which may itself contain commas, e.g. builder keyword arguments); ``mix`` takes weighted
    sources (:func:`mix_components`), returned as ``'<weight>*<spec>'`` strings. Task names
    are checked against :data:`~dagmoe_jax.data.tasks.TASKS`. Errors name
    ``DataConfig.<field>``.
    """
    kind, sep, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    _check(bool(sep) and kind in SOURCE_KINDS, field, spec, _SOURCE_HELP)
    if kind == "mix":
        return kind, tuple(f"{w!r}*{s}" for w, s in mix_components(rest, field, spec))
    if kind == "tfds":
        args = (rest.strip(),) if rest.strip() else ()
    else:
        args = tuple(a.strip() for a in rest.split(",") if a.strip())
    _check(bool(args), field, spec, f"a non-empty argument after '{kind}:' ({_SOURCE_HELP})")
    if kind == "synthetic":
        for name in args:
            _check(name in TASKS, field, spec,
                   f"task names from {', '.join(map(repr, TASKS))} (unknown task {name!r})")
    return kind, args


def mix_components(rest: str, field: str = "source", spec: str = "", *,
                   normalise: bool = True) -> list:
    """[(weight, source spec)] of a ``mix:`` spec's argument ``rest``: comma-separated
    ``<weight>*<spec>`` items (a comma inside a component's own arguments stays with it), the
    weights positive and normalised to sum to 1 (``normalise=False``: as written), each spec a
    pre-training source (:data:`MIXABLE`), e.g.
    ``0.5*parquet:slimpajama/*.parquet,0.5*jsonl:metamath/*.jsonl``."""
    items = []
    for piece in rest.split(","):
        head = piece.split("*", 1)[0].strip()
        try:
            weight = float(head) if "*" in piece else None
        except ValueError:
            weight = None
        if weight is None:
            _check(bool(items) and bool(piece.strip()), field, spec,
                   "'mix:<weight>*<source>,<weight>*<source>...' (a weight first)")
            items[-1][1] += "," + piece
        else:
            items.append([weight, piece.split("*", 1)[1].strip()])
    _check(len(items) >= 1, field, spec, "at least one '<weight>*<source>' after 'mix:'")
    total = sum(w for w, _ in items)
    for weight, sub in items:
        _check(weight > 0 and math.isfinite(weight), field, spec,
               f"positive weights (got {weight:g})")
        kind = parse_source(sub, field)[0]
        _check(kind in MIXABLE, field, spec,
               f"mixed sources of kinds {', '.join(MIXABLE)} (not {kind!r})")
    return [(w / total if normalise else w, sub) for w, sub in items]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized, and how it is batched.

    source: training data spec (default ``'synthetic:lis,edit_distance'``):
      ``synthetic:<tasks>`` (built-in DP tasks, :mod:`dagmoe_jax.data.tasks`),
      ``text:<globs>`` (plain text files; documents separated by blank lines),
      ``jsonl:<globs>`` (one JSON object per line, text under ``text_key``),
      ``parquet:<globs>`` (column ``text_key`` of Parquet files, the Hub's format),
      ``mix:<w>*<spec>,<w>*<spec>...`` (pre-training sources drawn in proportion to their
      weights, each shuffled and repeated on its own, e.g. CoE's 1:1
      ``mix:0.5*parquet:slimpajama/*.parquet,0.5*jsonl:metamath/*.jsonl``; evaluation reads
      each component's held-out records in the same proportions),
      ``array_record:<globs>`` (each record utf-8 text, or a JSON object with ``text_key``),
      ``tfds:<name>`` (a TFDS dataset already prepared in ``tfds_data_dir``; its ``text_key``
      feature, bytes decoded as utf-8), ``instruct:<globs>`` (instruction records in JSON-lines,
      JSON-array, Parquet or ArrayRecord files, for fine-tuning: :mod:`dagmoe_jax.data.instruct`, read by
      ``instruct_format``, formatted by ``chat_template``, the loss on the assistant's tokens
      only). Globs are comma separated and expanded in sorted order.
    eval_source: held-out data spec, same syntax; '' (default) means the held-out records of
      ``source`` (for ``synthetic``: a separate stream of ``num_synthetic_eval`` examples).
    split: the TFDS split to train on (default 'train'; ignored by the other kinds).
    eval_split: the TFDS split to evaluate on, e.g. 'validation'; '' (default) holds out
      ``heldout_fraction`` of ``split`` instead. Only for a ``tfds`` source / eval_source.
    heldout_fraction: fraction of the records of ``source`` held out for evaluation when
      neither ``eval_source`` nor ``eval_split`` is set (default 0.05; at least one record;
      always the same, evenly spaced records, independent of ``seed``). 0: every record
      trains (as LlamaFactory and the DAG-MoE paper fine-tune) and, without ``eval_source``,
      the run has no held-out evaluation. Not used for ``synthetic`` sources.
    text_key: the JSON key / TFDS feature holding the text (default 'text').
    tfds_data_dir: TFDS ``data_dir``; '' (default) means TFDS's default (``$TFDS_DATA_DIR`` or
      ``~/tensorflow_datasets``). Nothing is ever downloaded.
    tokenizer: 'byte' (default; utf-8 bytes, vocabulary 256), 'sentencepiece' or 'hf'
      (a HuggingFace ``tokenizers`` tokenizer.json).
    tokenizer_path: the SentencePiece model file or tokenizer.json (default ''; required for
      'sentencepiece' and 'hf').
    eos_token: the end-of-sequence token of a 'sentencepiece' / 'hf' tokenizer; '' (default)
      uses the model's own EOS (SentencePiece) or the first of '</s>', '<|endoftext|>',
      '<eos>' in the vocabulary (HF).
    seq_len: tokens per training row (default 256); windows of seq_len + 1 tokens give inputs
      and targets shifted by one.
    batch_size: GLOBAL rows per batch (default 16); each of P processes gets batch_size // P,
      so it must divide by the process count (checked when a pipeline is built).
    seed: shuffle seed (default 0; in [0, 2**32)); each epoch is reshuffled.
    shuffle: shuffle the training records (default True).
    synthetic_seed: seed of the synthetic examples' content (default 0), independent of
      ``seed`` so that runs with different shuffles see the same data and the same eval set.
    num_synthetic: records in the synthetic training split (default 200,000).
    num_synthetic_eval: records in the synthetic held-out split (default 512).
    task_min_size, task_max_size: synthetic problem sizes are uniform in this range (default
      4..12), for training and for evaluation.
    worker_count: grain worker processes for the training pipeline (default 0: in-process).
    topics_dir: DoE only: a saved topic model (:mod:`dagmoe_jax.families.doe.topics`) to label the
      data with; '' (default) fits online LDA on the training documents when the run starts. Either
      way the run keeps its copy in ``<run_dir>/topics`` and a resume uses that.
    packing: ``instruct:`` sources only: True (default) packs whole examples first fit into
      rows of seq_len + 1 (segment ids keep them apart); False puts one example per row, padded
      (LlamaFactory's default, so ``batch_size`` counts examples: N examples over E epochs are
      ceil(E N / batch_size) steps).
    truncation: ``instruct:`` sources only: how an example longer than seq_len + 1 tokens is
      cut: 'llamafactory' (default) turn by turn, each turn's prompt and answer shortened in
      proportion as LlamaFactory's ``infer_seqlen`` does, so a long prompt keeps a share of
      its answer; 'head' keeps its first seq_len + 1 tokens.
    """

    source: str = "synthetic:lis,edit_distance"
    eval_source: str = ""
    split: str = "train"
    eval_split: str = ""
    heldout_fraction: float = 0.05
    text_key: str = "text"
    tfds_data_dir: str = ""
    tokenizer: str = "byte"
    tokenizer_path: str = ""
    eos_token: str = ""
    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    shuffle: bool = True
    synthetic_seed: int = 0
    num_synthetic: int = 200_000
    num_synthetic_eval: int = 512
    task_min_size: int = 4
    task_max_size: int = 12
    worker_count: int = 0
    topics_dir: str = ""
    segment_packing: bool = False
    packing: bool = True
    truncation: str = "llamafactory"
    instruct_format: str = "auto"
    chat_template: str = "auto"

    def __post_init__(self):
        kind, _ = parse_source(self.source, "source")
        _str("eval_source", self.eval_source, nonempty=False)
        eval_kind = parse_source(self.eval_source, "eval_source")[0] if self.eval_source else kind
        _str("split", self.split)
        _str("eval_split", self.eval_split, nonempty=False)
        _check(not self.eval_split or eval_kind == "tfds", "eval_split", self.eval_split,
               f"'' unless the eval data is a tfds source (it is {eval_kind!r})")
        _check(isinstance(self.heldout_fraction, (int, float))
               and not isinstance(self.heldout_fraction, bool)
               and 0 <= self.heldout_fraction < 1, "heldout_fraction", self.heldout_fraction,
               "a number in [0, 1) (0: no hold-out)")
        _str("text_key", self.text_key)
        _str("tfds_data_dir", self.tfds_data_dir, nonempty=False)
        _check(self.tokenizer in TOKENIZERS, "tokenizer", self.tokenizer,
               "one of " + ", ".join(map(repr, TOKENIZERS)))
        _str("tokenizer_path", self.tokenizer_path, nonempty=False)
        _check(self.tokenizer == "byte" or bool(self.tokenizer_path), "tokenizer_path",
               self.tokenizer_path, f"the path of the model file when tokenizer={self.tokenizer!r}")
        _str("eos_token", self.eos_token, nonempty=False)
        _int("seq_len", self.seq_len, 1)
        _int("batch_size", self.batch_size, 1)
        _int("seed", self.seed, 0, 2**32)
        _check(isinstance(self.shuffle, bool), "shuffle", self.shuffle, "True or False")
        _int("synthetic_seed", self.synthetic_seed, 0, 2**32)
        _int("num_synthetic", self.num_synthetic, 1)
        _int("num_synthetic_eval", self.num_synthetic_eval, 1)
        _int("task_min_size", self.task_min_size, 1)
        _int("task_max_size", self.task_max_size, self.task_min_size)
        _int("worker_count", self.worker_count, 0)
        _str("topics_dir", self.topics_dir, nonempty=False)
        _check(isinstance(self.segment_packing, bool), "segment_packing", self.segment_packing,
               "True or False")
        _check(isinstance(self.packing, bool), "packing", self.packing, "True or False")
        _check(self.truncation in TRUNCATIONS, "truncation", self.truncation,
               " or ".join(map(repr, TRUNCATIONS)))
        _check(check_format(self.instruct_format), "instruct_format", self.instruct_format,
               "one of " + ", ".join(map(repr, FORMATS)))
        _str("chat_template", self.chat_template)

    def with_absolute_paths(self) -> "DataConfig":
        """This config with a relative ``tokenizer_path`` made absolute (``~`` expanded), as a
        run records it, so that the run is read from any working directory. Cloud paths and
        an empty path are kept."""
        path = self.tokenizer_path
        if not path or "://" in path:
            return self
        absolute = os.path.abspath(os.path.expanduser(path))
        return self if absolute == path else self.replace(tokenizer_path=absolute)

    def replace(self, **changes) -> "DataConfig":
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def check_process(process_index: int, process_count: int) -> None:
    """One-line ``ValueError`` unless ``0 <= process_index < process_count``."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (process_index, process_count))
    if not (ok and 0 <= process_index < process_count):
        raise ValueError(f"process_index={process_index!r}, process_count={process_count!r} is "
                         "invalid: expected integers with 0 <= process_index < process_count")


def local_batch_size(cfg: DataConfig, process_count: int) -> int:
    """``cfg.batch_size // process_count``; a one-line ``ValueError`` if it does not divide."""
    check_process(0, process_count)
    _check(cfg.batch_size % process_count == 0, "batch_size", cfg.batch_size,
           f"a multiple of the process count {process_count} (it is the global batch)")
    return cfg.batch_size // process_count
