"""What CUDA's ``ptxas`` says of each GPU kernel a compilation assembles: registers a thread,
bytes spilled to local memory, and threads a block, and what they leave of an SM.

XLA:GPU assembles the PTX of every kernel it compiles (its fusions, its Triton GEMM fusions,
the Pallas Triton and Mosaic GPU kernels alike) by running ``ptxas`` from the PATH, per module,
with ``--warn-on-spills``. :func:`install` puts a ``ptxas`` of ours first on this process's
PATH: it runs the real one as XLA asked (XLA gets the same binary and messages) and, when
``$DAGMOE_PTXAS_LOG`` names a directory, runs it again with ``-v`` into a scratch file
(ptxas writes its command line into the binary, so ``-v`` cannot go into XLA's), writing
what ``-v`` prints of each entry function, and the entry's ``.maxntid`` (the threads a block
its PTX declares), to a file there. :func:`recorded` sets that directory around one
compilation and gives each kernel's :class:`KernelResources` (:func:`parse` reads them).

The SM's limits are those of sm80 and sm90 alike: 65,536 32-bit registers, 64 resident warps,
32 resident blocks; registers are allocated to a warp in units of 256. Shared memory, which
can limit a block's residency further, is not counted: Triton and Mosaic GPU kernels take
theirs dynamically, at launch, which ``ptxas`` does not see.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Optional

REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64
BLOCKS_PER_SM = 32
REGISTER_UNIT = 256          # registers are given to a warp in multiples of this

LOG_VARIABLE = "DAGMOE_PTXAS_LOG"

# The wrapper: the real ptxas as XLA asked (its output is XLA's: with -v the binary would
# differ, since ptxas records its command line in it); then, when recording, again with -v
# into a scratch file, each entry's .maxntid and the -v lines to a file of its own in the log
# directory (ptxas may run several at once). The PTX file is its first argument.
_WRAPPER = """#!/bin/sh
real='{real}'
log="${{{variable}:-}}"
if [ -z "$log" ] || [ ! -d "$log" ]; then exec "$real" "$@"; fi
"$real" "$@"
code=$?
case "$1" in -*) exit $code ;; esac
if [ $code -eq 0 ] && [ -f "$1" ]; then
  out=$(mktemp "$log/ptxas.XXXXXX")
  scratch=$(mktemp)
  grep -E '^[.]visible [.]entry|^[.]entry|^[.]maxntid|^[.]reqntid' "$1" \\
    | sed 's/^/ptx: /' >> "$out"
  "$real" -v "$@" -o "$scratch" 2>> "$out" >/dev/null
  rm -f "$scratch"
fi
exit $code
"""

_installed: Optional[Path] = None


def install(real_ptxas: str) -> Path:
    """Put the recording ``ptxas`` first on this process's PATH (once; XLA finds it there);
    returns its directory. Without ``$DAGMOE_PTXAS_LOG`` it runs the real one unchanged."""
    global _installed
    if _installed is None:
        directory = Path(tempfile.mkdtemp(prefix="dagmoe-ptxas-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        wrapper = directory / "ptxas"
        wrapper.write_text(_WRAPPER.format(real=real_ptxas, variable=LOG_VARIABLE))
        wrapper.chmod(0o755)
        os.environ["PATH"] = f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"
        _installed = directory
    return _installed


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """One entry function as ptxas assembled it: ``registers`` a thread, bytes of spill
    stores and loads, and ``threads`` a block when its PTX declares them (``.maxntid``)."""

    registers: int
    spill_stores: int = 0
    spill_loads: int = 0
    threads: Optional[int] = None

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)

    def blocks_per_sm(self, threads: Optional[int] = None) -> Optional[int]:
        """Blocks of ``threads`` (default: the declared ones) an SM holds at once as far as
        its registers allow (module docstring); None when the block size is unknown."""
        threads = threads or self.threads
        if not threads:
            return None
        warps = -(-threads // 32)
        per_warp = -(-max(self.registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = (REGISTERS_PER_SM // per_warp) // warps
        return max(0, min(by_registers, WARPS_PER_SM // warps, BLOCKS_PER_SM))

    def resident_warps(self, threads: Optional[int] = None) -> Optional[int]:
        """Warps an SM holds at once (of :data:`WARPS_PER_SM`)."""
        blocks = self.blocks_per_sm(threads)
        threads = threads or self.threads
        return None if blocks is None else blocks * -(-threads // 32)

    def describe(self, threads: Optional[int] = None) -> str:
        threads = threads or self.threads
        text = f"{self.registers} registers"
        if threads:
            text += (f" x {threads} threads: {self.blocks_per_sm(threads)} blocks an SM "
                     f"({self.resident_warps(threads)} of {WARPS_PER_SM} warps)")
        return text + (f", {self.spill_stores} B spilled" if self.spills else ", no spills")


_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)'")
_PROPERTIES_FOR = re.compile(r"ptxas info\s*: Function properties for ([\w$.]+)")
_PROPERTIES = re.compile(r"^\s+\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                         r"spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_PTX_ENTRY = re.compile(r"^ptx: [.](?:visible [.])?entry ([\w$.]+)")
_PTX_THREADS = re.compile(r"^ptx: [.](?:maxntid|reqntid) (\d+)(?:, (\d+))?(?:, (\d+))?")


def parse(text: str) -> Dict[str, KernelResources]:
    """The kernels of a recorded log (:func:`install`): name -> :class:`KernelResources`."""
    threads: Dict[str, int] = {}
    found: Dict[str, dict] = {}
    entry = ptx_entry = described = None
    for line in text.splitlines():
        if (m := _PTX_ENTRY.match(line)):
            ptx_entry = m.group(1)
        elif (m := _PTX_THREADS.match(line)) and ptx_entry:
            dims = [int(v) for v in m.groups() if v]
            total = 1
            for v in dims:
                total *= v
            threads[ptx_entry] = total
        elif (m := _ENTRY.search(line)):
            entry = m.group(1)
            found[entry] = {"registers": 0}
        elif (m := _PROPERTIES_FOR.search(line)):
            described = m.group(1)       # an entry's, or a device function's it calls
        elif described in found and (m := _PROPERTIES.match(line)):
            found[described].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        elif entry and (m := _USED.search(line)):
            found[entry]["registers"] = int(m.group(1))
    return {name: KernelResources(threads=threads.get(name), **fields)
            for name, fields in found.items()}


@contextlib.contextmanager
def recorded() -> Iterator[Dict[str, KernelResources]]:
    """Record the kernels ptxas assembles inside the block (it must run after :func:`install`):
    the dict yielded is filled with them when the block ends."""
    kernels: Dict[str, KernelResources] = {}
    log = tempfile.mkdtemp(prefix="dagmoe-ptxas-log-")
    previous = os.environ.get(LOG_VARIABLE)
    os.environ[LOG_VARIABLE] = log
    try:
        yield kernels
    finally:
        if previous is None:
            os.environ.pop(LOG_VARIABLE, None)
        else:
            os.environ[LOG_VARIABLE] = previous
        for path in sorted(Path(log).iterdir()):
            kernels.update(parse(path.read_text(errors="replace")))
        shutil.rmtree(log, ignore_errors=True)


def as_dicts(kernels: Dict[str, KernelResources], threads: Dict[str, Optional[int]]) -> dict:
    """The report's JSON of ``kernels``: each one's fields, its threads a block (``threads``'
    where given, else its PTX's) and the blocks an SM holds."""
    return {name: {**dataclasses.asdict(r), "threads": threads.get(name, r.threads),
                   "blocks_per_sm": r.blocks_per_sm(threads.get(name))}
            for name, r in sorted(kernels.items())}
