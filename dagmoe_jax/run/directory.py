"""A run directory, read and written in one place.

A run written by ``train.py`` (:func:`dagmoe_jax.train.loop.train`) or by the upcycling
command (:mod:`dagmoe_jax.upcycle`) holds ``config.json`` (the
four configs the run was started with, and the execution config as settled on the machine
that wrote it), ``checkpoints/`` (Orbax, model and optimizer state with the data iterator's
position), ``metrics.jsonl`` and, when gin was used, ``operative_config.gin``. Training,
evaluation, sampling, analysis and the benchmarks all go through the functions here:

* :func:`save_configs` / :func:`load_configs`: ``config.json``;
* :func:`load_run`: the newest readable checkpoint as a :class:`LoadedRun` (model, step,
  configs, tokenizer), on one device or sharded over a mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, Union

from etils import epath
from flax import nnx

from dagmoe_jax.validate import first_line
from dagmoe_jax.data import make_tokenizer
from dagmoe_jax.data.tokenizers import check_tokenizer_record, tokenizer_record
from dagmoe_jax.parallel import activate
from dagmoe_jax.config import BLOCK_TYPES, ExecutionConfig, ModelConfig
from dagmoe_jax.data import DataConfig
from dagmoe_jax.parallel import MeshConfig
from dagmoe_jax.run.state import build, train_state
from dagmoe_jax.run.checkpoint import Checkpointer
from dagmoe_jax.run.checkpoint_files import STATE_KEYS, flatten_json, json_diffs
from dagmoe_jax.run.paths import as_path, is_remote, run_path
from dagmoe_jax.run.config import OptimConfig, RunConfig

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
# GB of arrays Orbax encodes at once while writing a step 0 beside the model it holds (an
# upcycle's merged MoE, an import): its default, 96, holds a copy of all of a smaller model.
INITIAL_SAVE_GB = 1
OPERATIVE_GIN = "operative_config.gin"
PathLike = Union[str, Path]


def prepare_run_dir(run_dir: PathLike) -> epath.Path:
    """Create ``run_dir`` (and its parents) for a training run, or say in one line why it
    cannot be: a cloud URI whose filesystem package is missing
    (:func:`dagmoe_jax.run.paths.run_path`; then nothing is written anywhere), it is a
    file, it lies under a file, or the filesystem refuses (read-only, permissions, full). Local
    paths, ``file://`` and cloud URIs (``gs://bucket/run``) all go through ``etils.epath``."""
    path = run_path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--run_dir={run_dir} is a file, not a directory: choose another path")
    if not is_remote(path):                   # object stores have no files above a "directory"
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise ValueError(f"--run_dir={run_dir} lies under {parent}, which is a file: "
                                     f"choose another path")
                break
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write the run directory {run_dir} ({err.strerror or err}): "
                         f"choose a writable path") from None
    return path


def configs_to_json(model_cfg, data_cfg, optim_cfg, run_cfg,
                    settled: Optional[ExecutionConfig] = None, tokenizer_file: str = "") -> dict:
    """The JSON of ``config.json``: the four configs, plus the execution config as this
    machine settled ``run_cfg.execution`` (a record: a run reads its own ``execution``).
    ``tokenizer_file``: where the tokenizer's file is read now, if not yet at its path
    (:func:`~dagmoe_jax.data.tokenizers.tokenizer_record`)."""
    blob = {"model": dataclasses.asdict(model_cfg), "data": dataclasses.asdict(data_cfg),
            "optim": dataclasses.asdict(optim_cfg), "run": dataclasses.asdict(run_cfg),
            "tokenizer": tokenizer_record(data_cfg, tokenizer_file)}
    if settled is not None:
        blob["settled_execution"] = dataclasses.asdict(settled)
    return blob


def configs_from_json(blob: dict):
    """(ModelConfig, DataConfig, OptimConfig, RunConfig) from :func:`configs_to_json`'s
    output, or an earlier version's: the execution choices earlier versions kept in the model
    config move to ``RunConfig.execution`` (:meth:`ModelConfig.saved_execution`), and their
    settled model config, a record of one machine, is read only to migrate what they settled
    per machine (:meth:`ModelConfig.migrate`)."""
    run = dict(blob["run"] if "run" in blob else blob["train"])   # "train": before RunConfig
    run["mesh"] = MeshConfig(**run.get("mesh", {}))
    run["execution"] = ExecutionConfig(**{**ModelConfig.saved_execution(blob["model"]),
                                          **run.get("execution", {})})
    # A field added with a default that changes what an old run did is read as that run did:
    # truncation arrived as 'llamafactory'; runs written before it cut their examples' heads.
    data = {"truncation": "head", **blob["data"]}
    return (ModelConfig.from_dict(blob["model"], blob.get("settled_model")),
            DataConfig(**data), OptimConfig(**blob["optim"]), RunConfig(**run))


def save_configs(run_dir: PathLike, model_cfg, data_cfg, optim_cfg, run_cfg,
                 settled: Optional[ExecutionConfig] = None,
                 tokenizer_file: str = "") -> epath.Path:
    """Write ``run_dir/config.json``; returns its path. ``tokenizer_file``: as
    :func:`configs_to_json` reads it."""
    path = as_path(run_dir) / CONFIG_FILE
    blob = configs_to_json(model_cfg, data_cfg, optim_cfg, run_cfg, settled, tokenizer_file)
    path.write_text(json.dumps(blob, indent=2) + "\n")
    return path


def save_operative_gin(run_dir: PathLike, text: str) -> None:
    """Write gin's operative config (every binding a run used) as ``operative_config.gin``."""
    if text:
        (as_path(run_dir) / OPERATIVE_GIN).write_text(text)


def config_bindings(obj, fields: Optional[Sequence[str]] = None) -> List[str]:
    """gin bindings (lines) reproducing the config ``obj``, the configs it holds with it;
    ``fields``: those of ``obj``'s own fields alone."""
    lines = []

    def bind(obj, name, only=None):
        for field in dataclasses.fields(obj):
            if not field.init or (only is not None and field.name not in only):
                continue              # derived, not an argument (a block config's ``kind``)
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                sub = type(value).__name__
                lines.append(f"{name}.{field.name} = @{sub}()")
                bind(value, sub)
            else:
                lines.append(f"{name}.{field.name} = {value!r}")

    bind(obj, type(obj).__name__, fields)
    return lines


def configs_to_gin(model_cfg, data_cfg, optim_cfg, run_cfg) -> str:
    """gin bindings reproducing the four configs (for ``train.py --gin_file``)."""
    return "\n".join(line for obj in (model_cfg, data_cfg, optim_cfg, run_cfg)
                     for line in config_bindings(obj)) + "\n"


# A run's own copy of its tokenizer (``RUN/tokenizer/``): the file it reads text with and,
# where they exist beside it, the files transformers and dagmoe_jax.data.tokenizers read with
# it, so that the run does not depend on the folder they came from.
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")


def copy_tokenizer(data_cfg: DataConfig, run_dir: PathLike) -> DataConfig:
    """``data_cfg`` reading its tokenizer from ``run_dir``'s own copy (:data:`TOKENIZER_DIR`):
    the file at ``tokenizer_path`` and the :data:`TOKENIZER_FILES` beside it are copied there.
    ``data_cfg`` as it is for the byte tokenizer, or a file in that folder already."""
    if not data_cfg.tokenizer_path:
        return data_cfg
    source = Path(os.path.expanduser(data_cfg.tokenizer_path)).resolve()
    target = as_path(run_dir) / TOKENIZER_DIR
    if not is_remote(target) and source.parent == Path(str(target)).resolve():
        return data_cfg
    target.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys((source.name, *TOKENIZER_FILES)):
        if (source.parent / name).is_file():
            (target / name).write_bytes((source.parent / name).read_bytes())
    return data_cfg.replace(tokenizer_path=str(target / source.name))


def own_tokenizer(data_cfg: DataConfig, run_dir: PathLike) -> DataConfig:
    """``data_cfg`` of the run at ``run_dir`` reading the run's own copy of its tokenizer
    (:func:`copy_tokenizer`) where the recorded file is gone (the run, or the folder it came
    from, has moved); else as it is."""
    path = data_cfg.tokenizer_path
    if not path or os.path.exists(os.path.expanduser(path)):
        return data_cfg
    copy = as_path(run_dir) / TOKENIZER_DIR / os.path.basename(path)
    return data_cfg.replace(tokenizer_path=str(copy)) if copy.exists() else data_cfg


def save_resume_gin(run_dir: PathLike, model_cfg, data_cfg, optim_cfg, run_cfg, *,
                    name: str = "resume.gin") -> epath.Path:
    """Write a gin file that continues the run (``train.py --gin_file=RUN/<name>``)."""
    path = as_path(run_dir) / name
    path.write_text(configs_to_gin(model_cfg, data_cfg, optim_cfg, run_cfg))
    return path


def save_initial_checkpoint(run_dir: PathLike, model, optimizer, model_cfg: ModelConfig,
                            run_cfg: RunConfig, data_iterator) -> None:
    """Save ``model`` and ``optimizer`` as step 0 of a run that training continues (with the
    data iterator's position), as a run made by another command than ``train.py`` starts.
    ``optimizer=None``: the model's state alone (meta ``state_keys=['model']``), written from
    ``model``'s own arrays, whatever their dtype (bfloat16 ones are cast to the model's dtype
    when read); the run that resumes it creates fresh optimizer state, and evaluation,
    sampling and ``init_from`` read it like any checkpoint. No second copy of the model is
    made here, and Orbax encodes at most :data:`INITIAL_SAVE_GB` GB of it at once."""
    if optimizer is None:
        state = {"model": nnx.state(model)}
        meta = {**model_meta(model_cfg), STATE_KEYS: ["model"]}
    else:
        state, meta = train_state(model, optimizer), model_meta(model_cfg)
    with Checkpointer(as_path(run_dir) / CHECKPOINT_DIR, save_every=run_cfg.save_every,
                      keep=run_cfg.keep_checkpoints, async_save=False,
                      save_concurrent_gb=INITIAL_SAVE_GB) as checkpointer:
        checkpointer.save(0, state, data_iterator=data_iterator, meta=meta, force=True)


def load_configs(run_dir: PathLike, with_record: bool = False):
    """The four configs a run was started with (from its ``config.json``; the tokenizer read
    from the run's own copy where the recorded file is gone, :func:`own_tokenizer`); with
    ``with_record``, also the file's record of the tokenizer the run trained with
    (:func:`~dagmoe_jax.data.tokenizers.tokenizer_record`; None for an earlier version's run),
    from the same read of the file."""
    path = run_path(run_dir) / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"{path} does not exist: is {run_dir} a run directory written by train.py?")
    try:
        blob = json.loads(path.read_text())
        configs = configs_from_json(blob)
    except (TypeError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a config this version of dagmoe_jax can read "
                         f"({first_line(err)}): use the version that wrote the run, or fix the "
                         f"file") from None
    model_cfg, data_cfg, optim_cfg, run_cfg = configs
    configs = (model_cfg, own_tokenizer(data_cfg, run_dir), optim_cfg, run_cfg)
    return (*configs, blob.get("tokenizer")) if with_record else configs


# DataConfig fields that do not change the training stream (evaluation, workers): a resumed run may
# change them.
NON_STREAM_DATA_FIELDS = tuple(f"DataConfig.{name}" for name in
                               ("eval_source", "eval_split", "num_synthetic_eval", "worker_count"))


def _diff_key(diff: str) -> str:
    """The dotted key a :func:`json_diffs` line is about."""
    return diff.split(" ", 1)[0]


def resume_changes(run_dir: PathLike, model_cfg: ModelConfig, data_cfg: DataConfig,
                   saved_meta: dict) -> Tuple[List[str], List[str]]:
    """What differs between a run's checkpoint and the configs it is being resumed with:
    (architecture changes of the ModelConfig against the checkpoint's metadata ``saved_meta``
    (:func:`model_meta`); DataConfig changes since the run's ``config.json`` was written).
    Execution choices an earlier version saved with the model (:meth:`ModelConfig.migrate`
    drops them) are not changes. A field the checkpoint lacks (written by an earlier version)
    is read at its default, which every new field keeps equal to the behaviour before it
    existed."""
    saved = ModelConfig.migrate(saved_meta.get("model_config") or {})
    expected = dataclasses.asdict(model_cfg)
    family = saved["block"].get("kind", "moe")        # the saved family's defaults
    defaults = ModelConfig(block=family if family in BLOCK_TYPES else "moe")
    with_defaults = {**flatten_json(dataclasses.asdict(defaults)), **flatten_json(saved)}
    changed = {_diff_key(d) for d in json_diffs(with_defaults, expected, "model_config")}
    model = ["ModelConfig." + d[len("model_config."):]
             for d in json_diffs(saved, expected, "model_config")      # worded from the file
             if _diff_key(d) in changed]
    data = []
    if (as_path(run_dir) / CONFIG_FILE).exists():
        try:
            _, old_data, _, _ = load_configs(run_dir)
            data = [c for c in json_diffs(dataclasses.asdict(old_data),
                                          dataclasses.asdict(data_cfg), "DataConfig")
                    if _diff_key(c) not in NON_STREAM_DATA_FIELDS]
        except ValueError:                           # another library version's config.json
            data = ["config.json is not readable by this version"]
    return model, data


def model_meta(model_cfg: ModelConfig) -> dict:
    """The metadata a checkpoint is saved with and checked against on restore."""
    return {"model_config": dataclasses.asdict(model_cfg)}


@dataclasses.dataclass
class LoadedRun:
    """A trained model from a run directory, with what is needed to talk to it.

    model: the Transformer with the checkpoint's parameters (running as the run's
    ``run_cfg.execution`` settled for this machine: ``model.execution``);
    step: the checkpoint's step; model_cfg: the model config (``model.cfg``);
    data_cfg, optim_cfg, run_cfg: the run's other configs; tokenizer: from ``data_cfg``;
    warnings: messages about unreadable newer checkpoints that were skipped.
    """

    model: nnx.Module
    step: int
    model_cfg: ModelConfig
    data_cfg: DataConfig
    optim_cfg: OptimConfig
    run_cfg: RunConfig
    tokenizer: object
    warnings: List[str]


def load_run(run_dir: PathLike, mesh=None, data_cfg: Optional[DataConfig] = None,
             log: Callable[[str], None] = lambda _message: None) -> LoadedRun:
    """Load the newest readable checkpoint of a ``train.py`` run directory, read-only: nothing
    in the directory is changed, so a run may be evaluated or sampled while it trains.

    mesh: None builds only abstract shapes (no initialisation) on one device; a mesh builds the
    model and optimizer sharded over it (parameters restored into that layout, whatever mesh
    the run trained on). The optimizer's state is read with the model's where the checkpoint
    holds it (an upcycled or imported run's step 0 holds the model alone). data_cfg: the data
    config to attach (default: the run's own), e.g. with another evaluation source. log:
    hears about slow work while the model is settled (compiling the CPU attention kernel).
    One-line ValueErrors for a missing run directory or config, and for a run without
    checkpoints.
    """
    run_dir = run_path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the --run_dir of a "
                         f"train.py run")
    model_cfg, run_data_cfg, optim_cfg, run_cfg, record = load_configs(run_dir,
                                                                          with_record=True)
    data_cfg = data_cfg or run_data_cfg
    check_tokenizer_record(record, data_cfg, str(run_dir))
    tokenizer = make_tokenizer(data_cfg)

    def make():
        model, optimizer, _ = build(model_cfg, optim_cfg, run_cfg, mesh, log=log)
        return model, optimizer

    # On one device only the shapes are built; on a mesh the sharded arrays themselves, whose
    # shapes and shardings ``restore`` reads.
    model, optimizer = nnx.eval_shape(make) if mesh is None else make()
    abstract = train_state(model, optimizer)
    with Checkpointer(run_dir / CHECKPOINT_DIR, save_every=run_cfg.save_every,
                      keep=run_cfg.keep_checkpoints, async_save=False,
                      read_only=True) as checkpointer, \
            (contextlib.nullcontext() if mesh is None else activate(mesh)):
        restored = checkpointer.restore(abstract, expected_meta=model_meta(model_cfg))
    if restored is None:
        raise ValueError(f"no checkpoint in {run_dir / CHECKPOINT_DIR}: train first")
    nnx.update(model, restored.state["model"])
    return LoadedRun(model=model, step=restored.step, model_cfg=model.cfg, data_cfg=data_cfg,
                     optim_cfg=optim_cfg, run_cfg=run_cfg, tokenizer=tokenizer,
                     warnings=list(restored.skipped))
