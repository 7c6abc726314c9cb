"""Starting a run from trained parameters (``RunConfig.init_from``): fine-tuning.

* ``''``: nothing (parameters initialised from ``RunConfig.seed``);
* a run directory (``train.py`` or upcycling): the parameters of its newest checkpoint;
* ``hf:<folder>``: a Hugging Face Llama folder (``config.json`` + safetensors), imported by
  :func:`~dagmoe_jax.hf.llama.load_hf_llama`.

:func:`source_data_config` gives the run's tokenizer: the source's (its BOS, EOS and chat
template with it), unless ``RunConfig.tokenizer_from_source`` is False; a gin binding naming
another tokenizer is otherwise a one-line error.
:func:`source_model_config` gives the run's ModelConfig: the source's (how the model runs,
``RunConfig.execution``, stays the gin config's); a gin binding that changes the
architecture (a field differing from both ModelConfig's default and the source's value) is a
one-line error. Two exceptions: how routers are trained (``ROUTER_TRAINING_FIELDS``: balance
losses, auxiliary-loss-free balancing) is the gin config's; an MoE source and a DAG-MoE or
CoE gin config give the source converted at its outputs (:mod:`dagmoe_jax.families.moe.conversion`;
the gin config's DAG module or chain, the source's router and experts).
:func:`load_initial_params` copies the source's parameters (and its routers' selection
biases) into the freshly built (possibly sharded) model; the optimiser keeps its fresh state.
Both are one-line ``ValueError`` s for a path that is neither a run directory
nor a Hugging Face folder.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable, Optional

import jax
from flax import nnx

from dagmoe_jax import run as run_lib
from dagmoe_jax.config import ROUTER_TRAINING_FIELDS, ModelConfig, RouterConfig, router_of
from dagmoe_jax.data import DataConfig
from dagmoe_jax.hf.llama import load_hf_llama, model_config_from_hf, read_hf_config
from dagmoe_jax.hf.run import hf_folder, is_hf
from dagmoe_jax.families.moe.conversion import converted_config, converted_params, is_conversion
from dagmoe_jax.model.routed.router import SelectionBias
from dagmoe_jax.run.checkpoint_files import flatten_json

def _hf_folder(init_from: str) -> str:
    folder = os.path.expanduser(hf_folder(init_from))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"RunConfig.init_from={init_from!r}: {folder!r} has no config.json: "
                         "point 'hf:' at a Hugging Face Llama folder")
    return folder


def _run_dir(init_from: str) -> str:
    path = os.path.expanduser(init_from)
    if not os.path.isfile(os.path.join(path, run_lib.CONFIG_FILE)):
        raise ValueError(f"RunConfig.init_from={init_from!r} is not a run directory (no "
                         f"{run_lib.CONFIG_FILE}): give a train.py run directory, 'hf:<folder>' "
                         "for a Hugging Face model, or '' for a fresh start")
    return path


def source_model_config(init_from: str, model_cfg: ModelConfig) -> ModelConfig:
    """The ModelConfig of a run initialised from ``init_from`` (module docstring)."""
    if is_hf(init_from):
        source = model_config_from_hf(read_hf_config(_hf_folder(init_from)))
    else:
        source = run_lib.load_configs(_run_dir(init_from))[0]
    blank = ModelConfig()
    if is_conversion(source, model_cfg.block):      # an MoE asked to become DAG-MoE or CoE
        source = converted_config(source, model_cfg.block)
        blank = ModelConfig(block=type(model_cfg.block)())
    source = _router_training(source, model_cfg)
    arch = lambda cfg: flatten_json(dataclasses.asdict(cfg))  # noqa: E731
    default, given, have = arch(blank), arch(model_cfg), arch(source)
    conflicts = [f"ModelConfig.{k}={given[k]!r} (the source has {have.get(k)!r})"
                 for k in sorted(given) if given[k] != default.get(k) and given[k] != have.get(k)]
    if conflicts:
        raise ValueError(f"RunConfig.init_from={init_from!r} has another architecture than "
                         f"the gin config: {'; '.join(conflicts)}: drop those bindings (the "
                         "model comes from the source)")
    return source


def _router_training(source: ModelConfig, model_cfg: ModelConfig) -> ModelConfig:
    """``source`` with the gin config's router-training fields (``ROUTER_TRAINING_FIELDS``:
    balance losses, auxiliary-loss-free balancing) where it binds them: how the fine-tuned
    run trains its routers, which computes what the source computed."""
    ours, theirs = router_of(model_cfg.block), router_of(source.block)
    if ours is None or theirs is None:
        return source
    changes = {f: getattr(ours, f) for f in ROUTER_TRAINING_FIELDS
               if getattr(ours, f) != getattr(RouterConfig(), f)}
    if not changes:
        return source
    return dataclasses.replace(source, block=dataclasses.replace(
        source.block, router=dataclasses.replace(theirs, **changes)))


# The DataConfig fields that say how text becomes ids: a fine-tuned run reads them from its
# source (RunConfig.tokenizer_from_source).
TOKENIZER_FIELDS = ("tokenizer", "tokenizer_path", "eos_token", "chat_template")


def _source_tokenizer(init_from: str) -> dict:
    """The tokenizer fields of ``init_from``'s DataConfig: a run's own (its path made absolute,
    relative paths read from the run directory), or a Hugging Face folder's tokenizer.json
    (else its SentencePiece tokenizer.model)."""
    if is_hf(init_from):
        folder = os.path.abspath(_hf_folder(init_from))
        for name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
            if os.path.isfile(os.path.join(folder, name)):
                return {"tokenizer": kind, "tokenizer_path": os.path.join(folder, name),
                        "eos_token": "", "chat_template": "auto"}
        raise ValueError(f"RunConfig.init_from={init_from!r}: {folder} has neither "
                         "tokenizer.json nor tokenizer.model, so the run cannot read text as "
                         "the model was trained to: save the tokenizer into the folder, or set "
                         "RunConfig.tokenizer_from_source=False and bind DataConfig.tokenizer")
    run_dir = _run_dir(init_from)
    source = run_lib.load_configs(run_dir)[1]
    fields = {name: getattr(source, name) for name in TOKENIZER_FIELDS}
    path = fields["tokenizer_path"]
    if path and not os.path.isabs(os.path.expanduser(path)):
        beside = os.path.join(run_dir, path)
        fields["tokenizer_path"] = os.path.abspath(beside if os.path.exists(beside) else path)
    return fields


def source_data_config(init_from: str, data_cfg: DataConfig,
                       tokenizer_from_source: bool = True,
                       bound: Optional[Iterable[str]] = None) -> DataConfig:
    """``data_cfg`` with ``init_from``'s tokenizer (:data:`TOKENIZER_FIELDS`). A field bound in
    ``data_cfg`` that differs from the source's is a one-line error, unless
    ``tokenizer_from_source`` is False, which keeps ``data_cfg`` as it is. ``bound``: the
    DataConfig fields the caller was given (a command's gin config,
    :func:`~dagmoe_jax.run.gin.bound_fields`), so that a binding to the default's value counts
    too; None: the fields that differ from the default. The chat template is the source's
    only where the source chose one (a pre-trained run's 'auto' leaves this run's own)."""
    if not init_from or not tokenizer_from_source:
        return data_cfg
    source, default = _source_tokenizer(init_from), DataConfig()
    if source["chat_template"] == default.chat_template:
        # A source that chose no template (a pre-trained run) leaves the choice to this run.
        source["chat_template"] = data_cfg.chat_template
    given = (set(bound) if bound is not None else
             {k for k in source if getattr(data_cfg, k) != getattr(default, k)})
    conflicts = [f"DataConfig.{k}={getattr(data_cfg, k)!r} (the source has {v!r})"
                 for k, v in source.items()
                 if k in given and getattr(data_cfg, k) != v
                 and not (k == "tokenizer_path" and _same_file(getattr(data_cfg, k), v))]
    if conflicts:
        raise ValueError(f"RunConfig.init_from={init_from!r} was trained with another "
                         f"tokenizer than the gin config's: {'; '.join(conflicts)}: drop those "
                         "bindings (the run reads text as its source did), or set "
                         "RunConfig.tokenizer_from_source=False to train with another one")
    return dataclasses.replace(data_cfg, **source)


def source_bindings(init_from: str, model_cfg: ModelConfig, data_cfg: DataConfig) -> str:
    """gin bindings of what a run initialised from ``init_from`` took from it: its ModelConfig
    and tokenizer (:data:`TOKENIZER_FIELDS`, as the run reads them: its own copy of the
    file), under a comment naming the source. Appended to the run's ``operative_config.gin``
    they override the bindings above them, so that file and ``config.json`` describe the
    same run."""
    lines = [f"\n# Taken from RunConfig.init_from = {init_from!r} (these override the "
             "bindings above):",
             *run_lib.config_bindings(model_cfg),
             *run_lib.config_bindings(data_cfg, TOKENIZER_FIELDS)]
    return "\n".join(lines) + "\n"


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except OSError:
        return False


# What a fine-tuned run takes from its source: the parameters, and the routers' selection
# biases (auxiliary-loss-free balancing), without which the source's tokens go elsewhere.
CARRIED = nnx.Any(nnx.Param, SelectionBias)


def _source_params(init_from: str, log: Callable[[str], None]):
    """(the source's carried variables {path: array}, its ModelConfig, what it is)."""
    if is_hf(init_from):
        model, cfg = load_hf_llama(_hf_folder(init_from))
        what = "the Hugging Face checkpoint"
    else:
        loaded = run_lib.load_run(_run_dir(init_from), log=log)
        model, cfg, what = loaded.model, loaded.model_cfg, f"step {loaded.step}"
    flat = nnx.to_flat_state(nnx.state(model, CARRIED))
    return {tuple(path): v[...] for path, v in flat}, cfg, what


def load_initial_params(model: nnx.Module, init_from: str,
                        log: Callable[[str], None] = lambda _message: None) -> str:
    """Set ``model``'s parameters (and selection biases) to those of ``init_from``, each placed
    with the sharding of the variable it replaces; returns a one-line description of what was
    loaded. A model that converts its MoE source (:func:`source_model_config`) takes the
    converted parameters (:mod:`dagmoe_jax.families.moe.conversion`), and those the source has no
    counterpart of (the DAG module; selection biases, zero) keep their initialisation."""
    have, source_cfg, what = _source_params(init_from, log)
    target = dict(nnx.to_flat_state(nnx.state(model, CARRIED)))
    converting = is_conversion(source_cfg, model.cfg.block)
    if converting:
        have = dict(converted_params(have.items(), source_cfg, model.cfg))
        what += f", converted to {model.cfg.block.label}"
    # What the source has no counterpart of keeps its initialisation: a conversion's new
    # parameters (the DAG module), and selection biases a source without them starts at zero.
    fresh = {path for path in set(target) - set(have)
             if converting or isinstance(target[path], SelectionBias)}
    if fresh:
        what += f", {sum(target[p][...].size for p in fresh):,} new values initialised"
    if set(target) - fresh != set(have):
        missing = sorted(set(target) - fresh ^ set(have), key=str)[:3]
        raise ValueError(f"RunConfig.init_from={init_from!r}: its parameters differ from the "
                         f"model's (e.g. {['/'.join(map(str, p)) for p in missing]})")
    for path, variable in target.items():
        if path in fresh:
            continue
        value, old = have[path], variable[...]
        if value.shape != old.shape:
            raise ValueError(f"RunConfig.init_from={init_from!r}: parameter "
                             f"{'/'.join(map(str, path))} has shape {value.shape}, the model "
                             f"{old.shape}")
        variable[...] = jax.device_put(value.astype(old.dtype), old.sharding)
    nnx.update(model, nnx.from_flat_state(target))
    count = sum(v[...].size for v in target.values() if isinstance(v, nnx.Param))
    return f"initialised {count:,} parameters from {init_from} ({what})"
