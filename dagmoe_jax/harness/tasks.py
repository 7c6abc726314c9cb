"""Which tasks the harness can see: a task manager that indexes the harness's own task library
(about 15,000 YAML files, 15-20 s to read) only when a requested task is not in the local
folders."""

from __future__ import annotations

from typing import Sequence


def task_manager(include_path: str | None, tasks: Sequence[str]):
    """An ``lm_eval.tasks.TaskManager`` for ``tasks``: over ``include_path`` alone when every
    task (or group) is defined there, else over ``include_path`` and the harness's built-in
    tasks (the Hub benchmarks: ``hellaswag``, ``arc_easy``, ``mmlu``, ...)."""
    # pylint: disable=import-outside-toplevel
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=include_path)
