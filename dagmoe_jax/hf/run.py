"""A Hugging Face Llama folder read as a run (``hf:FOLDER``): the model of
:func:`~dagmoe_jax.hf.llama.load_hf_llama` with the folder's own tokenizer, for what reads run
directories (the harness, sampling)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dagmoe_jax.config import ExecutionConfig
from dagmoe_jax.data import DataConfig
from dagmoe_jax.data.tokenizers import make_tokenizer
from dagmoe_jax.hf.llama import PathLike, load_hf_llama, read_hf_config
from dagmoe_jax.run.config import OptimConfig, TrainConfig
from dagmoe_jax.run.directory import LoadedRun

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


def load_hf_run(path: PathLike, *, execution: Optional[ExecutionConfig] = None, **overrides):
    """A Hugging Face Llama folder as a :class:`~dagmoe_jax.run.LoadedRun` (step 0): the model
    of :func:`load_hf_llama` with the folder's ``tokenizer.json`` (its BOS, EOS and chat
    template read from ``tokenizer_config.json``, as for a run trained with it), so that what
    reads a run directory (the harness's ``run_dir='hf:FOLDER'``, sampling) reads the folder
    as it is. One-line ValueError without a ``tokenizer.json``."""
    folder = Path(str(path)).expanduser().resolve()
    tokenizer_json = folder_tokenizer(folder)
    model, cfg = load_hf_llama(folder, execution=execution, **overrides)
    data_cfg = DataConfig(tokenizer="hf", tokenizer_path=str(tokenizer_json),
                          seq_len=min(cfg.max_seq_len, DataConfig().seq_len))
    return LoadedRun(model=model, step=0, model_cfg=cfg, data_cfg=data_cfg,
                     optim_cfg=OptimConfig(), train_cfg=TrainConfig(),
                     tokenizer=make_tokenizer(data_cfg), warnings=[])
