#!/usr/bin/env bash
# Installs tf_poseidon into ./.venv and trains the digits example on 2 ranks (Open MPI from the
# venv: no system MPI needed). Rank 0 prints the progress bar and the final test accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet '.[cpu,examples]'
.venv/bin/tfposeidon-run -np 2 python examples/train_digits.py "$@"
