"""The commands of the layers below the tools.

* :mod:`~dagmoe_jax.cli.train` (``train.py``, ``dagmoe-train``), :mod:`~dagmoe_jax.cli.sample`
  (``dagmoe-sample``), :mod:`~dagmoe_jax.cli.export` (``dagmoe-export``),
  :mod:`~dagmoe_jax.cli.hf_import` (``dagmoe-import``), :mod:`~dagmoe_jax.cli.analyze`
  (``dagmoe-analyze``: it opens the run, Hugging Face folders included, for the analysis
  layer below) and :mod:`~dagmoe_jax.cli.demo`; the
  tools' own commands are their packages' ``__main__``, a block family's its package's
  ``command`` (:mod:`~dagmoe_jax.families.doe.command`, ``dagmoe-topics``);
* what every command shares (flag parsing, one-line errors) is :mod:`dagmoe_jax.command_line`,
  below the tools. This package is the top layer: nothing outside it imports it, the benchmarks
  included (``tests/test_imports.py``).
"""
