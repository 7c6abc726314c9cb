"""Which tasks the harness can see, and loading them with one-line errors.

:func:`task_manager` indexes the harness's own task library (about 15,000 YAML files, 15-20 s
to read) only when a requested task is not in the local folders. :func:`load_tasks` builds the
requested tasks once, before any scoring, so that every bad input is one line naming the task:
a folder that is not there, a Hub dataset that is neither cached nor reachable (found at once,
without the Hub client's retries), a data file that cannot be read or holds no documents, a
multiple-choice document without a valid answer. The evaluation then reuses what was built.
"""

from __future__ import annotations

import os
import socket
from typing import Sequence

from dagmoe_jax.validate import first_line

HUB_HOST = "huggingface.co"


def task_manager(include_path: str | None, tasks: Sequence[str], metadata: dict | None = None):
    """An ``lm_eval.tasks.TaskManager`` for ``tasks``: over ``include_path`` alone when every
    task (or group) is defined there, else over ``include_path`` and the harness's built-in
    tasks (the Hub benchmarks: ``hellaswag``, ``arc_easy``, ``mmlu``, ...). ``metadata`` joins
    every task's metadata (what ``lm_eval run --metadata`` gives the tasks that read it, such
    as RULER's ``max_seq_lengths``). A missing ``include_path`` folder is a one-line error."""
    # pylint: disable=import-outside-toplevel
    from lm_eval.tasks import TaskManager

    extra = {"metadata": metadata} if metadata else {}
    if include_path:
        if not os.path.isdir(os.path.expanduser(include_path)):
            raise ValueError(f"--include_path={include_path} is not a folder: point it at the "
                             "folder of your task YAML files")
        local = TaskManager(include_path=include_path, include_defaults=False, **extra)
        if all(task in local.all_tasks for task in tasks):
            local.dagmoe_local_only = True       # no Hub dataset needed: load_tasks' probe
            return local
    return TaskManager(include_path=include_path, **extra)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection within ``timeout`` seconds
    (offline mode set by the user counts as unreachable)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def go_offline() -> None:
    """Make the Hub and datasets clients read their local caches only (no requests, no
    retries): what they do under ``HF_HUB_OFFLINE=1``, set here after they were imported."""
    # pylint: disable=import-outside-toplevel
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    import huggingface_hub.constants
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if hasattr(datasets.config, name):
            setattr(datasets.config, name, True)


def _hub_error(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(word in text for word in ("ConnectionError", "LocalEntryNotFound", "Offline",
                                         "Couldn't reach", "offline mode"))


def _dataset_of(manager, name: str) -> str:
    """The ``dataset_path`` of task ``name``'s YAML ('' for a group or where it is not said)."""
    # pylint: disable=import-outside-toplevel
    from lm_eval.tasks._yaml_loader import load_yaml
    try:
        entry = manager.task_index.get(name)
        cfg = dict(entry.cfg or {}) or load_yaml(entry.yaml_path, resolve_func=False)
        return str(cfg.get("dataset_path") or "")
    except Exception:  # noqa: BLE001 -- a group, a generated task, another lm-eval layout
        return ""


def _why(manager, name: str, err: BaseException, offline: bool) -> str:
    if _hub_error(err):
        dataset = _dataset_of(manager, name)
        what = f"its dataset {dataset!r}" if dataset else "its data"
        where = ("the Hugging Face Hub is not reachable from here" if offline else
                 "the Hugging Face Hub did not answer")
        fix = (f"huggingface-cli download --repo-type dataset {dataset}" if dataset else
               "download its dataset")
        return (f"task {name!r} needs {what}, which is not in the local cache and {where}: "
                f"{fix} where there is network, then run with HF_HOME set to that cache")
    if isinstance(err, (StopIteration, IndexError)):
        return _no_documents(name)
    return f"task {name!r} could not be loaded: {first_line(err)}"


def _no_documents(name: str) -> str:
    return (f"task {name!r} has no documents: its data file or split is empty (fill it, or "
            "check the task's data files and test_split)")


def check_documents(name: str, task) -> None:
    """One-line ValueError when ``task`` has no documents to evaluate, or when a
    multiple-choice document's answer names none of its choices."""
    docs = task.eval_docs
    if len(docs) == 0:
        raise ValueError(_no_documents(name))
    if task.OUTPUT_TYPE != "multiple_choice":
        return
    for index, doc in enumerate(docs):
        choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
        answers = target if isinstance(target, list) else [target]
        ok = answers and all((isinstance(a, int) and 0 <= a < len(choices))
                             or (isinstance(a, str) and a in choices) for a in answers)
        if not ok:
            raise ValueError(f"task {name!r}: document {index} has no valid answer (its target "
                             f"is {target!r} for {len(choices)} choices): every multiple-choice "
                             "document needs the label the task's doc_to_target names")


def load_tasks(manager, tasks: Sequence[str], confirm_run_unsafe_code: bool = False) -> dict:
    """Build ``tasks`` (names of tasks or groups) with ``manager`` (``TaskManager.load``: its
    ``tasks``, ``groups`` and ``group_map``) and check their documents
    (:func:`check_documents`); one-line ValueError naming the task for any failure, and for a
    task that runs generated code without ``confirm_run_unsafe_code``. The manager then hands
    the same built tasks to the evaluation (``simple_evaluate`` calls ``load`` too) instead of
    building them again, so their data is read, and lm-eval's warnings about it said, once.
    When a task needs the Hub and the Hub is unreachable, the clients go offline first, so that
    cached datasets load and missing ones fail at once."""
    tasks = list(tasks)
    offline = not getattr(manager, "dagmoe_local_only", False) and not hub_reachable()
    if offline:
        go_offline()
    try:
        built = manager.load(tasks)
    except Exception as err:  # noqa: BLE001 -- lm-eval and datasets raise anything
        for name in tasks:     # which one?
            try:
                manager.load([name])
            except Exception as one:  # noqa: BLE001
                raise ValueError(_why(manager, name, one, offline)) from None
        raise ValueError(f"tasks {', '.join(tasks)} could not be loaded: "
                         f"{first_line(err)}") from None
    for name, task in built["tasks"].items():
        if getattr(task, "UNSAFE_CODE", False) and not confirm_run_unsafe_code:
            raise ValueError(f"task {name!r} runs the model's generated code: pass "
                             "--confirm_run_unsafe_code to allow it (in a sandbox)")
        check_documents(name, task)
    original = manager.load

    def reuse(task_list):
        same = isinstance(task_list, (list, tuple)) and list(task_list) == tasks
        return built if same else original(task_list)

    manager.load = reuse
    return built
