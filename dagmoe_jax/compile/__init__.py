"""Ahead-of-time compilation for TPU topologies from a host without a TPU (the pod path).

``python -m dagmoe_jax.compile`` (``dagmoe-compile``) compiles a run's training, evaluation and
generation programs with XLA:TPU and Mosaic for a topology such as ``v5p:4x4x4`` and reports,
per chip, memory against HBM, FLOPs and bytes, collectives and a roofline step-time estimate;
``--search`` ranks meshes and batch sizes. MaxText's ``train_compile.py`` is the model.

* :mod:`~dagmoe_jax.compile.chips`: the chips' datasheets and a topology's compile-only devices;
* :mod:`~dagmoe_jax.compile.programs`: the run's programs, abstract and sharded, compiled;
* :mod:`~dagmoe_jax.compile.hlo`: the compiled HLO text read into instructions and shapes;
* :mod:`~dagmoe_jax.compile.roofline`: those costed into collectives and a step estimate;
* :mod:`~dagmoe_jax.compile.search`: the mesh search.

A tool: it depends on the run layer (model, train step, generation), nothing depends on it.
"""
