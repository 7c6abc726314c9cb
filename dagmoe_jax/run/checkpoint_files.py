"""The files of a checkpoint step, and the one-line words for what went wrong with them.

Helpers of :class:`dagmoe_jax.run.checkpoint.Checkpointer`: the sha256 manifest of a committed
step (written after Orbax's commit, checked before a restore), the frozen position of a grain
iterator, an error's first line and operating-system cause, the paths and shapes of a state
tree, and the differences between two JSON configs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import grain
import jax
from etils import epath
from flax import nnx, traverse_util

from dagmoe_jax.model.routed.router import SelectionBias
from dagmoe_jax.run.paths import as_path
from dagmoe_jax.validate import error_chain, interrupt_within

CHECKSUM_FILE = "dagmoe_checksums.json"
# A checkpoint's meta key listing the top-level keys of a dict state it holds when it holds
# only some of them (an upcycled run's step 0: its model, no optimizer state).
STATE_KEYS = "state_keys"
_MAX_ERROR_CHARS = 200
MAX_LISTED_DIFFS = 6


def _files(directory: epath.Path, prefix: str = ""):
    """(relative path, path) of every file under ``directory``, through ``epath`` (local or
    cloud storage alike: fsspec's own ``walk`` drops a cloud path's scheme)."""
    for child in sorted(directory.iterdir(), key=lambda p: p.name):
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            yield from _files(child, rel + "/")
        else:
            yield rel, child


def _file_digests(step_dir) -> Dict[str, str]:
    """sha256 of every file under a step directory (but the manifest), by relative path."""
    digests = {}
    for rel, path in _files(as_path(step_dir)):
        if rel.startswith(CHECKSUM_FILE):          # the manifest and its temp file
            continue
        sha = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
        digests[rel] = sha.hexdigest()
    return digests


def write_checksums(step_dir) -> None:
    """Record the digests of a committed step's files (written to a temp name, then renamed,
    so a manifest is whole or absent)."""
    step_dir = as_path(step_dir)
    tmp = step_dir / (CHECKSUM_FILE + ".tmp")
    tmp.write_text(json.dumps(_file_digests(step_dir)))
    tmp.replace(step_dir / CHECKSUM_FILE)


def verify_checksums(step_dir: str) -> None:
    """Raise ``ValueError`` naming the first file whose content no longer matches the step's
    manifest (a flipped byte, a truncated or missing file). A step without a manifest (saved by
    an older version, or cut off between commit and manifest) is not checked."""
    path = as_path(step_dir) / CHECKSUM_FILE
    if not path.exists():
        return
    expected = json.loads(path.read_text())
    actual = _file_digests(step_dir)
    for rel, digest in sorted(expected.items()):
        if actual.get(rel) != digest:
            what = "missing" if rel not in actual else "changed since it was saved"
            raise ValueError(f"checksum mismatch: {rel} is {what}")


class IteratorSnapshot:
    """The position of a grain iterator, frozen at construction.

    ``grain.checkpoint.CheckpointHandler`` writes ``item.get_state()`` when Orbax runs it; this
    snapshot makes that the state at ``save`` time. It returns bytes of the same JSON text the
    handler writes for a ``grain.DatasetIterator`` (the handler decodes bytes, as it does for a
    ``grain.DataLoaderIterator``), so the real iterator restores it unchanged.
    """

    def __init__(self, iterator):
        state = iterator.get_state()
        if isinstance(state, (bytes, bytearray)):
            self._state = bytes(state)
        elif isinstance(state, str):
            self._state = state.encode()
        else:
            self._state = json.dumps(state, indent=4).encode()

    def get_state(self) -> bytes:
        return self._state


class IteratorRestore:
    """The iterator ``grain.checkpoint.CheckpointRestore`` is given: it sets the real iterator's
    state from the JSON that :class:`IteratorSnapshot` wrote, with grain's tuples put back.

    grain 0.2.18's packing (``ConcatThenSplitIterDataset``) keeps each remainder slice as a
    tuple and reads "no remainder" as ``slice == (-1, -1)``. JSON brings the slice back as a
    list, which never equals the tuple: a position saved where a packed window ended at a
    record's end (1 step in about 20 of the smoke run) resumed one record late, a different
    batch. Every ``remainder_slices`` entry is made a tuple again before ``set_state``.
    """

    def __init__(self, iterator):
        self._iterator = iterator

    def set_state(self, state: bytes) -> None:
        if isinstance(self._iterator, grain.DatasetIterator):   # as grain's handler reads it
            self._iterator.set_state(_slices_as_tuples(json.loads(state)))
        else:
            self._iterator.set_state(state)

    def start_prefetch(self) -> None:
        start = getattr(self._iterator, "start_prefetch", None)
        if start is not None:
            start()


def _slices_as_tuples(state):
    """``state`` with each ``remainder_slices`` mapping's values as tuples (see above)."""
    if isinstance(state, dict):
        return {key: ({f: tuple(v) if isinstance(v, list) else v for f, v in value.items()}
                      if key == "remainder_slices" and isinstance(value, dict)
                      else _slices_as_tuples(value))
                for key, value in state.items()}
    if isinstance(state, list):
        return [_slices_as_tuples(v) for v in state]
    return state


def cause_line(err: BaseException) -> str:
    """The first line of the innermost cause of ``err`` (TensorStore's own error names the
    array and the problem; Orbax's wrapper only names the slice), shortened for one-line
    messages."""
    err = list(error_chain(err))[-1]
    text = str(err).strip()
    line = text.splitlines()[0].strip() if text else ""
    for cut in (" [tensorstore_spec", " See full TensorStore details"):
        line = line.split(cut)[0]
    line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    if len(line) > _MAX_ERROR_CHARS:
        line = line[:_MAX_ERROR_CHARS - 3] + "..."
    return line


def raise_if_interrupted(err: BaseException) -> None:
    """Raise the ``KeyboardInterrupt`` (Ctrl-C, a run's SIGINT / SIGTERM) ``err`` was raised
    from, if any: Orbax wraps what interrupts a read in its own error, which must not read as a
    damaged checkpoint."""
    inner = interrupt_within(err)
    if inner is not None:
        raise inner from None


def os_cause(err: BaseException) -> str:
    """The operating system's reason for a failed write ("[Errno 28] No space left on
    device"), which TensorStore puts at the end of a long message as ``os_error_code='28'``;
    else the error's first line."""
    for inner in error_chain(err):
        found = re.search(r"os_error_code='?(\d+)", str(inner))
        code = inner.errno if isinstance(inner, OSError) and inner.errno else (
            int(found.group(1)) if found else None)
        if code:
            return f"[Errno {code}] {os.strerror(code)}"
    return cause_line(err)


def _shape_of(leaf) -> Optional[Tuple[int, ...]]:
    shape = getattr(leaf, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def shapes(tree) -> Dict[Tuple[str, ...], Optional[Tuple[int, ...]]]:
    """Flattened ``path -> shape`` of a state (or abstract state, or Orbax tree metadata)."""
    # nnx Variables have a ``shape`` too but are pytree nodes (their leaf is under 'value').
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
    return {tuple(jax.tree_util.keystr((k,), simple=True) for k in path): _shape_of(leaf)
            for path, leaf in leaves}


def show(path: Tuple[str, ...]) -> str:
    """A path for messages: '/'-joined, without the trailing 'value' of an nnx Variable."""
    if len(path) > 1 and path[-1] == "value":
        path = path[:-1]
    return "/".join(path)


def strip_values(paths) -> set:
    return {tuple(p for p in path if p != "value") for path in paths}


def flatten_json(value, prefix: str = "") -> Dict[str, Any]:
    """``{'a.b': leaf}`` of a JSON value (``flax.traverse_util.flatten_dict`` with dotted keys;
    an empty dict is a leaf, and so is a non-dict value, keyed ``prefix``)."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    flat = traverse_util.flatten_dict(value, keep_empty_nodes=True, sep=".")
    return {(f"{prefix}.{k}" if prefix else k): ({} if v is traverse_util.empty_node else v)
            for k, v in flat.items()}


def json_diffs(saved: Any, expected: Any, prefix: str) -> List[str]:
    """``'prefix.key saved -> expected'`` for keys of ``expected`` that differ in ``saved``."""
    have = flatten_json(saved, prefix)
    want = flatten_json(expected, prefix)
    missing = object()
    out = []
    for key, value in want.items():
        old = have.get(key, missing)
        if old is missing:
            out.append(f"{key} (absent) -> {json.dumps(value)}")
        elif old != value:
            out.append(f"{key} {json.dumps(old)} -> {json.dumps(value)}")
    for key in have:
        if key not in want and not any(w.startswith(key + ".") for w in want):
            out.append(f"{key} {json.dumps(have[key])} -> (absent)")
    return out


def saved_part(abstract_state: Any, meta: Any, saved_tree: Any = None) -> Any:
    """The part of ``abstract_state`` a step holds: the top-level keys its ``meta`` lists
    under :data:`STATE_KEYS` (a dict state saved in part), else all of it; and without the
    model's routers' selection biases (auxiliary-loss-free balancing) when the step's tree
    ``saved_tree`` has none: a step written without them leaves them at their initial zeros,
    which select as the router did before."""
    keys = meta.get(STATE_KEYS) if isinstance(meta, dict) else None
    part = abstract_state
    if keys is not None and isinstance(abstract_state, dict):
        part = {k: v for k, v in abstract_state.items() if k in keys}
    model = part.get("model") if isinstance(part, dict) else None
    if (saved_tree is None or not isinstance(model, nnx.State)
            or not jax.tree.leaves(nnx.filter_state(model, SelectionBias))
            or any("selection_bias" in path for path in shapes(saved_tree))):
        return part
    return {**part, "model": nnx.filter_state(model, nnx.Not(SelectionBias))}
