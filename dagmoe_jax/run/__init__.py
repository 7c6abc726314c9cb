"""A run: what training, evaluation, sampling, analysis, upcycling and the benchmarks share.

A run is a directory and the model it holds. This package builds it (settled by
:mod:`~dagmoe_jax.model.settle`) and reads and writes it; it is the lowest package of the run layer (training, evaluation and decoding import
it, never the other way round):

* :mod:`~dagmoe_jax.run.config`: the optimiser's and the run's configs (``OptimConfig``,
  ``RunConfig``), :mod:`~dagmoe_jax.run.gin` the gin wiring of every config, and
  :mod:`~dagmoe_jax.run.optim` the optimiser they describe;
* :mod:`~dagmoe_jax.run.extensions`: each block family's hooks into the run (DoE's topics);
* :mod:`~dagmoe_jax.run.allocator`: the process's memory allocator (tcmalloc, glibc tuning);
* :mod:`~dagmoe_jax.run.state`: the settled model and its (sharded) train state
  (:func:`build`), batches on the devices;
* :mod:`~dagmoe_jax.run.directory`: the run directory (``config.json``, gin files, the
  initial checkpoint of a run made by another command, :func:`load_run`, what changed on
  resume);
* :mod:`~dagmoe_jax.run.checkpoint`: Orbax checkpoints that never lose work
  (:mod:`~dagmoe_jax.run.checkpoint_files`: checksums and one-line error words);
* :mod:`~dagmoe_jax.run.paths`: local and cloud paths through ``etils.epath``.

The names below are imported when first used (PEP 562), so that a submodule that needs none of
them, :mod:`~dagmoe_jax.run.allocator` above all (the commands import it before JAX starts, and
again after TCMalloc re-executes them), costs no more than itself.
"""

import importlib

# name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("MODEL_INPUTS", "abstract", "build", "check_compatible", "device_batch",
                     "replicated_batch", "train_state"), "state"),
    **dict.fromkeys(("Checkpointer", "CheckpointMismatchError", "CheckpointSaveError",
                     "Restored"), "checkpoint"),
    **dict.fromkeys(("CHECKPOINT_DIR", "CONFIG_FILE", "NON_STREAM_DATA_FIELDS", "OPERATIVE_GIN",
                     "TOKENIZER_DIR", "TOKENIZER_FILES", "LoadedRun", "config_bindings",
                     "configs_from_json", "configs_to_gin", "configs_to_json", "copy_tokenizer",
                     "load_configs", "load_run", "model_meta", "prepare_run_dir",
                     "resume_changes", "save_configs", "save_initial_checkpoint",
                     "save_operative_gin", "save_resume_gin"), "directory"),
    "extension_for": "extensions",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
