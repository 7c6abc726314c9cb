"""A run: what training, evaluation, sampling, analysis, upcycling and the benchmarks share.

A run is a directory and the model it holds. This package builds it (settled by
:mod:`~dagmoe_jax.model.settle`) and reads and writes it; it is the lowest package of the run layer (training, evaluation and decoding import
it, never the other way round):

* :mod:`~dagmoe_jax.run.config`: the optimiser and training configs (``OptimConfig``,
  ``TrainConfig``), :mod:`~dagmoe_jax.run.gin` the gin wiring of every config, and
  :mod:`~dagmoe_jax.run.optim` the optimiser they describe;
* :mod:`~dagmoe_jax.run.extensions`: each block family's hooks into the run (DoE's topics);
* :mod:`~dagmoe_jax.run.allocator`: the process's memory allocator (tcmalloc, glibc tuning);
* :mod:`~dagmoe_jax.run.build`: the settled model and its (sharded) train state, batches
  on the devices;
* :mod:`~dagmoe_jax.run.directory`: the run directory (``config.json``, gin files, the
  initial checkpoint of a run made by another command, :func:`load_run`, what changed on
  resume);
* :mod:`~dagmoe_jax.run.checkpoint`: Orbax checkpoints that never lose work
  (:mod:`~dagmoe_jax.run.checkpoint_files`: checksums and one-line error words);
* :mod:`~dagmoe_jax.run.paths`: local and cloud paths through ``etils.epath``.
"""

from dagmoe_jax.run.build import (MODEL_INPUTS, abstract, build, check_compatible,
                                  device_batch, replicated_batch, train_state)
from dagmoe_jax.run.checkpoint import (Checkpointer, CheckpointMismatchError,
                                       CheckpointSaveError, Restored)
from dagmoe_jax.run.directory import (CHECKPOINT_DIR, CONFIG_FILE, NON_STREAM_DATA_FIELDS,
                                      OPERATIVE_GIN, TOKENIZER_DIR, TOKENIZER_FILES, LoadedRun,
                                      config_bindings, configs_from_json, configs_to_gin,
                                      configs_to_json, copy_tokenizer,
                                      load_configs, load_run, model_meta, prepare_run_dir,
                                      resume_changes, save_configs, save_initial_checkpoint,
                                      save_operative_gin, save_resume_gin)
from dagmoe_jax.run.extensions import extension_for

__all__ = ["CHECKPOINT_DIR", "CONFIG_FILE", "CheckpointMismatchError", "CheckpointSaveError",
           "Checkpointer", "LoadedRun", "MODEL_INPUTS", "NON_STREAM_DATA_FIELDS",
           "OPERATIVE_GIN", "Restored", "TOKENIZER_DIR", "TOKENIZER_FILES", "abstract", "build",
           "check_compatible", "config_bindings", "configs_from_json", "configs_to_gin",
           "configs_to_json", "copy_tokenizer", "device_batch",
           "extension_for", "load_configs", "load_run", "model_meta", "prepare_run_dir",
           "replicated_batch", "resume_changes", "save_configs", "save_initial_checkpoint",
           "save_operative_gin", "save_resume_gin", "train_state"]
