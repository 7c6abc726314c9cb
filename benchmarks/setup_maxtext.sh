#!/usr/bin/env bash
# A side environment with MaxText 0.2.5 for benchmarks/maxtext_compile.py (MaxText needs
# Python >= 3.12; this project's own environment stays as it is).
#
#   bash benchmarks/setup_maxtext.sh [DIR]        # default DIR: /tmp/maxtext-env
#
# It installs the wheel's own pinned list, dependencies/requirements/generated_requirements/
# decoupled-requirements.txt (the environment DECOUPLE_GCLOUD=TRUE runs in), less the CUDA
# wheels and the linters, plus jax[tpu] for the TPU compiler; MaxText itself goes in without
# dependencies on top. Everything comes from the package index; about 4 GB, a few minutes.
# The TPU compiler is this project's pin (requirements-tpu.txt's jax[tpu] line), so MaxText's
# step and ours are compiled by one libtpu; JAX_TPU='jax[tpu]==X' picks another.
set -euo pipefail
DIR="${1:-/tmp/maxtext-env}"
HERE="$(cd "$(dirname "$0")" && pwd)"
JAX_TPU="${JAX_TPU:-$(grep -m1 '^jax\[tpu\]' "$HERE/../requirements-tpu.txt")}"
PY="${PYTHON312:-$(command -v python3.12 || true)}"
if [ -z "$PY" ] || ! "$PY" -c 'import sys' 2>/dev/null; then   # none, or a pyenv shim without a version
  PY="$(ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)"
fi
mkdir -p "$DIR"
cd "$DIR"
"$PY" -m venv venv
venv/bin/pip install -q --upgrade pip
venv/bin/pip download -q --no-deps maxtext==0.2.5 -d wheel
python3 - "$DIR" <<'EOF'
import sys, zipfile, glob, re
wheel = glob.glob(f"{sys.argv[1]}/wheel/maxtext-0.2.5-*.whl")[0]
text = zipfile.ZipFile(wheel).read(
    "dependencies/requirements/generated_requirements/decoupled-requirements.txt").decode()
skip = re.compile(r"^(nvidia|cuda|apache-tvm|pytype|pynvml|auditwheel|pre-commit|pylint|pyink|"
                  r"black|isort|astroid|scipy-stubs|jax|jaxlib)\b")
keep = [l for l in text.splitlines() if l.strip() and not l.startswith("#") and not skip.match(l)]
open(f"{sys.argv[1]}/requirements.txt", "w").write("\n".join(keep) + "\n")
EOF
venv/bin/pip install -q -r requirements.txt "$JAX_TPU"
venv/bin/pip install -q --no-deps wheel/maxtext-0.2.5-*.whl
echo "MaxText side environment ready: $DIR/venv/bin/python"
