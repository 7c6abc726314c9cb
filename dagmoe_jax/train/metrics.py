"""Metric records: one JSON object per line in ``metrics.jsonl`` and TensorBoard event files.

Scalars go to both. Per-layer arrays (``expert_load`` [layers, N], ``dropped_fraction``
[layers]) are written whole to the JSONL log; TensorBoard gets one scalar per layer for the
dropped fraction and the load imbalance (max over mean expert load), plus a histogram of each
layer's load. Only process 0 writes (multi-host runs log once).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

METRICS_FILE = "metrics.jsonl"


def _jsonable(value):
    array = np.asarray(value)
    if array.ndim == 0:
        number = array.item()
        return number if not isinstance(number, float) or math.isfinite(number) else str(number)
    return array.tolist()


def _records(path: Path) -> list[dict]:
    """The records of a metrics file. A torn last line (what a crash or a full disk leaves
    mid-write) is dropped; an unreadable line anywhere else is a one-line ``ValueError`` naming
    the file and line."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if number == len(lines):        # torn by a crash: the rest of it was never written
                break
            raise ValueError(f"{path} line {number} is not a metrics record ({err}): fix or "
                             f"remove that line") from None
        records.append(record)
    return records


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records of steps after ``last_step`` (a resumed run re-does them), and a torn last
    line."""
    if not path.exists():
        return
    kept = [r for r in _records(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class MetricsWriter:
    """Writes metric records for a run directory (a no-op writer when ``enabled`` is false)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int = 0):
        self.enabled = enabled
        self._tb = None
        self._file = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / METRICS_FILE
        truncate_jsonl(path, resume_step)
        self._file = open(path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: optional at library use
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, step: int, metrics: Mapping[str, object], prefix: str = "") -> None:
        """Record ``metrics`` (scalars or arrays) at ``step`` under ``prefix`` (e.g. 'eval/')."""
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({prefix + k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._write_tensorboard(step, metrics, prefix)

    def _write_tensorboard(self, step: int, metrics: Mapping[str, object], prefix: str) -> None:
        for key, value in metrics.items():
            array = np.asarray(value, dtype=np.float64)
            if array.ndim == 0:
                self._tb.add_scalar(prefix + key, float(array), step)
            elif key == "expert_load" and array.ndim == 2:
                for layer, load in enumerate(array):
                    self._tb.add_scalar(f"{prefix}load_imbalance/layer_{layer}",
                                        float(load.max() / max(load.mean(), 1e-9)), step)
                    self._tb.add_histogram(f"{prefix}expert_load/layer_{layer}", load, step)
            elif array.ndim == 1:
                for i, item in enumerate(array):
                    self._tb.add_scalar(f"{prefix}{key}/layer_{i}", float(item), step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (for plots, tests and notebooks)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return _records(path)


def summarise_load(expert_load: Optional[np.ndarray]) -> dict:
    """Scalars for the progress bar: mean over layers of max/mean expert load."""
    if expert_load is None or np.size(expert_load) == 0:
        return {}
    load = np.asarray(expert_load, dtype=np.float64)
    return {"load_imbalance": float(np.mean(load.max(-1) / np.maximum(load.mean(-1), 1e-9)))}
