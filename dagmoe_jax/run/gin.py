"""Loading configs from gin files and bindings (T5X style).

``load_model_config`` gives the :class:`ModelConfig` alone (notebooks, benchmarks);
``load_configs`` gives all four configs of a training run (model, data, optimiser, loop).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path
from typing import Iterable, Sequence, Tuple

import gin

from dagmoe_jax import config as C
from dagmoe_jax.budget import matched_coe_shared_hidden
from dagmoe_jax.validate import first_line
from dagmoe_jax.config import ModelConfig
from dagmoe_jax.data.config import DataConfig
from dagmoe_jax.parallel.config import MeshConfig
from dagmoe_jax.run.config import OptimConfig, TrainConfig



def _config_dir() -> Path:
    """The gin files: ``dagmoe_jax/configs`` in an installed package (``pyproject.toml`` ships
    the repository's top-level ``configs/`` there), else ``configs/`` beside the package (a
    checkout, or an editable install of one)."""
    package = Path(__file__).resolve().parent.parent          # dagmoe_jax/
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()

# Fields renamed since earlier versions: a binding of the old name fails with the new one.
RENAMED = {"ExecutionConfig.fuse_gate_up": "ExecutionConfig.fuse_projections"}

# External registration: gin configures its own wrappers of these, so bindings never leak into
# ``ModelConfig(...)`` built in plain Python (tests, notebooks) after a gin file was parsed.
_CONFIG_CLASSES = (*C.nested_configs(ModelConfig).values(), ModelConfig,
                   DataConfig, OptimConfig, TrainConfig, MeshConfig)
_GIN = {cls.__name__: gin.external_configurable(cls, name=cls.__name__) for cls in _CONFIG_CLASSES}
gin.external_configurable(C.matched_shared_hidden, name="matched_shared_hidden")
gin.external_configurable(matched_coe_shared_hidden, name="matched_coe_shared_hidden")


def _plain(value):
    """A gin-built config (an instance of gin's subclass) as the plain dataclass, recursively."""
    for cls in _CONFIG_CLASSES:
        if isinstance(value, cls):
            return cls(**{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(cls)})
    return value


def resolve_gin_file(name: str) -> str:
    """A gin file path as given, relative to the ``configs/`` directory (:data:`CONFIG_DIR`),
    or, written ``configs/x.gin``, relative to the repository: both work from any working
    directory, in a checkout and after ``pip install``."""
    candidates = [Path(name), CONFIG_DIR / name, CONFIG_DIR / f"{name}.gin"]
    parts = Path(name).parts
    if len(parts) > 1 and parts[0] == "configs":
        candidates.append(CONFIG_DIR.joinpath(*parts[1:]))
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise ValueError(f"gin file {name!r} not found (looked in the working directory and {CONFIG_DIR})")


def parse_gin(files: Sequence[str] = (), bindings: Iterable[str] = ()) -> None:
    """Clear gin and parse ``files`` then ``bindings``; a bad file or binding is a one-line
    ``ValueError`` naming it."""
    gin.clear_config()
    gin.add_config_file_search_path(str(CONFIG_DIR))
    paths = [resolve_gin_file(f) for f in files]
    root = logging.getLogger()
    root.addFilter(_quiet_include_probe)
    try:
        gin.parse_config_files_and_bindings(paths, list(bindings))
    except (ValueError, KeyError, SyntaxError, IOError) as err:
        unquoted = _unquoted_string(bindings) if "malformed node" in str(err) else None
        if unquoted:
            name, value = unquoted
            raise ValueError(f"gin binding {name} = {value}: a string needs quotes in gin: write "
                             f"--gin.{name}=\"'{value}'\"") from None
        renamed = next((f"{old} is now {new}" for old, new in RENAMED.items()
                        if old.split(".")[1] in str(err)), "")
        raise ValueError(f"gin configuration error: {first_line(err)}"
                         + (f" ({renamed}: write that)" if renamed else "")) from None
    finally:
        root.removeFilter(_quiet_include_probe)


def _unquoted_string(bindings: Iterable[str]):
    """(name, value) of the first binding whose value looks like an unquoted string (gin
    reads ``tokenizer = hf`` as a Python name and fails with "malformed node or string"), or
    None. References (``@f``), macros (``%X``) and containers are left to gin."""
    for binding in bindings:
        if "=" not in binding:
            continue
        name, value = (part.strip() for part in binding.split("=", 1))
        if not value or value[0] in "@%[({'\"":
            continue
        try:
            ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return name, value
    return None


def _quiet_include_probe(record: logging.LogRecord) -> bool:
    """gin logs an error for each search-path probe of an ``include``; the include still works."""
    return not str(record.msg).startswith("Path not found")


def _build(name: str):
    try:
        return _plain(_GIN[name]())
    except (ValueError, TypeError) as err:  # gin appends "In call to configurable ..." lines
        raise ValueError(first_line(err)) from None


def _build_model() -> ModelConfig:
    """The gin-built ModelConfig; a nested config left at its default (``ModelConfig.execution``
    not bound to ``@ExecutionConfig()``, say) is built from its own bindings
    (``ExecutionConfig.remat = 'full'`` works with or without configs/base.gin's wiring)."""
    model = _build("ModelConfig")
    defaults = ModelConfig()
    changes = {name: _build(cls.__name__) for name, cls in C.nested_configs(ModelConfig).items()
               if getattr(model, name) == getattr(defaults, name)}
    try:
        return model.replace(**changes)
    except (ValueError, TypeError) as err:
        raise ValueError(first_line(err)) from None


def load_model_config(files: Sequence[str] = (), bindings: Iterable[str] = ()) -> ModelConfig:
    """The :class:`ModelConfig` that ``files`` and ``bindings`` describe, validated."""
    parse_gin(files, bindings)
    return _build_model()


def load_configs(files: Sequence[str] = (), bindings: Iterable[str] = ()
                 ) -> Tuple[ModelConfig, DataConfig, OptimConfig, TrainConfig]:
    """(ModelConfig, DataConfig, OptimConfig, TrainConfig) for a training run, validated.

    ``MeshConfig`` bindings land in ``TrainConfig.mesh``.

    gin's operative config (``gin.operative_config_str()``) afterwards lists every binding used.
    """
    parse_gin(files, bindings)
    model = _build_model()
    data, optim, train = (_build(name) for name in ("DataConfig", "OptimConfig", "TrainConfig"))
    if train.mesh == MeshConfig():        # `MeshConfig.expert = 4` without `TrainConfig.mesh = ...`
        train = dataclasses.replace(train, mesh=_build("MeshConfig"))
    return model, data, optim, train
