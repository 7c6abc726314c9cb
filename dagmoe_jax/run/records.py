"""A run's metrics log, ``metrics.jsonl`` in its run directory: one JSON object per line, as
the training loop's :class:`~dagmoe_jax.train.metrics.JsonlWriter` writes it, read back here
by everything below the loop (analysis, a family's analysis, tests and notebooks)."""

from __future__ import annotations

import json

from dagmoe_jax.run.paths import as_path

METRICS_FILE = "metrics.jsonl"


def read_records(path) -> list[dict]:
    """The records of a metrics file. A torn last line (what a crash or a full disk leaves
    mid-write) is dropped; an unreadable line anywhere else is a one-line ``ValueError`` naming
    the file and line."""
    lines = as_path(path).read_bytes().decode("utf-8", errors="replace").splitlines()
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


def read_metrics(run_dir) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (none where it has no log: a run that never
    trained, a Hugging Face folder)."""
    path = as_path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return read_records(path)
