"""What several benchmarks share: their budget flags (``--micro`` and one flag per budget entry),
``--seeds``, the tail of their ``main`` (results written as JSON, the report printed; or, with
``--report FILE``, the report of saved results) and the seed-paired lines of the DUME reports.
Import-light: JAX only inside :func:`run_and_report`, so that ``--help`` is instant."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from dagmoe_jax.command_line import USER_ERRORS, report_error


def seed_list(text: str) -> tuple:
    """A benchmark's --seeds: a count ('3' -> (0, 1, 2)) or a list ('0,5' -> (0, 5))."""
    values = tuple(int(v) for v in text.split(",") if v.strip())
    return tuple(range(values[0])) if len(values) == 1 and "," not in text else values


def add_budget_flags(parser: argparse.ArgumentParser, defaults: Dict[str, Any]) -> None:
    """One ``--NAME`` flag per entry of ``defaults``, typed like its default value; unset flags
    stay None for :func:`fill_budget_defaults`."""
    for name, value in defaults.items():
        parser.add_argument(f"--{name}", type=type(value), default=None)


def fill_budget_defaults(args: argparse.Namespace, defaults: Dict[str, Any],
                         micro: Dict[str, Any]) -> None:
    """Give each flag the user left unset its default: from ``micro`` when ``args.micro`` is set
    (a quick end-to-end budget), else from ``defaults``."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, micro.get(name, value) if args.micro else value)


def report_or_run(args: argparse.Namespace, default_name: str,
                  run: Callable[[argparse.Namespace, Path, Callable[[str], None]], dict],
                  format_report: Callable[[dict], str]) -> int:
    """The ``main`` of a benchmark with ``--report``, ``--out`` and ``--json``: with
    ``--report FILE`` the report of saved results (2 and one line when unreadable); else
    ``run(args, out, log)`` into ``--out`` (:func:`run_and_report`), progress lines printed."""
    if args.report:
        try:
            print(format_report(json.loads(Path(args.report).read_text())))
        except (OSError, ValueError, KeyError) as err:
            return report_error(ValueError(f"cannot read {args.report}: {err}"))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return run_and_report(out, args.json, default_name,
                          lambda: run(args, out, lambda line: print(line, flush=True)),
                          format_report)


def run_and_report(out: Path, json_path: Optional[str], default_name: str,
                   run: Callable[[], dict], format_report: Callable[[dict], str],
                   extra: Optional[dict] = None) -> int:
    """The tail every benchmark's ``main`` shares: a persistent compilation cache in ``out``
    (runs of one variant compile to the same programs), ``run()``, the environment added to its
    results, JSON written to ``json_path`` (default ``out/default_name``) and the report printed.
    Returns the exit code: 0, 2 for bad input (one line), 130 when interrupted."""
    import jax  # pylint: disable=import-outside-toplevel

    jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    start = time.perf_counter()
    try:
        results = run()
    except KeyboardInterrupt as err:
        print(f"stopped: {err}", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        return report_error(err)
    results.update(extra or {})
    results["environment"] = {"jax": jax.__version__, "backend": jax.default_backend(),
                              "devices": len(jax.devices())}
    path = Path(json_path) if json_path else out / default_name
    path.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(format_report(results))
    print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s)")
    return 0


def paired_by_seed(per_seed: Sequence[Mapping[str, Any]],
                   pairs: Sequence[Tuple[str, str]]) -> List[str]:
    """One report line per (method, baseline) of ``pairs``: the seed-paired difference of their
    domain-mean held-out cross-entropies (``per_seed[i]["ce"][method]``, one value per domain),
    mean ± std over seeds, and whether the method is better or worse in every seed."""
    lines = []
    for m, b in pairs:
        diff = np.array([np.mean(p["ce"][m]) - np.mean(p["ce"][b]) for p in per_seed])
        verdict = ("better in every seed" if np.all(diff < 0) else
                   "worse in every seed" if np.all(diff > 0) else "mixed: within the spread")
        lines.append(f"  {m} - {b}: {diff.mean():+.5f} ± {diff.std():.5f} ({verdict})")
    return lines
