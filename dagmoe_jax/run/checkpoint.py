"""Orbax checkpoints of the training state, the data iterator and run metadata that never lose work.

``Checkpointer`` wraps one ``orbax.checkpoint.CheckpointManager``. Each step directory holds
three items, written together and finalised atomically by Orbax:

* ``state``: any pytree of jax arrays, with ``ocp.args.StandardSave``. Both forms of the
  training state work: ``nnx.state((model, optimizer))`` (an ``nnx.State`` of Variables,
  restored as one) and its pure form ``nnx.to_pure_dict(...)`` (nested dicts of arrays).
  Restore with the same form that was saved (a different form is reported as an architecture
  mismatch, not as corruption);
* ``data``: the grain iterator's position (``grain.checkpoint.CheckpointSave``), captured when
  ``save`` is called, so the loop may keep advancing the iterator while the save runs;
* ``meta``: a JSON-able dict (the model config, anything else; ``ocp.args.JsonSave``). A
  dict state saved in part (``{'model': ...}`` without ``'optimizer'``) lists its keys in the
  meta's ``state_keys``; ``restore`` then reads those keys only, into the same keys of the
  abstract state, and ``Restored.state`` lacks the others.

Typical loop::

    ckpt = Checkpointer(run_dir, save_every=1000, keep=3)
    abstract = nnx.state(nnx.eval_shape(lambda: make_model_and_optimizer()))  # with shardings
    restored = ckpt.restore(abstract, data_iterator=it, expected_meta={"model_config": cfg_dict})
    if restored is not None:
        nnx.update((model, optimizer), restored.state)
    ...
    ckpt.save(step, nnx.state((model, optimizer)), data_iterator=it,
              meta={"model_config": cfg_dict, "step": step})
    ...
    ckpt.save(step, ..., force=True); ckpt.close()   # end of run or SIGTERM

Robustness:

* Orbax writes every save into ``<step>.orbax-checkpoint-tmp-<time>`` and renames it when
  complete, so a save that a killed process left behind is never seen as a step (Orbax deletes
  it in the background when the next ``Checkpointer`` opens the directory).
* ``save`` returns after Orbax has copied the arrays off the device (its default synchronous
  device-to-host transfer), so the loop may update or donate them while the files are written.
* ``restore`` reads the newest step; if it is unreadable (a truncated or missing file, invalid
  JSON, a missing item) it tries the next older one, and once an older step restores, moves each
  unreadable newer step directory aside to ``<step>.corrupt`` (Orbax ignores that name; the
  evidence is kept, and a later save of the same step number does not collide). It moves
  nothing when no step is readable (the cause may then be this process rather than the files)
  and raises a one-line ``ValueError`` instead.
* Before reading any array, the checkpoint's tree metadata is compared with the abstract state:
  a missing or extra array, or a shape difference, raises ``CheckpointMismatchError`` (one line,
  naming the first differing array and, given ``expected_meta['model_config']``, the differing
  config fields). That is not corruption: nothing is moved and no older step is tried.

* A save that fails (a full disk, a quota, a read-only file system) raises
  ``CheckpointSaveError`` (one line, naming the step, the cause and the step a rerun resumes
  from) from the call that first learns of it: ``save``, ``wait``, ``close`` or
  ``check_for_errors``, which a loop calls after every step so that it stops at the failed save
  rather than at the next one. The failed save stays an Orbax tmp directory, never a step; the
  previous checkpoints are untouched.

Caveats: ``<step>.corrupt`` directories are not counted by ``keep`` and never deleted (remove
them by hand once inspected). Single-controller use is assumed for moving directories aside
(only process 0 renames). When an array read or write fails, Orbax abandons its other pending
reads or writes, and asyncio, absl and Python report each of them on stderr ("Task exception
was never retrieved", "Event loop is closed"): noise, not a second failure, which the command
lines silence with :func:`dagmoe_jax.command_line.quiet_background_errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import operator
import os
from typing import Any, List, Optional, Tuple

import grain
import jax
import orbax.checkpoint as ocp

from dagmoe_jax.run.checkpoint_files import (CHECKSUM_FILE, MAX_LISTED_DIFFS,
                                             IteratorRestore, IteratorSnapshot, cause_line,
                                             json_diffs, os_cause, raise_if_interrupted, saved_part,
                                             shapes, show, strip_values, verify_checksums,
                                             write_checksums)
from dagmoe_jax.run.paths import as_path, is_remote

logger = logging.getLogger(__name__)

STATE_ITEM = "state"
DATA_ITEM = "data"
META_ITEM = "meta"
CORRUPT_SUFFIX = ".corrupt"


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for a different architecture (or a different state form)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``Checkpointer.restore`` read.

    step: the restored step.
    state: the state pytree, in the structure of the ``abstract_state`` given to ``restore``.
    meta: the ``meta`` dict saved with it.
    skipped: one message per newer step that was unreadable and moved aside.
    meta_diffs: ``'key old -> new'`` for each (flattened) key of ``expected_meta`` whose saved
      value differs (arrays had matching shapes, e.g. a changed top_k or learning rate).
    """

    step: int
    state: Any
    meta: dict
    skipped: List[str] = dataclasses.field(default_factory=list)
    meta_diffs: List[str] = dataclasses.field(default_factory=list)


class CheckpointSaveError(ValueError):
    """A checkpoint could not be written (one line: the step, the cause, what to do)."""


def _abstractify(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct) or not hasattr(leaf, "shape"):
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))


class Checkpointer:
    """Periodic, asynchronous, self-healing checkpoints of one training run (module docstring).

    directory: the run's checkpoint directory (created if missing).
    save_every: ``save`` writes a checkpoint when ``step % save_every == 0`` (or ``force``).
      Orbax's default of also saving the first step it sees is not used.
    keep: number of newest checkpoints kept; older ones are deleted after each save.
    async_save: write in a background thread (``save`` returns once the arrays are copied
      off the device). ``wait``/``close`` block until the writes are finished.
    read_only: for tools that only read a run (evaluation, sampling, analysis), possibly while
      it trains: nothing in the directory is created, deleted or renamed (the tmp directory of
      a save in flight is left alone, an unreadable step is skipped but not moved aside), and
      ``save`` is an error.
    """

    def __init__(self, directory, *, save_every: int, keep: int = 3, async_save: bool = True,
                 read_only: bool = False, save_concurrent_gb: Optional[int] = None):
        for name, value in (("save_every", save_every), ("keep", keep)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"Checkpointer.{name}={value!r} is invalid: "
                                 f"expected an integer >= 1")
        path = as_path(directory)
        self.directory = os.fspath(path if is_remote(path) else os.path.abspath(path))
        self.save_every = save_every
        self.keep = keep
        self.async_save = bool(async_save)
        self.read_only = bool(read_only)
        self._pending: Optional[int] = None    # the step of the save in flight
        self._failed = False                   # a save failed and was reported
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        # Orbax holds the encoded chunks of up to save_concurrent_gb (its default: 96) GB of
        # arrays in memory at once while writing them: a bound for saves whose caller must
        # stay within a memory budget (a run's step 0 written beside the model it holds).
        state_handler = (None if save_concurrent_gb is None else
                         ocp.StandardCheckpointHandler(save_concurrent_gb=save_concurrent_gb))
        registry.add(STATE_ITEM, ocp.args.StandardSave, state_handler)
        registry.add(STATE_ITEM, ocp.args.StandardRestore, state_handler)
        registry.add(META_ITEM, ocp.args.JsonSave)
        registry.add(META_ITEM, ocp.args.JsonRestore)
        registry.add(DATA_ITEM, grain.checkpoint.CheckpointSave)
        registry.add(DATA_ITEM, grain.checkpoint.CheckpointRestore)
        # Orbax warns of each option a read-only manager turns off, and that the directory is
        # read-only: noise to a user who asked for exactly that.
        quiet = logging.getLogger("absl")
        level = quiet.level
        if self.read_only:
            quiet.setLevel(logging.ERROR)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=self._options(),
                                                  handler_registry=registry)
        finally:
            quiet.setLevel(level)

    def _options(self):
        policies = ocp.checkpoint_managers
        return ocp.CheckpointManagerOptions(
            save_interval_steps=self.save_every,
            # FixedInterval + preemption, without Orbax's InitialSavePolicy (save_interval_steps
            # alone would also save whatever step comes first).
            save_decision_policy=policies.AnySavePolicy([
                policies.FixedIntervalPolicy(self.save_every),
                policies.PreemptionCheckpointingPolicy()]),
            max_to_keep=None if self.read_only else self.keep,
            enable_async_checkpointing=self.async_save and not self.read_only,
            # A read-only reader (evaluation, sampling, analysis of a live run) must not delete
            # the tmp directory of a save in flight, nor create or rename anything.
            cleanup_tmp_directories=not self.read_only,
            create=not self.read_only,
            read_only=self.read_only,
        )

    # ------------------------------------------------------------------------------ saving

    def save(self, step: int, state: Any, *, data_iterator=None, meta: dict,
             force: bool = False) -> bool:
        """Start saving ``state`` (+ the iterator's current position + ``meta``) as ``step``.

        Returns whether a save was started: False when ``step`` is not a multiple of
        ``save_every`` (unless ``force``) or is already saved (e.g. a forced end-of-run save
        right after the periodic one). A previous asynchronous save is awaited first.
        """
        if self.read_only:
            raise ValueError(f"Checkpointer.save: {self.directory} was opened read-only")
        try:
            step = operator.index(step)           # int, numpy or jax integer scalars
        except TypeError:
            step = -1
        if isinstance(step, bool) or step < 0:
            raise ValueError(f"Checkpointer.save: step={step!r} is invalid: "
                             f"expected an integer >= 0")
        if not isinstance(meta, dict):
            raise ValueError(f"Checkpointer.save: meta={type(meta).__name__} is invalid: "
                             f"expected a JSON-able dict")
        if not force and not self._manager.should_save(step):
            return False
        if step in self._manager.all_steps():
            logger.info("checkpoint step %d already exists in %s; not saving it again", step,
                        self.directory)
            return False
        try:
            meta = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as err:
            raise ValueError(f"Checkpointer.save: meta is not JSON-serialisable "
                             f"({cause_line(err)}): pass dicts, lists, strings and numbers "
                             f"(e.g. dataclasses.asdict(cfg))") from None
        items = {STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
        if data_iterator is not None:
            items[DATA_ITEM] = grain.checkpoint.CheckpointSave(IteratorSnapshot(data_iterator))
        self.wait()                                  # the previous save has committed,
        self._pending = step                         # with its manifest
        with self._save_errors():
            started = bool(self._manager.save(step, args=ocp.args.Composite(**items),
                                              force=force))
        if not self.async_save:
            self.wait()
        return started

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` without ``force`` would write (the interval policy)."""
        return bool(self._manager.should_save(step))

    def wait(self) -> None:
        """Block until pending asynchronous saves are written, and record the checksums of the
        steps committed since. A failed save raises :class:`CheckpointSaveError`."""
        with self._save_errors():
            self._manager.wait_until_finished()
        self._pending = None
        self._record_checksums()

    def check_for_errors(self) -> None:
        """Raise :class:`CheckpointSaveError` now if the background save has failed. Cheap: it
        never waits for a save in flight; once that save has ended (committed or failed) it
        collects the outcome. With several processes it does nothing (one process might learn
        of a failure a step before another and leave it waiting in a collective): the next
        ``save`` or ``wait``, which every process reaches at the same step, reports it."""
        if (self._pending is not None and jax.process_count() == 1
                and not self._manager.is_saving_in_progress()):
            self.wait()

    @contextlib.contextmanager
    def _save_errors(self):
        """Turn any failure of Orbax's writing into one :class:`CheckpointSaveError`, once: the
        calls after it (``close`` in a ``finally``) do not repeat it over the first report."""
        try:
            yield
        except CheckpointSaveError:
            raise
        except Exception as err:  # noqa: BLE001 -- OSError, tensorstore's ValueError, ...
            if self._failed:
                return
            self._failed = True
            step = self._pending
            done = [s for s in self._manager.all_steps() if step is None or s < step]
            resume = (f"run the same command again to resume from step {max(done)}" if done
                      else "run the same command again to start over")
            raise CheckpointSaveError(
                f"saving checkpoint {'' if step is None else f'step {step} '}in "
                f"{self.directory} failed ({os_cause(err)}): free space or fix the file "
                f"system, then {resume}") from None

    def _record_checksums(self) -> None:
        """Write the manifest of every committed step that lacks one (process 0 only)."""
        if self.read_only or jax.process_index() != 0:
            return
        for step in self._manager.all_steps():
            step_dir = as_path(self.directory) / str(step)
            if step_dir.is_dir() and not (step_dir / CHECKSUM_FILE).exists():
                try:
                    write_checksums(step_dir)
                except OSError as err:     # e.g. deleted meanwhile by the keep-N policy
                    logger.warning("no checksums for %s: %s", step_dir, cause_line(err))

    def latest_step(self) -> Optional[int]:
        """The newest step saved or being saved, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> List[int]:
        return sorted(self._manager.all_steps())

    def close(self) -> None:
        """Finish pending saves (recording their checksums) and release Orbax's resources."""
        try:
            self.wait()
        finally:
            with self._save_errors():
                self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ restoring

    def restore(self, abstract_state: Any, *, data_iterator=None,
                expected_meta: Optional[dict] = None) -> Optional[Restored]:
        """Restore the newest readable step into the shapes/shardings of ``abstract_state``.

        abstract_state: the pytree of ``jax.ShapeDtypeStruct`` (with shardings) of the current
          state, e.g. ``nnx.state(nnx.eval_shape(...))`` of model + optimizer; concrete arrays
          are accepted too (their shapes, dtypes and shardings are used). Arrays are restored
          into those shardings; a leaf without one gets the sharding it was saved with.
        data_iterator: a grain iterator whose position is set to the saved one (in place).
        expected_meta: compared with the saved meta: a differing ``model_config`` is named in a
          ``CheckpointMismatchError``; otherwise the differences are listed in ``meta_diffs``.

        A step saved in part (meta ``state_keys``) restores only those keys of a dict
        ``abstract_state``, each cast to the abstract leaf's dtype (a bfloat16 array saved,
        a float32 one restored); when it holds no data position, ``data_iterator`` is left
        at its start. A step without the routers' selection biases leaves them out too.

        Returns None when the directory holds no checkpoint. Raises ``CheckpointMismatchError``
        for a different architecture and ``ValueError`` when no step is readable.
        """
        self._manager.wait_until_finished()
        self._manager.reload()
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            return None
        abstract_state = jax.tree.map(_abstractify, abstract_state)
        if expected_meta:     # compare as JSON (tuples -> lists), as the saved meta was written
            expected_meta = json.loads(json.dumps(expected_meta, default=str))
        failures: List[Tuple[int, str]] = []
        for step in steps:
            try:
                meta = self._manager.restore(
                    step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
                tree_metadata = self._manager.item_metadata(step)[STATE_ITEM]
                if tree_metadata is None:
                    raise ValueError(f"no metadata for item {STATE_ITEM!r}")
            except Exception as err:  # noqa: BLE001 -- any read failure makes the step unusable
                raise_if_interrupted(err)                # a signal, not a damaged step
                failures.append((step, cause_line(err)))
                continue
            part = saved_part(abstract_state, meta, getattr(tree_metadata, "tree", tree_metadata))
            self._check_architecture(step, tree_metadata, part, meta, expected_meta)
            try:
                verify_checksums(as_path(self.directory) / str(step))
            except (ValueError, OSError) as err:
                failures.append((step, cause_line(err)))
                continue
            items = {STATE_ITEM: ocp.args.StandardRestore(part)}
            # A step saved in part by another command (an import, an upcycle) may hold no data
            # position: the iterator then starts where it is, at the beginning of its data.
            # (the directory is asked only then: on a bucket each question is a request)
            whole = part is abstract_state
            if data_iterator is not None and (
                    whole or (as_path(self.directory) / str(step) / DATA_ITEM).exists()):
                items[DATA_ITEM] = grain.checkpoint.CheckpointRestore(
                    IteratorRestore(data_iterator))
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(**items))
                state = restored[STATE_ITEM]
            except Exception as err:  # noqa: BLE001
                raise_if_interrupted(err)
                failures.append((step, cause_line(err)))
                continue
            skipped = self._move_aside(failures, fallback=step)
            diffs = []
            if expected_meta:
                diffs = json_diffs({k: meta.get(k) for k in expected_meta if k in meta},
                                    expected_meta, "")
            return Restored(step=step, state=state, meta=meta, skipped=skipped, meta_diffs=diffs)
        listed = ", ".join(f"step {s} ({e})" for s, e in failures)
        raise ValueError(
            f"no checkpoint in {self.directory} is readable: {listed}; if the files are damaged, "
            f"start a new run directory, or delete (or move away) those step directories to "
            f"start this run from scratch")

    def _move_aside(self, failures: List[Tuple[int, str]], fallback: int) -> List[str]:
        """Rename the unreadable steps to ``<step>.corrupt`` now that ``fallback`` restored."""
        messages = []
        for step, error in failures:
            messages.append(f"checkpoint step {step} in {self.directory} is unreadable ({error}); "
                            f"falling back to step {fallback}")
            logger.warning("%s", messages[-1])
            if jax.process_index() == 0 and not self.read_only:
                source = as_path(self.directory) / str(step)
                target = source.with_name(source.name + CORRUPT_SUFFIX)
                n = 1
                while target.exists():
                    n += 1
                    target = source.with_name(f"{source.name}{CORRUPT_SUFFIX}.{n}")
                source.rename(target)
                logger.warning("moved unreadable checkpoint %s to %s", source, target)
        if failures and not self.read_only:
            self._manager.reload()
        return messages

    def _check_architecture(self, step: int, tree_metadata: Any, abstract_state: Any,
                            meta: Any, expected_meta: Optional[dict]) -> None:
        saved_tree = getattr(tree_metadata, "tree", tree_metadata)
        have = shapes(saved_tree)
        want = shapes(abstract_state)
        where = f"checkpoint step {step} in {self.directory}"
        fix = "(use the original config, or a new run dir)"
        if set(have) != set(want) and strip_values(have) == strip_values(want):
            raise CheckpointMismatchError(
                f"{where} stores the state in a different pytree form (nnx.State of Variables vs "
                f"a pure dict of arrays): restore with the form it was saved with")
        problems = []
        for path, shape in want.items():
            if path not in have:
                problems.append(f"{show(path)} is not there but has shape {shape} in this config")
            elif have[path] is not None and shape is not None and have[path] != shape:
                problems.append(f"{show(path)} has shape {have[path]} there but {shape} in "
                                f"this config")
        for path, shape in have.items():
            if path not in want:
                problems.append(f"{show(path)} (shape {shape}) is there but not in this config")
        if not problems:
            return
        message = f"{where} was written for a different architecture: {problems[0]}"
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more arrays differ)"
        if expected_meta and "model_config" in expected_meta and isinstance(meta, dict):
            diffs = json_diffs(meta.get("model_config"), expected_meta["model_config"],
                                "model_config")
            if diffs:
                shown = ", ".join(diffs[:MAX_LISTED_DIFFS])
                more = len(diffs) - MAX_LISTED_DIFFS
                message += f"; also differs: {shown}" + (f" (and {more} more)" if more > 0 else "")
        raise CheckpointMismatchError(f"{message} {fix}")
