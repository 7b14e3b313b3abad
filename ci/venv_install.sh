# Sourced (from the repository root) by ci/demo.sh and ci/test.sh, which install tf_poseidon into
# ./.venv: the check that must come before pip, and ci/demo.sh's record of what it installed.
# Defines functions and one variable; sourcing it runs nothing.

# ci/demo.sh's record of its last install: source_digest of what it installed (ci/test.sh, which
# installs other extras into the same venv, removes it).
DEMO_STAMP=.venv/.demo-installed

# require_cxx: returns 0 when the C++ compiler that building the ops will use ($CXX, else g++)
# is on PATH. Else prints one line to stderr naming it and how to get one, and returns 1. The
# same test and words as kernels/build.py's compiler(), which setup.py runs for any other pip
# install; here it comes before pip, which would otherwise first spend a minute or more
# installing the build environment's TensorFlow.
require_cxx() {
    local intro="tf_poseidon needs a C++17 compiler to build its ops"
    if [ -n "${CXX:-}" ]; then
        command -v "$CXX" > /dev/null && return 0
        echo "$intro: CXX=$CXX is not found on PATH; set CXX to an installed compiler" \
             "(e.g. CXX=g++)" >&2
        return 1
    fi
    command -v g++ > /dev/null && return 0
    echo "$intro: g++ is not found on PATH; install it (Debian/Ubuntu: apt install g++;" \
         "Fedora/RHEL: dnf install gcc-c++) or set CXX to another C++17 compiler" >&2
    return 1
}

# source_digest EXTRAS: prints one SHA-256 over the pip requirement EXTRAS (e.g. '.[cpu]') and
# the content of every file an install is made from (setup.py, setup.cfg, pyproject.toml,
# kernels/, tf_poseidon/; compiled files left out), in a fixed order.
source_digest() {
    {
        echo "$1"
        find setup.py setup.cfg pyproject.toml kernels tf_poseidon -type f \
            ! -name '*.pyc' ! -name '*.so' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
}

# demo_install_is_current EXTRAS: true when .venv holds an install that ci/demo.sh made of
# EXTRAS from these very sources (its launcher is there and DEMO_STAMP holds source_digest).
demo_install_is_current() {
    [ -x .venv/bin/tfposeidon-run ] &&
        [ "$(cat "$DEMO_STAMP" 2> /dev/null)" = "$(source_digest "$1")" ]
}
