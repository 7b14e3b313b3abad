#!/usr/bin/env bash
# Installs tf_poseidon into ./.venv and trains the digits example on 2 ranks (Open MPI from the
# venv: no system MPI needed). Rank 0 prints the progress bar and the final test accuracy.
#
# The install (which compiles the custom ops) is skipped when the package's sources are those of
# the last install made here: .venv/.demo-installed holds their digest (ci/venv_install.sh;
# ci/test.sh, which installs into the same venv, removes it). Delete that file to force a
# reinstall. Without a C++ compiler it stops before pip, with one line saying how to get one.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/venv_install.sh
extras='.[cpu]'
if demo_install_is_current "$extras"; then
    echo "ci/demo.sh: .venv has tf_poseidon from the current sources; not reinstalling" >&2
else
    require_cxx
    digest=$(source_digest "$extras")
    python3 -m venv .venv
    rm -f "$DEMO_STAMP"
    .venv/bin/pip install --quiet "$extras"
    echo "$digest" > "$DEMO_STAMP"
fi
.venv/bin/tfposeidon-run -np 2 python examples/train_digits.py "$@"
