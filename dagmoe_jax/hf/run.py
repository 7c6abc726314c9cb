"""A Hugging Face Llama folder read as a run (``hf:FOLDER``): the model of
:func:`~dagmoe_jax.hf.llama.load_hf_llama` with the folder's own tokenizer, and
:func:`open_run`, the one way every command reads a run (sampling, evaluation, the harness,
export, analysis, upcycling): a run directory or ``hf:FOLDER``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.data import DataConfig
from dagmoe_jax.data.tokenizers import make_tokenizer
from dagmoe_jax.hf.llama import PathLike, load_hf_llama, model_config_from_hf, read_hf_config
from dagmoe_jax.parallel import place_on_mesh
from dagmoe_jax.run.config import OptimConfig, RunConfig
from dagmoe_jax.run.directory import LoadedRun, load_configs, load_run

HF_PREFIX = "hf:"


def folder_tokenizer(folder: Path) -> Path:
    """The ``tokenizer.json`` of the Hugging Face Llama ``folder``, which a run made of it
    reads text with; a one-line ValueError where the folder is no model (its ``config.json``)
    or has no ``tokenizer.json``."""
    read_hf_config(folder)
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"{tokenizer_json} does not exist: a Hugging Face folder is read with "
                         "its own tokenizer.json (save it with the model: "
                         "tokenizer.save_pretrained(folder))")
    return tokenizer_json


def hf_data_config(path: PathLike) -> DataConfig:
    """The DataConfig a Hugging Face Llama folder is read with as a run: its own
    ``tokenizer.json`` (:func:`folder_tokenizer`), windows of at most the model's context."""
    folder = Path(str(path)).expanduser().resolve()
    context = model_config_from_hf(read_hf_config(folder)).max_seq_len
    return DataConfig(tokenizer="hf", tokenizer_path=str(folder_tokenizer(folder)),
                      seq_len=min(context, DataConfig().seq_len))


def load_hf_run(path: PathLike, *, execution: Optional[ExecutionConfig] = None,
                data_cfg: Optional[DataConfig] = None, **overrides):
    """A Hugging Face Llama folder as a :class:`~dagmoe_jax.run.LoadedRun` (step 0): the model
    of :func:`load_hf_llama` with the folder's ``tokenizer.json`` (its BOS, EOS and chat
    template read from ``tokenizer_config.json``, as for a run trained with it;
    :func:`hf_data_config`, or ``data_cfg``), so that what reads a run directory reads the
    folder as it is. One-line ValueError without a ``tokenizer.json``."""
    folder = Path(str(path)).expanduser().resolve()
    data_cfg = data_cfg or hf_data_config(folder)
    model, cfg = load_hf_llama(folder, execution=execution, **overrides)
    return LoadedRun(model=model, step=0, model_cfg=cfg, data_cfg=data_cfg,
                     optim_cfg=OptimConfig(), run_cfg=RunConfig(),
                     tokenizer=make_tokenizer(data_cfg), warnings=[])


def is_hf(path: PathLike) -> bool:
    """Whether ``path`` names a Hugging Face folder (``hf:FOLDER``) rather than a run."""
    return str(path).startswith(HF_PREFIX)


def hf_folder(path: PathLike) -> str:
    """The folder ``hf:FOLDER`` names (:func:`is_hf`); any other path as it is."""
    return str(path)[len(HF_PREFIX):] if is_hf(path) else str(path)


def run_data_config(path: PathLike) -> DataConfig:
    """The DataConfig of the run at ``path`` (a run directory or ``hf:FOLDER``), without
    loading its model."""
    if is_hf(path):
        return hf_data_config(hf_folder(path))
    return load_configs(path)[1]


def open_run(path: PathLike, *, mesh=None, data_cfg: Optional[DataConfig] = None,
             tokenizer_path: str = "",
             log: Callable[[str], None] = lambda _message: None) -> LoadedRun:
    """The run at ``path`` as every command reads one: a run directory's newest checkpoint
    (:func:`~dagmoe_jax.run.load_run`), or, spelled ``hf:FOLDER``, a Hugging Face Llama
    folder (:func:`load_hf_run`). ``mesh``: the parameters placed in their logical shardings
    over it; ``data_cfg``: the data config to attach instead of the run's own;
    ``tokenizer_path``: the tokenizer file to read instead of the one the run recorded (a
    copy of it, where that one cannot be found: the run's record refuses another file)."""
    if tokenizer_path:
        data_cfg = (data_cfg or run_data_config(path)).replace(
            tokenizer_path=os.path.abspath(os.path.expanduser(tokenizer_path)))
    if not is_hf(path):
        return load_run(path, mesh=mesh, data_cfg=data_cfg, log=log)
    run = load_hf_run(hf_folder(path), data_cfg=data_cfg)
    if mesh is not None:
        place_on_mesh(run.model, mesh)
    return run
