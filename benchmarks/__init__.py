"""The benchmarks: each module a command, run from the repository root as ``python -m
benchmarks.NAME`` (its docstring says what it measures, and how to run it);
:mod:`benchmarks.common` holds what several share, :mod:`benchmarks.experiments` the drivers of
those that train and compare models. Not part of the installed package (``pyproject.toml``
lists dagmoe_jax's packages only): they import the library, and the library never imports
them."""
