"""Metric records through one small writer interface, :class:`MetricWriter`.

A training run's records go to every sink that is switched on, each a :class:`MetricWriter`:

* :class:`JsonlWriter`: one JSON object per line in ``metrics.jsonl`` (always; what plots,
  tests and notebooks read back with :func:`dagmoe_jax.run.records.read_metrics`). Per-layer
  arrays (``expert_load`` [layers, N]: each layer's share of routing assignments per expert;
  ``dropped_fraction`` [layers]) are written whole, and beside ``expert_load`` its summary ``load_imbalance``
  [layers] (:func:`load_imbalance`: each layer's max over mean load, 1 at balance);
* :class:`TensorBoardWriter` (``RunConfig.tensorboard``): TensorBoard event files; each
  per-layer array becomes one scalar per layer (``load_imbalance/layer_i``,
  ``dropped_fraction/layer_i``), and ``expert_load`` a histogram of each layer's loads;
* :class:`WandbWriter` (``RunConfig.wandb_project``): Weights & Biases, online or offline
  (``RunConfig.wandb_mode``; offline needs no network and ``wandb sync`` uploads later),
  with the same per-layer flattening as TensorBoard. ``wandb`` is optional:
  ``pip install 'dagmoe-jax[wandb]'``.

:class:`MetricsWriter` fans one ``write`` out to the writers of a run directory. Only process 0
writes (multi-host runs log once). The run directory may be local or in cloud storage (all file
I/O goes through ``etils.epath``).
"""

from __future__ import annotations

import json
import math
import os
import uuid
from typing import Dict, List, Mapping, Optional, Protocol, runtime_checkable

import numpy as np

from dagmoe_jax.run.paths import as_path, is_remote, scheme
from dagmoe_jax.run.records import METRICS_FILE, read_records

WANDB_ID_FILE = "wandb_run_id"


@runtime_checkable
class MetricWriter(Protocol):
    """A metrics sink: ``write`` records ``metrics`` (scalars or arrays) at ``step`` with each
    key under ``prefix`` (e.g. 'eval/'); ``close`` flushes and releases it."""

    def write(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None: ...

    def close(self) -> None: ...


def _jsonable(value):
    array = np.asarray(value)
    if array.ndim == 0:
        number = array.item()
        return number if not isinstance(number, float) or math.isfinite(number) else str(number)
    return array.tolist()


def truncate_jsonl(path, last_step: int) -> List[dict]:
    """Drop records of steps after ``last_step`` (a resumed run re-does them), and a torn last
    line; returns the records kept."""
    path = as_path(path)
    if not path.exists():
        return []
    kept = [r for r in read_records(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def load_imbalance(expert_load) -> np.ndarray:
    """Each layer's load imbalance, max_i load_i / mean_i load_i ([layers], 1 at balance;
    DeepSeek's MaxVio + 1), of an ``expert_load`` [layers, N]."""
    load = np.asarray(expert_load, dtype=np.float64)
    return load.max(-1) / np.maximum(load.mean(-1), 1e-9)


def _derived(metrics: Mapping[str, object]) -> Dict[str, object]:
    """``metrics`` with ``load_imbalance`` beside an ``expert_load`` [layers, N] of a block
    with experts (none for [layers, 0], or for another shape)."""
    load = metrics.get("expert_load")
    if load is None or "load_imbalance" in metrics:
        return dict(metrics)
    array = np.asarray(load)
    if array.ndim != 2 or array.shape[1] == 0:
        return dict(metrics)
    return {**metrics, "load_imbalance": load_imbalance(array)}


def _per_layer_scalars(key: str, value, prefix: str):
    """(name, float) pairs of one metric for scalar-only sinks (TensorBoard, W&B): a scalar as
    itself; a 1-D array (``load_imbalance``, ``dropped_fraction``) as one scalar per layer.
    Other shapes (``expert_load``: its histograms) are not shown there."""
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        return [(prefix + key, float(array))]
    if array.ndim == 1:
        return [(f"{prefix}{key}/layer_{i}", float(item)) for i, item in enumerate(array)]
    return []


def _load_histograms(key: str, value, prefix: str):
    """(name, loads) per layer of an ``expert_load`` [layers, N] metric, for the histograms of
    TensorBoard and W&B; nothing for any other metric."""
    array = np.asarray(value, dtype=np.float64)
    if key != "expert_load" or array.ndim != 2 or array.shape[1] == 0:
        return []
    return [(f"{prefix}expert_load/layer_{layer}", load) for layer, load in enumerate(array)]


class JsonlWriter:
    """``metrics.jsonl`` of a run directory: one JSON object per line, ``{"step": ..., key:
    value}``. A resumed run first drops the records after ``resume_step`` (it re-does those
    steps). Locally the file is appended to and flushed per record; in cloud storage, whose
    objects cannot be appended to, it is rewritten whole at each write (the file is small)."""

    def __init__(self, run_dir, *, resume_step: int = 0):
        self.path = as_path(run_dir) / METRICS_FILE
        self._remote = is_remote(self.path)
        kept = truncate_jsonl(self.path, resume_step)
        self._lines = [json.dumps(r) + "\n" for r in kept] if self._remote else []
        self._file = None if self._remote else open(os.fspath(self.path), "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        record = {"step": int(step)}
        record.update({prefix + k: _jsonable(v) for k, v in _derived(metrics).items()})
        line = json.dumps(record) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        else:
            self._lines.append(line)
            self.path.write_text("".join(self._lines))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# The client tensorboardX needs to write event files to each cloud scheme (it has none for az).
TENSORBOARD_CLIENTS = {"gs": ("google.cloud.storage", "google-cloud-storage"),
                       "s3": ("boto3", "boto3")}


def check_tensorboard_target(run_dir) -> None:
    """A one-line ``ValueError`` when TensorBoard files cannot be written to ``run_dir`` (a
    cloud URI whose tensorboardX client is not installed), so a run fails before it writes."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    kind = scheme(run_dir)
    if kind in ("", "file"):
        return
    module, package = TENSORBOARD_CLIENTS.get(kind, (None, None))
    try:
        found = module is not None and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):        # a parent package missing, or blocked
        found = False
    if not found:
        need = (f"needs the {package} package: pip install {package}" if package else
                "is not supported by tensorboardX")
        raise ValueError(f"TensorBoard logging to {os.fspath(run_dir)} {need}, or bind "
                         f"RunConfig.tensorboard=False")


class TensorBoardWriter:
    """TensorBoard event files in ``run_dir/tensorboard`` (tensorboardX; a cloud URI needs
    tensorboardX's own client, ``google-cloud-storage`` for ``gs://``, ``boto3`` for
    ``s3://``). A resumed run purges the events after ``resume_step``."""

    def __init__(self, run_dir, *, resume_step: int = 0):
        from tensorboardX import SummaryWriter  # imported lazily: optional at library use
        logdir = os.fspath(as_path(run_dir) / "tensorboard")
        try:
            self._tb = SummaryWriter(logdir, purge_step=resume_step + 1)
        except ImportError as err:
            raise ValueError(f"TensorBoard logging to {logdir} needs {err}: install it, or bind "
                             f"RunConfig.tensorboard=False") from None

    def write(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        for key, value in _derived(metrics).items():
            for name, number in _per_layer_scalars(key, value, prefix):
                self._tb.add_scalar(name, number, step)
            for name, loads in _load_histograms(key, value, prefix):
                self._tb.add_histogram(name, loads, step)

    def close(self) -> None:
        self._tb.close()


def require_wandb():
    """The ``wandb`` module, or a one-line ``ValueError`` saying how to install it."""
    try:
        import wandb  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise ValueError("RunConfig.wandb_project is set but wandb is not installed: "
                         "pip install 'dagmoe-jax[wandb]' (or pip install wandb), or leave "
                         "wandb_project empty") from None
    return wandb


class WandbWriter:
    """A Weights & Biases run (``wandb.init``) in ``project``, named after the run directory.

    mode: 'online' or 'offline' (written under ``run_dir/wandb``, or the working directory's
    ``wandb/`` for a cloud run directory, without network; ``wandb sync`` uploads it later).
    The W&B run id is kept in ``run_dir/wandb_run_id``, so a resumed training run continues
    the same W&B run (``resume='allow'``). ``config``: the run's configs, shown by W&B.
    Scalars are logged as they are; per-layer arrays as one scalar per layer (like
    TensorBoard) and each layer's expert load as a ``wandb.Histogram``."""

    def __init__(self, run_dir, *, project: str, mode: str = "online",
                 config: Optional[dict] = None):
        wandb = require_wandb()
        self._wandb = wandb
        path = as_path(run_dir)
        id_file = path / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=project, name=path.name, id=run_id, resume="allow",
                               mode=mode, dir=None if is_remote(path) else os.fspath(path),
                               config=config or {})

    def write(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        data: Dict[str, object] = {}
        for key, value in _derived(metrics).items():
            data.update(_per_layer_scalars(key, value, prefix))
            data.update((name, self._wandb.Histogram(loads))
                        for name, loads in _load_histograms(key, value, prefix))
        self._run.log(data, step=int(step))

    def close(self) -> None:
        self._run.finish()


class MetricsWriter:
    """The metric sinks of a run directory behind one ``write`` (a no-op when ``enabled`` is
    false, e.g. on processes other than 0): ``metrics.jsonl`` always, TensorBoard when
    ``tensorboard``, W&B when ``wandb_project`` is set; ``writers`` adds others (any
    :class:`MetricWriter`)."""

    def __init__(self, run_dir, *, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int = 0, wandb_project: str = "", wandb_mode: str = "online",
                 config: Optional[dict] = None, writers: tuple = ()):
        self.enabled = enabled
        self.writers: List[MetricWriter] = []
        if not enabled:
            return
        as_path(run_dir).mkdir(parents=True, exist_ok=True)
        self.writers.append(JsonlWriter(run_dir, resume_step=resume_step))
        try:
            if tensorboard:
                self.writers.append(TensorBoardWriter(run_dir, resume_step=resume_step))
            if wandb_project:
                self.writers.append(WandbWriter(run_dir, project=wandb_project, mode=wandb_mode,
                                                config=config))
        except BaseException:
            self.close()
            raise
        self.writers.extend(writers)

    def write(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        """Record ``metrics`` (scalars or arrays) at ``step`` under ``prefix`` (e.g. 'eval/')."""
        for writer in self.writers:
            writer.write(step, metrics, prefix)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def summarise_load(expert_load: Optional[np.ndarray]) -> dict:
    """Scalars for the progress bar: mean over layers of max/mean expert load."""
    if expert_load is None or np.size(expert_load) == 0:
        return {}
    return {"load_imbalance": float(np.mean(load_imbalance(expert_load)))}
