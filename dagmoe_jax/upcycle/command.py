"""The work behind ``python -m dagmoe_jax.upcycle``: dense checkpoints -> a DUME run directory.

:func:`load_dense` reads a dense model from a ``train.py`` run directory or a Hugging Face
Llama directory; :func:`build_dume` merges N of them and solves the routers from one data
source per domain; :func:`write_run` writes a run directory that ``train.py --mode=eval``,
``python -m dagmoe_jax.cli.sample`` and the analysis accept, and that ``train.py`` continues
(DUME+ router training, or DAG training after ``--dag_dim``) from its ``resume.gin``.
Library code: progress goes to the ``progress`` callbacks, nothing is printed here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
from flax import nnx

from dagmoe_jax import run as run_lib
from dagmoe_jax.config import ModelConfig
from dagmoe_jax.families.dense.config import DenseConfig
from dagmoe_jax.data import DataConfig, make_tokenizer, train_records
from dagmoe_jax.data.config import parse_source
from dagmoe_jax.data.instruct import instruct_dataset, is_instruct
from dagmoe_jax.data.pipeline import train_dataset
from dagmoe_jax.model.settle import settle
from dagmoe_jax.run.config import RunConfig
from dagmoe_jax.run.config import OptimConfig
from dagmoe_jax.run.optim import check_trainable
from dagmoe_jax.run.paths import staged_directory
from dagmoe_jax.upcycle import dume as dume_lib
from dagmoe_jax.evaluation import padded_width
from dagmoe_jax.hf import llama as hf_llama
from dagmoe_jax.upcycle import moerge, stream
from dagmoe_jax.upcycle.ridge import DEFAULT_LAMBDA, DomainStatistics

MERGE_DTYPES = ("float32", "bfloat16")    # what build_dume holds the merged parameters in
STATS_DIR = "dume_stats"
SUMMARY_FILE = "dume.json"
RESUME_GIN = "resume.gin"

# DUME+ / BTX router training (the authors' clm_moerging_strategies_eval.py: --lr 1e-4,
# --num_steps 1000, 10 warm-up steps, cosine annealing); no weight decay on the routers (ours).
ROUTER_OPTIM = OptimConfig(learning_rate=1e-4, schedule="cosine", warmup_steps=10,
                           weight_decay=0.0)


@dataclasses.dataclass
class DenseSource:
    """A dense model read by :func:`load_dense`: the model, its model config, and the
    DataConfig it was trained with (None for a Hugging Face directory)."""

    model: nnx.Module
    cfg: ModelConfig
    data_cfg: Optional[DataConfig]


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model directory (``config.json`` with
    ``model_type``), which :func:`build_dume` can merge by streaming."""
    config = Path(path) / "config.json"
    try:
        return config.is_file() and "model_type" in json.loads(config.read_text())
    except json.JSONDecodeError:
        return False


def load_dense(path: str) -> DenseSource:
    """A dense model from a ``train.py`` run directory (its newest checkpoint) or a Hugging
    Face Llama directory (``config.json`` with ``model_type``); a one-line error otherwise."""
    directory = Path(path)
    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"{config} does not exist: pass a train.py run directory or a Hugging "
                         f"Face Llama directory")
    try:
        blob = json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config} is not valid JSON ({err.msg})") from None
    if "model_type" in blob:
        model, cfg = hf_llama.load_hf_llama(directory)
        return DenseSource(model, cfg, None)
    loaded = run_lib.load_run(directory)
    model_cfg = run_lib.load_configs(directory)[0]
    if not isinstance(model_cfg.block, DenseConfig):
        raise ValueError(f"{path} holds a block={model_cfg.block.kind!r} model: DUME merges dense "
                         f"models (block='dense')")
    return DenseSource(loaded.model, model_cfg, loaded.data_cfg)


def domain_data(base: DataConfig, source: str) -> DataConfig:
    """``base`` reading ``source`` (one domain), for the statistics pass."""
    return dataclasses.replace(base, source=source, eval_source="", shuffle=True)


def mixed_data(base: DataConfig, sources: Sequence[str]) -> DataConfig:
    """``base`` reading every domain's source (the mixed stream DUME+ trains on). The sources
    must be of one kind taking comma-separated arguments (``synthetic:`` tasks, ``text:``,
    ``jsonl:``, ``array_record:`` or ``instruct:`` globs), or all the same spec."""
    kinds = {parse_source(s, "source")[0] for s in sources}
    if len(set(sources)) == 1:
        return dataclasses.replace(base, source=sources[0], eval_source="")
    if len(kinds) != 1 or "tfds" in kinds:
        raise ValueError(f"domain sources {list(sources)} cannot be mixed into one stream: give "
                         f"sources of one kind among synthetic:, text:, jsonl:, array_record:, "
                         f"instruct:")
    kind = kinds.pop()
    globs = [",".join(parse_source(s, "source")[1]) for s in sources]
    return dataclasses.replace(base, source=f"{kind}:{','.join(globs)}", eval_source="")


def domain_batches(data_cfg: DataConfig, num_batches: int):
    """The first ``num_batches`` training batches of ``data_cfg`` (a one-line error for a
    source with no data). An ``instruct:`` source (DUME's reasoning setting: statistics from
    instruction data in the experts' chat format) gives its conversations rendered and packed
    as fine-tuning packs them, one pass, and every real token counts, the prompt's included
    (the router sees the prompt before it sees any reply)."""
    tokenizer = make_tokenizer(data_cfg)
    if is_instruct(data_cfg):
        stream = ({**b, "mask": b["segment_ids"] != 0}
                  for b in instruct_dataset(data_cfg, tokenizer, epochs=1))
    else:
        stream = iter(train_dataset(data_cfg, tokenizer))
    batches = list(itertools.islice(stream, num_batches))
    if not batches:
        raise ValueError(f"DataConfig.source={data_cfg.source!r} gave no batches: a domain "
                         f"needs data for its statistics")
    return batches


STATS_EXAMPLES = 2048     # the authors' --max_num_samples (reasoning_generate_dume_params.py)
STATS_TOKENS = 1024       # the authors' --num_dume_tokens: the first tokens of each example


def prompt_text(record) -> str:
    """The text DUME's authors collect statistics from (``utils.get_context``): an instruction
    record's first user turn (Alpaca's instruction and input, a question, a prompt), not the
    template or the answer; a pre-training record's text as it is."""
    if isinstance(record, str):
        return record
    return next((m["content"] for m in record if m["role"] == "user"), "")


def prompt_batches(data_cfg: DataConfig, *, max_examples: int = STATS_EXAMPLES,
                   max_tokens: int = STATS_TOKENS, rows: int = 4) -> list:
    """Statistics batches as the authors collect them (``reasoning_generate_dume_params.py``):
    the first ``max_examples`` records of the domain's source (its training records; the
    evaluated split itself when ``--source`` names it, the authors' ``use_test_distribution``),
    each record's prompt text alone (:func:`prompt_text`) tokenized with what the tokenizer
    adds (a Llama 3 tokenizer its BOS), its first ``max_tokens`` tokens one row of its own,
    ``rows`` examples per batch, right-padded with a mask, so every example counts its own
    tokens. (The authors' padded positions are EOS tokens their pass also runs through; the
    mask here counts real tokens only.)"""
    tokenizer = make_tokenizer(data_cfg)
    records = train_records(data_cfg.replace(shuffle=False))
    ids = []
    for i in range(min(len(records), max_examples)):
        row = tokenizer.encode(prompt_text(records[i]), add_special_tokens=True)[:max_tokens]
        if row:
            ids.append(row)
    if not ids:
        raise ValueError(f"DataConfig.source={data_cfg.source!r} has no prompt text: a domain "
                         "needs data for its statistics")
    batches = []
    for start in range(0, len(ids), rows):
        chunk = ids[start:start + rows]
        # few compiled shapes: every batch has ``rows`` rows, its width a power of two
        width = padded_width(max(map(len, chunk)), max_tokens)
        inputs = np.full((rows, width), tokenizer.pad_id, np.int32)
        mask = np.zeros((rows, width), bool)
        for r, row in enumerate(chunk):
            inputs[r, :len(row)], mask[r, :len(row)] = row, True
        batches.append({"inputs": inputs, "mask": mask})
    return batches


def build_dume(dense: Sequence[Union[DenseSource, str]],
               batches_per_domain: Sequence[Callable[[], list]], *,
               top_k: int = 1, temperature: float = 1.0, lam: float = DEFAULT_LAMBDA,
               tokens_per_sequence: Optional[int] = None,
               router: str = "dume", seed: int = 0, dtype: str = "float32",
               progress: Callable[[int, int, int], None] = lambda _d, _b, _t: None
               ) -> Tuple[nnx.Module, ModelConfig, List[DomainStatistics]]:
    """The merged MoE of ``dense`` with DUME routers (``router='dume'``) or random ones
    ('random': the random-routing baseline and BTX's start). ``dense``: loaded models, or
    Hugging Face directories merged one tensor at a time (:func:`stream.moerge_hf`: the merged
    MoE plus one parameter's transient copies in memory). ``batches_per_domain[j]()`` gives
    domain j's statistics batches; ``progress(domain, batches, tokens)`` hears after each.
    ``dtype='bfloat16'``: the merged parameters are held in bfloat16 (half the memory; the
    shared means are taken in float64, then rounded); the statistics pass runs those weights
    in the config's compute dtype (float32, each layer's weights cast inside the pass), so its
    MLP inputs are the bfloat16 model's, accumulated into ``X~^T X~`` in float32 as always
    (:func:`dume_lib.accumulate_on_device`). (Computing the pass in bfloat16 as well moved
    the tests' routers ten times further from the float32 upcycle's, for no memory.) Returns
    (model, MoE config, per-domain statistics; empty for 'random'); the config is the float32
    one a run is written with (the model's own ``cfg`` has ``param_dtype=dtype``)."""
    if router not in ("dume", "random"):
        raise ValueError(f"router={router!r} is invalid: expected 'dume' or 'random'")
    if dtype not in MERGE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: expected one of {MERGE_DTYPES}")
    if len(batches_per_domain) != len(dense):
        raise ValueError(f"{len(dense)} dense models but {len(batches_per_domain)} data "
                         f"sources: give one source per model")
    streamed = all(isinstance(d, str) for d in dense)
    if streamed:
        dense_cfg = stream.read_configs(dense)
    else:
        moerge.check_same_architecture([d.cfg for d in dense])
        dense_cfg = dense[0].cfg
    cfg = moerge.dume_config(dense_cfg, len(dense), top_k=top_k, temperature=temperature)
    held = cfg if dtype == "float32" else cfg.replace(param_dtype=dtype)
    execution = settle(held)
    moe = (stream.moerge_hf(dense, held, execution=execution, seed=seed) if streamed else
           moerge.moerge([d.model for d in dense], held, execution=execution, seed=seed))
    stats: List[DomainStatistics] = []
    if router == "dume":
        for j, batches in enumerate(batches_per_domain):
            stats.append(dume_lib.collect_statistics(
                moe, batches(), j, tokens_per_sequence=tokens_per_sequence,
                progress=lambda b, t, j=j: progress(j, b, t)))
        dume_lib.dume(moe, stats, lam)
    return moe, cfg, stats


def default_trainable(model_cfg: ModelConfig) -> str:
    """What a DUME run's continuation trains by default: 'router' (DUME+, DUME sec. 3.1) at
    top_k >= 2; at top_k = 1 'router_and_gates' (the authors' set: the renormalised gate of the
    single chosen expert is 1, so the router gets no gradient and only the experts' ``w_gate``
    learn; :data:`TOP1_NOTE`); 'all' for a DAG (its aggregator starts inert)."""
    if model_cfg.block.aggregation.kind != "sum":
        return "all"
    return "router" if model_cfg.block.router.top_k >= 2 else "router_and_gates"


TOP1_NOTE = ("note: at --top_k=1 the softmax gate of the one chosen expert is always 1, so the "
             "router gets no gradient and DUME+ (router only) cannot train: resume.gin trains "
             "the routers and the experts' w_gate (the authors' set); --top_k=2 gives DUME+")


def write_run(run_dir: str, model: nnx.Module, model_cfg: ModelConfig, data_cfg: DataConfig,
              *, steps: int = 1000, trainable: Optional[str] = None,
              optim_cfg: OptimConfig = ROUTER_OPTIM, stats: Sequence[DomainStatistics] = (),
              summary: Optional[dict] = None) -> Path:
    """A run directory holding ``model``'s parameters as step 0 (with the mixed data stream's
    position), ``config.json``, the per-domain statistics, ``dume.json`` and ``resume.gin``
    (``train.py --gin_file=RUN/resume.gin`` trains it for ``steps`` steps).
    ``trainable`` (``RunConfig.trainable``): default :func:`default_trainable`.

    The checkpoint is written from ``model``'s own arrays: no second model and no optimizer
    state are built (the run that resumes creates its optimizer state fresh,
    :func:`dagmoe_jax.run.save_initial_checkpoint`), so writing adds no model-sized memory.
    ``model`` may hold bfloat16 parameters (``--dtype=bfloat16``): they are written as they
    are, and the run reading them casts them to ``model_cfg.param_dtype`` (float32 master
    weights). ``model_cfg`` is the configuration the run is written with.

    ``run_dir`` (local, absent or an empty directory) is written whole or not at all: into a
    hidden sibling moved there when complete (:func:`dagmoe_jax.run.paths.staged_directory`)."""
    if trainable is None:
        trainable = default_trainable(model_cfg)
    check_trainable(model_cfg, trainable)
    if optim_cfg.warmup_steps >= steps:       # a short continuation: warm up within it
        optim_cfg = dataclasses.replace(optim_cfg, warmup_steps=steps - 1)
    target = Path(run_dir).expanduser().resolve()
    run_cfg = RunConfig(run_dir=str(target), steps=steps, trainable=trainable,
                        save_every=max(1, steps))
    tokenizer = make_tokenizer(data_cfg)
    iterator = iter(instruct_dataset(data_cfg, tokenizer) if is_instruct(data_cfg)
                    else train_dataset(data_cfg, tokenizer))       # what resume.gin reads
    with staged_directory(target) as path:      # moved to target when complete
        run_lib.save_initial_checkpoint(path, model, None, model_cfg, run_cfg, iterator)
        run_lib.save_configs(path, model_cfg, data_cfg, optim_cfg, run_cfg,
                             settled=model.execution)
        run_lib.save_resume_gin(path, model_cfg, data_cfg, optim_cfg, run_cfg,
                                name=RESUME_GIN)
        if stats:
            (path / STATS_DIR).mkdir(exist_ok=True)
            for j, s in enumerate(stats):
                s.save(path / STATS_DIR / f"domain_{j}.npz")
        (path / SUMMARY_FILE).write_text(json.dumps(summary or {}, indent=1) + "\n")
    return target
