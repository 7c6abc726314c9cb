"""Loading configs from gin files and bindings (T5X style).

``load_model_config`` gives the :class:`ModelConfig` alone (notebooks, benchmarks) and
``load_execution_config`` how it runs (``ExecutionConfig``); ``load_configs`` gives all four
configs of a training run (model, data, optimiser, run; the run's holds the mesh and the
execution config).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import logging
import re
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

import gin
from gin import config_parser

from dagmoe_jax import config as C
from dagmoe_jax.validate import first_line
from dagmoe_jax.config import ModelConfig
from dagmoe_jax.data.config import DataConfig
from dagmoe_jax.parallel.config import MeshConfig
from dagmoe_jax.run.config import OptimConfig, RunConfig


def _config_dir() -> Path:
    """The gin files: ``dagmoe_jax/configs`` in an installed package (``pyproject.toml`` ships
    the repository's top-level ``configs/`` there), else ``configs/`` beside the package (a
    checkout, or an editable install of one)."""
    package = Path(__file__).resolve().parent.parent          # dagmoe_jax/
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()

# What train.py and dagmoe-compile read when given no --gin_file.
DEFAULT_GIN = "train/default.gin"

# Bindings of earlier versions: a binding of the old name fails with what to write instead.
RENAMED = {
    "ExecutionConfig.fuse_gate_up": "it is ExecutionConfig.fuse_projections now",
    "ModelConfig.execution": "it is RunConfig.execution now, beside the mesh (bind "
                             "ExecutionConfig.<field> as before)",
    **{f"ModelConfig.{field}": f"the block family's config holds it now: bind {cls}.<field> "
                               f"(ModelConfig.block = 'moe' / 'coe' selects the family)"
       for field, cls in (("router", "RouterConfig"), ("experts", "ExpertConfig"),
                          ("aggregation", "AggregationConfig"))},
    "ModelConfig.coe": "write ModelConfig.block = 'coe' and bind CoEConfig.<field>",
    "ModelConfig.doe": "write ModelConfig.block = 'doe' and bind DoEConfig.<field>",
    "ModelConfig.ffn_hidden": "the dense block's config holds it now: write "
                              "DenseConfig.ffn_hidden (or DoEConfig.ffn_hidden)"}

# Configurables' earlier names: a gin file given to :func:`parse_gin` (the ``resume.gin`` and
# ``operative_config.gin`` that runs saved before the rename) and a binding that names one are
# read with the name of now, in their order; a file that another includes is not, and gin's
# error names the new spelling (:data:`RENAMED`).
OLD_NAMES = {"TrainConfig": "RunConfig"}
_OLD_NAME = re.compile(r"\b(%s)(?=\.\w|\(\))" % "|".join(OLD_NAMES))
RENAMED.update({old: f"it is {new} now" for old, new in OLD_NAMES.items()})

# External registration: gin configures its own wrappers of these, so bindings never leak into
# ``ModelConfig(...)`` built in plain Python (tests, notebooks) after a gin file was parsed.
# Every family's config and what else of it gin binds (config/families.py): its nested config
# classes and the functions a gin file calls (``@matched_shared_hidden()``).
_FAMILY_PARTS = tuple(part for family in C.all_families().values()
                      for part in (*family.configurables, family.config))
_CONFIG_CLASSES = (C.RouterConfig, C.ExpertConfig,
                   *(part for part in _FAMILY_PARTS if isinstance(part, type)),
                   C.RopeScalingConfig, C.MLAConfig, C.MTPConfig,
                   C.ExecutionConfig, ModelConfig,
                   DataConfig, OptimConfig, RunConfig, MeshConfig)
_FUNCTIONS = tuple(part for part in _FAMILY_PARTS if not isinstance(part, type))
_GIN = {cls.__name__: gin.external_configurable(cls, name=cls.__name__) for cls in _CONFIG_CLASSES}
for _function in _FUNCTIONS:
    gin.external_configurable(_function, name=_function.__name__)
# what a binding can name: configurable -> its parameters (for "did you mean" hints)
_PARAMETERS = {fn.__name__: list(inspect.signature(fn).parameters)
               for fn in (*_CONFIG_CLASSES, *_FUNCTIONS)}


def _plain(value):
    """A gin-built config (an instance of gin's subclass) as the plain dataclass, recursively."""
    for cls in _CONFIG_CLASSES:
        if isinstance(value, cls):
            return cls(**{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(cls)
                          if f.init})
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
    bindings = list(bindings)
    paths = [resolve_gin_file(f) for f in files]
    root = logging.getLogger()
    root.addFilter(_quiet_include_probe)
    try:
        for path in paths:
            text = Path(path).read_text()
            if _OLD_NAME.search(text):
                gin.parse_config(_new_names(text))
            else:
                gin.parse_config_file(path)
        gin.parse_config([_new_names(b) for b in bindings])
        gin.finalize()
    except (ValueError, KeyError, SyntaxError, IOError) as err:
        raise _one_line(err, bindings) from None
    finally:
        root.removeFilter(_quiet_include_probe)


def _new_names(text: str) -> str:
    """gin ``text`` with the configurables' old names (:data:`OLD_NAMES`) written as now."""
    return _OLD_NAME.sub(lambda m: OLD_NAMES[m.group(1)], text)


def binding_values(bindings: Iterable[str]) -> List[Tuple[str, object]]:
    """``("Class.param", value)`` of each binding, read by gin's own parser (a value as gin
    reads it; no configurable is called and gin's state is untouched). A binding gin cannot
    read is the one-line ``ValueError`` :func:`parse_gin` gives."""
    bindings = list(bindings)
    try:
        statements = list(config_parser.ConfigParser("\n".join(map(_new_names, bindings)),
                                                     gin.config.ParserDelegate()))
    except (ValueError, SyntaxError) as err:
        raise _one_line(err, bindings) from None
    return [(f"{s.selector}.{s.arg_name}", s.value) for s in statements
            if isinstance(s, config_parser.BindingStatement)]


def _one_line(err: Exception, bindings: Iterable[str]) -> ValueError:
    """gin's error as one line: what to write for an unquoted string or a binding of an
    earlier version's name, else gin's first line."""
    unquoted = _unquoted_string(bindings) if "malformed node" in str(err) else None
    if unquoted:
        name, value = unquoted
        return ValueError(f"gin binding {name} = {value}: a string needs quotes in gin: write "
                          f"--gin.{name}=\"'{value}'\"")
    message = str(err)
    return ValueError(f"gin configuration error: {first_line(err)}"
                      + (_renamed_hint(message) or _nearest_hint(message)))


def _nearest_hint(message: str) -> str:
    """`` (did you mean DataConfig.source?)`` when gin's error is about a parameter or a
    configurable that is not there and a known one is spelled nearly alike, else ''."""
    unknown = re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", message)
    if unknown and unknown.group(1) in _PARAMETERS:
        cls, name = unknown.groups()
        near = difflib.get_close_matches(name, _PARAMETERS[cls], n=1)
        return f" (did you mean {cls}.{near[0]}?)" if near else ""
    missing = re.search(r"No configurable matching '(\w+)'", message)
    near = difflib.get_close_matches(missing.group(1), _PARAMETERS, n=1) if missing else []
    return f" (did you mean {near[0]}?)" if near else ""


def _renamed_hint(message: str) -> str:
    """`` (Cls.field: what to write instead)`` when a gin error is about a binding of an
    earlier version (:data:`RENAMED`; gin names the class and the parameter), else ''."""
    for old, new in RENAMED.items():
        cls, _, field = old.partition(".")
        if f"'{cls}'" in message and (not field or f"'{field}'" in message):
            return f" ({old}: {new})"
    return ""


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


def _build_tree(cls, built=None):
    """``cls`` built from its gin bindings (or ``built``, a config gin built already), with
    each nested config it holds built the same way: at its default, from its own class's
    bindings. This is the one wiring mechanism: ``RouterConfig.top_k = 8`` configures the
    block's router with no ``@RouterConfig()`` line. ``ModelConfig.block`` is the family its
    name selects (``ModelConfig.block = 'coe'``; default 'moe'), built from that family's
    bindings."""
    config = _build(cls.__name__) if built is None else built
    changes = {}
    for name, nested in C.nested_configs(cls).items():
        value = getattr(config, name)
        nested = type(value) if name == "block" else nested
        changes[name] = _build_tree(nested, None if value == nested() else value)
    try:
        return dataclasses.replace(config, **changes)
    except (ValueError, TypeError) as err:
        raise ValueError(first_line(err)) from None


def load_model_config(files: Sequence[str] = (), bindings: Iterable[str] = ()) -> ModelConfig:
    """The :class:`ModelConfig` that ``files`` and ``bindings`` describe, validated."""
    parse_gin(files, bindings)
    return _build_tree(ModelConfig)


def load_execution_config(files: Sequence[str] = (),
                          bindings: Iterable[str] = ()) -> C.ExecutionConfig:
    """The :class:`ExecutionConfig` that ``files`` and ``bindings`` describe, validated (what
    ``RunConfig.execution`` holds in a run; 'auto' fields stay for ``settle``)."""
    parse_gin(files, bindings)
    return _build_tree(C.ExecutionConfig)


def bound_fields(cls) -> frozenset:
    """The fields of the config class ``cls`` that the parsed gin files and bindings bind,
    whatever the value (a binding to the default's value too): what a run was told, as
    against what it defaults to."""
    bound = set()
    for field in dataclasses.fields(cls):
        try:
            gin.query_parameter(f"{cls.__name__}.{field.name}")
        except ValueError:
            continue
        bound.add(field.name)
    return frozenset(bound)


def load_configs(files: Sequence[str] = (), bindings: Iterable[str] = ()
                 ) -> Tuple[ModelConfig, DataConfig, OptimConfig, RunConfig]:
    """(ModelConfig, DataConfig, OptimConfig, RunConfig) for a training run, validated.

    ``MeshConfig`` and ``ExecutionConfig`` bindings land in ``RunConfig.mesh`` and
    ``RunConfig.execution``.

    gin's operative config (``gin.operative_config_str()``) afterwards lists every binding used.
    """
    parse_gin(files, bindings)
    model, data, optim, train = (_build_tree(cls) for cls in (ModelConfig, DataConfig, OptimConfig,
                                                               RunConfig))
    return model, data, optim, train
