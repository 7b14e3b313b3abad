#!/usr/bin/env bash
# Installs tf_poseidon (building its custom ops) into ./.venv and runs the whole test suite
# against the installed package. Exit status is pytest's, except that "no tests collected"
# (pytest's 5) counts as a failure. Without a C++ compiler it stops before pip, with one line
# saying how to get one.
set -uo pipefail
cd "$(dirname "$0")/.."
source ci/venv_install.sh
require_cxx || exit 1
python3 -m venv .venv || exit 1
rm -f "$DEMO_STAMP"  # ci/demo.sh's record of its install, which this one replaces
.venv/bin/pip install --quiet '.[test]' || exit 1
# matplotlib for the tests that draw the benchmark chart, outside site-packages: where Keras can
# import it, every rank of every test job imports it at start-up (tests/conftest.py: plotting).
[ -d .venv/plotting/matplotlib ] ||
    .venv/bin/pip install --quiet --target .venv/plotting 'matplotlib==3.11.2' || exit 1
# A job's ranks leave cores idle while they start and while they wait for each other: pytest
# workers (pytest-xdist) fill them, one per core up to 4 (more would only oversubscribe the
# ranks; TF_POSEIDON_TEST_WORKERS overrides). Each takes whole files, so that the jobs a
# file's tests share (module-scoped fixtures) run once.
cores=$(nproc)
workers=${TF_POSEIDON_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
# The suite must run the compiled op: failing to build or load it is an error, not a fallback.
TF_POSEIDON_REQUIRE_OPS=1 .venv/bin/pytest -p no:cacheprovider -rs --durations=15 \
    -n "$workers" --dist loadfile tests "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "ci/test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"
