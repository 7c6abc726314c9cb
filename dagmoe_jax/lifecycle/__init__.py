"""A run's lifecycle: what training, evaluation, sampling, analysis, upcycling and the
benchmarks share.

A run is a directory and the model it holds. This package settles and builds it and reads and
writes it; it sits below training (:mod:`dagmoe_jax.train` imports it, never the other way
round):

* :mod:`~dagmoe_jax.lifecycle.settle`: every 'auto' of ``ModelConfig.execution`` decided once,
  from (config, backend, mesh);
* :mod:`~dagmoe_jax.lifecycle.build`: the settled model and its (sharded) train state, batches
  on the devices;
* :mod:`~dagmoe_jax.lifecycle.directory`: the run directory (``config.json``, gin files, the
  initial checkpoint of a run made by another command, :func:`load_run`, what changed on
  resume);
* :mod:`~dagmoe_jax.lifecycle.checkpoint`: Orbax checkpoints that never lose work
  (:mod:`~dagmoe_jax.lifecycle.checkpoint_files`: checksums and one-line error words);
* :mod:`~dagmoe_jax.lifecycle.paths`: local and cloud paths through ``etils.epath``.
"""

from dagmoe_jax.lifecycle.build import (MODEL_INPUTS, abstract, build, check_compatible,
                                        device_batch, replicated_batch, train_state)
from dagmoe_jax.lifecycle.checkpoint import (Checkpointer, CheckpointMismatchError,
                                             CheckpointSaveError, Restored)
from dagmoe_jax.lifecycle.directory import (CHECKPOINT_DIR, CONFIG_FILE, EVALUATION_DATA_FIELDS,
                                            OPERATIVE_GIN, LoadedRun, architecture,
                                            configs_from_json, configs_to_gin, configs_to_json,
                                            load_configs, load_run, model_meta, prepare_run_dir,
                                            resume_changes, save_configs, save_initial_checkpoint,
                                            save_operative_gin, save_resume_gin)
from dagmoe_jax.lifecycle.settle import describe, settle

__all__ = ["CHECKPOINT_DIR", "CONFIG_FILE", "Checkpointer", "CheckpointMismatchError",
           "CheckpointSaveError", "EVALUATION_DATA_FIELDS", "LoadedRun", "MODEL_INPUTS",
           "OPERATIVE_GIN", "Restored", "abstract", "architecture", "build", "check_compatible",
           "configs_from_json", "configs_to_gin", "configs_to_json", "describe", "device_batch",
           "load_configs", "load_run", "model_meta", "prepare_run_dir", "replicated_batch",
           "resume_changes", "save_configs", "save_initial_checkpoint", "save_operative_gin",
           "save_resume_gin", "settle", "train_state"]
