#!/usr/bin/env bash
# Installs tf_poseidon into ./.venv and trains the digits example on 2 ranks (Open MPI from the
# venv: no system MPI needed). Rank 0 prints the progress bar and the final test accuracy.
#
# The install (which compiles the custom ops) is skipped when the package's sources are those of
# the last install made here: .venv/.demo-installed holds their digest (ci/test.sh, which
# installs into the same venv, removes it). Delete that file to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
extras='.[cpu]'
stamp=.venv/.demo-installed
digest=$(
    {
        echo "$extras"
        find setup.py setup.cfg pyproject.toml kernels tf_poseidon -type f \
            ! -name '*.pyc' ! -name '*.so' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
)
if [ -x .venv/bin/tfposeidon-run ] && [ "$(cat "$stamp" 2>/dev/null)" = "$digest" ]; then
    echo "ci/demo.sh: .venv has tf_poseidon from the current sources; not reinstalling" >&2
else
    python3 -m venv .venv
    rm -f "$stamp"
    .venv/bin/pip install --quiet "$extras"
    echo "$digest" > "$stamp"
fi
.venv/bin/tfposeidon-run -np 2 python examples/train_digits.py "$@"
