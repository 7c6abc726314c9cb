"""One entry for every console command (``pyproject.toml``'s ``[project.scripts]``): the stop
contract of :mod:`dagmoe_jax.stopping` installed from the first line, before the command's
module and its libraries are imported, then the command's ``main``.

``python train.py`` and ``python -m <module>`` of each command take the same path
(:func:`dagmoe_jax.stopping.run_command` in their ``__main__``).
"""

from __future__ import annotations

import importlib
import sys

from dagmoe_jax.stopping import run_command

# console script -> the module whose main(argv=None) it runs
COMMANDS = {
    "dagmoe-train": "dagmoe_jax.cli.train",
    "dagmoe-sample": "dagmoe_jax.cli.sample",
    "dagmoe-export": "dagmoe_jax.cli.export",
    "dagmoe-import": "dagmoe_jax.cli.hf_import",
    "dagmoe-analyze": "dagmoe_jax.cli.analyze",
    "dagmoe-upcycle": "dagmoe_jax.upcycle.__main__",
    "dagmoe-harness": "dagmoe_jax.harness.cli",
    "dagmoe-compile": "dagmoe_jax.compile.__main__",
    "dagmoe-topics": "dagmoe_jax.families.doe.command",
}


# Commands whose process sets its allocator up before anything else (dagmoe_jax/run/allocator.py):
# before the contract's watcher thread starts, whose own malloc arena glibc's one-arena tuning
# would otherwise hand to XLA's threads (their buffers then came back as fresh pages each step).
ALLOCATOR_FIRST = ("dagmoe-train",)


def command(name: str) -> int:
    """Run console command ``name`` (a key of :data:`COMMANDS`) under the stop contract."""
    if name in ALLOCATOR_FIRST:
        from dagmoe_jax.run.allocator import configure_allocator
        configure_allocator()

    def main() -> int:
        module = importlib.import_module(COMMANDS[name])
        return getattr(module, "entry_main", module.main)()
    return run_command(main)


def _script(name: str):
    def script() -> None:
        sys.exit(command(name))
    script.__name__ = name.replace("-", "_")
    script.__doc__ = f"The ``{name}`` console script."
    return script


train = _script("dagmoe-train")
sample = _script("dagmoe-sample")
export = _script("dagmoe-export")
hf_import = _script("dagmoe-import")
analyze = _script("dagmoe-analyze")
upcycle = _script("dagmoe-upcycle")
harness = _script("dagmoe-harness")
compile_ = _script("dagmoe-compile")
topics = _script("dagmoe-topics")
