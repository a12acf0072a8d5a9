#!/usr/bin/env bash
# The ONE script a GPU session runs (issue #13): kernel checks, profiler tables and the
# benchmark rows, everything written under $OUT, within a time budget.
#
#   OUT=/path/to/out bash scripts/gpu_session.sh          # on the GPU machine
#   bash scripts/gpu_session.sh --dry-run                 # print the commands, run nothing
#   SMOKE=1 OUT=/tmp/x bash scripts/gpu_session.sh        # CPU, tiny models: every command
#                                                         # line runs once (typo check)
#
# Steps, cheapest / most important first so that a cut-off run still leaves useful files
# (estimates for an H200 from docs/benchmarks/cuda_*.csv: a batch-8 training step is ~3x
# the forward, e.g. ~0.3 s per round for FLatten-PVTv2-b0 + two PVTv2-b0 at 1024²):
#   1. environment (nvidia-smi, versions, commit) -> environment.txt          ~5 s
#   2. benchmarks/gpu_kernel_check.py --out $OUT/kernels --compile --safety  <=300 s
#      (when present; SMOKE: --help only, it needs CUDA): FLA and QuadTree kernels in
#      fp32 / bf16 / fp16, head dims up to 128, each with one torch.compile case; the
#      safety checks: first-use verdicts, TF32, bitwise repeats, NaN / Inf, a second
#      device, dynamic shapes under torch.compile
#   2b. the training matrix of tests/test_reliability/test_gpu_path_emulated*.py on the
#      device (FLATTEN_MM_TEST_DEVICE=cuda; CI runs it emulated)              <=300 s
#   3. profile tables, FLatten-PVTv2-b0 / FLatten-Swin-T / QuadTree-B-b0 and
#      their softmax counterparts, batch 8, 512², fp32 then bf16              ~40 s each
#   4. fast paths vs reference paths (pytest -m cuda tests/test_layers/        ~30 s
#      test_fast_paths.py) and the host syncs (benchmark --check)
#   5. step rows (forward + training step, eager, batch 8, 512² / 1024² /
#      800x1344, all four pairs, 4 timed rounds): fp32 and bf16 with the kernels
#      on, fp32 with FLATTEN_MM_TRITON=0 (bf16 off after step 6)             ~90 s each
#   6. whole Mask R-CNN / UperNet training step, batch 2, 800x1344, fp32     ~60 s
#   7. torch.compile rows (inductor, training step at 1024², one step per family
#      of COMPILE_FAMILIES, fp32 then bf16): compiling costs minutes (QuadTree's
#      forward alone took 343 s, hence not in the default)                  ~90-200 s each
#   8. tables.md: README-style tables regenerated from every CSV written     ~10 s
# Estimated ~8.5 min up to step 6 (kernel check ~60 s assumed for FLA; QuadTree adds an
# unmeasured ~1-2 min); bf16 with the kernels off
# runs after step 6, step 7 only in what is left. The budget cuts what does not fit (the
# rows measured so far are saved after every pair and size); ONLY=name,name runs just
# those steps (a second session picks up what was cut: see $OUT/steps.tsv).
# Every step runs under `timeout` (its cap, and never past the budget); a step whose
# minimum does not fit in what is left is skipped. A failure is logged in
# $OUT/steps.tsv and $OUT/logs/<step>.log and the script goes on; the exit status is
# the number of failed steps (0: all ran or were skipped for time).
#
# Knobs (environment): OUT (default work_dirs/gpu_session), BUDGET_S (540 = 9 min),
# DEVICE (cuda), PYTHON (.venv/bin/python when present, else python), COMPILE_FAMILIES,
# STEP_FAMILIES, PROFILE_FAMILIES, SIZES, BATCH, WM_BATCH, REPEATS, ONLY.
set -u
cd "$(dirname "$0")/.."

DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

SMOKE=${SMOKE:-0}
OUT=${OUT:-work_dirs/gpu_session}
BUDGET_S=${BUDGET_S:-540}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
BENCH=(benchmarks/benchmark.py)
if [ "$SMOKE" = 1 ]; then
    # CPU, tiny models and sizes (--quick), inductor replaced by aot_eager (no C++ build),
    # one variant of each parametrised loop: every command line below runs once
    DEVICE=${DEVICE:-cpu}
    QUICK=(--quick --threads 1)
    COMPILE_BACKEND=aot_eager
    AMPS=(fp32); KERNELS=(1); COMPILE_AMPS=(bf16)
    BATCH=${BATCH:-2}; WM_BATCH=1
else
    DEVICE=${DEVICE:-cuda}
    QUICK=()
    COMPILE_BACKEND=inductor
    AMPS=(fp32 bf16); KERNELS=(1 0); COMPILE_AMPS=(fp32 bf16)
fi
ALL_FAMILIES=flatten-pvt-v2-b0,quadtree-b-pvt-v2-b0,flatten-swin-t,sima-xcit-s12-p16
STEP_FAMILIES=${STEP_FAMILIES:-$ALL_FAMILIES}
PROFILE_FAMILIES=${PROFILE_FAMILIES:-flatten-pvt-v2-b0,flatten-swin-t,quadtree-b-pvt-v2-b0}
COMPILE_FAMILIES=${COMPILE_FAMILIES:-flatten-pvt-v2-b0,flatten-swin-t}
SIZES=${SIZES:-512,1024,800x1344}
ONLY=${ONLY:-}
REPEATS=${REPEATS:-4}
BATCH=${BATCH:-8}
WM_BATCH=${WM_BATCH:-2}
if [ "$SMOKE" = 1 ]; then  # --quick runs its own tiny pairs; one is enough here
    FAM=(--families flatten-pvt-v2-tiny); PFAM=(--families flatten-pvt-v2-tiny)
    REPEATS=1
else
    FAM=(--families "$STEP_FAMILIES"); PFAM=(--families "$PROFILE_FAMILIES")
fi

[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT/logs"
LOG="$OUT/session.log"
STATUS="$OUT/steps.tsv"
[ "$DRY_RUN" = 1 ] || printf 'step\tstatus\tseconds\n' > "$STATUS"
START=$(date +%s)
FAILED=0

say() {
    local line="[$(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"
    if [ "$DRY_RUN" = 1 ]; then echo "$line"; else echo "$line" | tee -a "$LOG"; fi
}

# step NAME MIN_S CAP_S COMMAND...: run COMMAND with a timeout of min(CAP_S, time left)
step() {
    local name=$1 min_s=$2 cap_s=$3
    shift 3
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
        [ "$DRY_RUN" = 1 ] || printf '%s\tnot_in_ONLY\t0\n' "$name" >> "$STATUS"
        return 0
    fi
    if [ "$DRY_RUN" = 1 ]; then
        echo "[$name] (min ${min_s}s, cap ${cap_s}s) $*"
        return 0
    fi
    if [ "$left" -lt "$min_s" ]; then
        say "SKIP $name: ${left}s left of the ${BUDGET_S}s budget, needs ${min_s}s"
        printf '%s\tskipped\t0\n' "$name" >> "$STATUS"
        return 0
    fi
    local limit=$(( cap_s < left ? cap_s : left ))
    say "START $name (limit ${limit}s): $*"
    local t0=$(date +%s) rc
    timeout --kill-after=15 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    local dt=$(( $(date +%s) - t0 ))
    if [ "$rc" = 0 ]; then
        say "OK    $name (${dt}s)"
        printf '%s\tok\t%s\n' "$name" "$dt" >> "$STATUS"
    else
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && what="timed out" || what="failed rc=$rc"
        say "FAIL  $name: $what after ${dt}s; last lines of $OUT/logs/$name.log:"
        tail -n 5 "$OUT/logs/$name.log" | sed 's/^/      /' | tee -a "$LOG"
        printf '%s\t%s\t%s\n' "$name" "${what// /_}" "$dt" >> "$STATUS"
        FAILED=$(( FAILED + 1 ))
    fi
    return 0
}

# 1. environment
if [ -n "$ONLY" ] && [[ ",$ONLY," != *",environment,"* ]]; then
    :
elif [ "$DRY_RUN" = 1 ]; then
    echo "[environment] nvidia-smi; $PYTHON (torch / CUDA / triton versions);" \
        "git log -1 > $OUT/environment.txt"
else
    {
        timeout 30 nvidia-smi 2>&1 || echo "no nvidia-smi"
        timeout 60 "$PYTHON" - <<'PY' 2>&1
import importlib.util
import platform

import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python',
      platform.python_version())
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu only')
spec = importlib.util.find_spec('triton')
print('triton', __import__('triton').__version__ if spec else 'absent')
PY
        git log -1 --format='commit %H %s' 2>&1
    } > "$OUT/environment.txt"
    say "environment: $(grep -m1 '^device' "$OUT/environment.txt")"
fi

# 2. kernel checks of the fused kernels against the PyTorch path (another tool's job)
if [ -f benchmarks/gpu_kernel_check.py ]; then
    if [ "$SMOKE" = 1 ]; then  # its CPU behaviour is its own business: import + CLI only
        step kernel_check 0 60 "$PYTHON" benchmarks/gpu_kernel_check.py --help
    else
        step kernel_check 30 300 "$PYTHON" benchmarks/gpu_kernel_check.py --out "$OUT/kernels" \
            --compile --safety --dtypes fp32,bf16,fp16 \
            --cases pvt-v2-b0-stage1,swin-t-stage1,pvt-v2-b0-stage4,pvt-t-stage1,reduced-keys-sr4,head-dim-128,qt-b0-stage2,qt-b1-stage1
    fi
elif [ -z "$ONLY" ] || [[ ",$ONLY," == *",kernel_check,"* ]]; then
    say "SKIP kernel_check: benchmarks/gpu_kernel_check.py is absent"
    [ "$DRY_RUN" = 1 ] || printf 'kernel_check\tabsent\t0\n' >> "$STATUS"
fi

# 2b. the training matrix on the device: every backbone family through the kernels under
#     with_cp, frozen stages, bf16 / fp16 autocast and torch.compile (Inductor), and whole
#     models with with_cp, against the PyTorch path's gradients (CI runs it emulated on the
#     CPU); Triton compiled, not interpreted
if [ "$SMOKE" = 1 ]; then
    MATRIX=(env FLATTEN_MM_TEST_DEVICE=cpu "$PYTHON" -m pytest -q -p no:cacheprovider
            tests/test_reliability/test_gpu_path_emulated.py -k "flatten-pvt-v2-plain")
else
    MATRIX=(env TRITON_INTERPRET=0 FLATTEN_MM_TEST_DEVICE=cuda "$PYTHON" -m pytest -q
            -p no:cacheprovider tests/test_reliability/test_gpu_path_emulated.py
            tests/test_reliability/test_gpu_path_emulated_models.py)
fi
if [ "$DRY_RUN" = 1 ] || "$PYTHON" -c 'import pytest' 2>/dev/null; then
    step training_matrix 60 300 "${MATRIX[@]}" --junitxml "$OUT/training_matrix.xml"
else
    say "SKIP training_matrix: pytest is not installed for $PYTHON"
    printf '%s\tskipped_no_pytest\t0\n' training_matrix >> "$STATUS"
fi

# 3. profiler tables (batch 8, 512²)
for amp in "${AMPS[@]}"; do
    step "profile_$amp" 30 150 "$PYTHON" "${BENCH[@]}" "${QUICK[@]}" --profile "${PFAM[@]}" \
        --device "$DEVICE" --amp "$amp" --batch "$BATCH" --resolutions 512 \
        --csv "$OUT/profile_$amp.csv" --markdown "$OUT/profile_$amp.md"
done

# 4. fast paths vs reference paths on the device: the cuda-marked tests of the one
#    fast-path harness (TF32 off; they skip without CUDA), then the ops that make the
#    host wait for the device
if [ "$DRY_RUN" = 1 ] || "$PYTHON" -c 'import pytest' 2>/dev/null; then
    step fast_paths 20 150 env TRITON_INTERPRET=0 "$PYTHON" -m pytest -m cuda -q \
        -p no:cacheprovider tests/test_layers/test_fast_paths.py \
        --junitxml "$OUT/fast_paths.xml"
else
    say "SKIP fast_paths: pytest is not installed for $PYTHON"
    printf '%s\tskipped_no_pytest\t0\n' fast_paths >> "$STATUS"
fi
step check 20 90 "$PYTHON" "${BENCH[@]}" --check --device "$DEVICE" --json "$OUT/check.json"

# 5. forward + training-step rows, eager: kernels on (fp32, bf16), kernels off (fp32)
steps_run() {  # steps_run AMP KERNELS
    step "steps_${1}_triton$2" 60 200 env FLATTEN_MM_TRITON="$2" "$PYTHON" "${BENCH[@]}" \
        "${QUICK[@]}" --steps forward,train --execs eager "${FAM[@]}" --device "$DEVICE" \
        --amp "$1" --batch "$BATCH" --resolutions "$SIZES" --repeats "$REPEATS" \
        --csv "$OUT/steps_${1}_triton$2.csv" --json "$OUT/steps_${1}_triton$2.json"
}
for k in "${KERNELS[@]}"; do
    for amp in "${AMPS[@]}"; do
        [ "$k" = 0 ] && [ "$amp" = bf16 ] && continue  # after the whole models
        steps_run "$amp" "$k"
    done
done

# 6. whole models: Mask R-CNN (FLatten-PVTv2-b0 vs mmdet PVTv2-b0), UperNet (FLatten-Swin-T
#    vs mmseg Swin-T), one training step at batch 2
step whole_models_fp32 45 150 "$PYTHON" "${BENCH[@]}" "${QUICK[@]}" --whole-models \
    --device "$DEVICE" --amp fp32 --batch "$WM_BATCH" --resolutions 800x1344 \
    --csv "$OUT/whole_models_fp32.csv" --json "$OUT/whole_models_fp32.json"
[[ " ${KERNELS[*]} " == *" 0 "* ]] && [[ " ${AMPS[*]} " == *" bf16 "* ]] && steps_run bf16 0

# 7. torch.compile rows: training step, compiled ours vs compiled baselines in one run,
#    one family per step (each compiles 2-3 models, forward + backward)
IFS=, read -r -a cfams <<< "$COMPILE_FAMILIES"
[ "$SMOKE" = 1 ] && cfams=(quick)
for amp in "${COMPILE_AMPS[@]}"; do
    for fam in "${cfams[@]}"; do
        if [ "$SMOKE" = 1 ]; then famarg=(); else famarg=(--families "$fam"); fi
        step "compile_${amp}_$fam" 90 240 "$PYTHON" "${BENCH[@]}" "${QUICK[@]}" --steps train \
            --execs compile --compile-backend "$COMPILE_BACKEND" "${famarg[@]}" \
            --device "$DEVICE" --amp "$amp" --batch "$BATCH" --resolutions 1024 \
            --repeats "$REPEATS" --csv "$OUT/compile_${amp}_$fam.csv" \
            --json "$OUT/compile_${amp}_$fam.json"
    done
done

# 8. README-style tables from every CSV written (runs whatever the budget says)
if [ "$DRY_RUN" = 1 ]; then
    echo "[tables] $PYTHON ${BENCH[*]} --markdown $OUT/tables.md --from-csv <every CSV in $OUT>"
else
    csvs=$(ls "$OUT"/steps_*.csv "$OUT"/whole_models_*.csv "$OUT"/compile_*.csv \
        "$OUT"/profile_*.csv 2>/dev/null | paste -sd, -)
    if [ -n "$csvs" ]; then
        BUDGET_S=$(( BUDGET_S + 60 )) step tables 0 60 "$PYTHON" "${BENCH[@]}" \
            --markdown "$OUT/tables.md" --from-csv "$csvs"
    else
        say "SKIP tables: no CSV was written"
    fi
    say "done in $(( $(date +%s) - START ))s, $FAILED failed step(s); see $STATUS"
fi
exit "$FAILED"
