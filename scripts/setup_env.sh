#!/usr/bin/env bash
# One-command environment for flatten_mm: fresh clone -> working venv.
#
#   bash scripts/setup_env.sh            # creates ./.venv (or $FLATTEN_MM_VENV)
#
# Why it is not a plain `pip install -e .`:
# * mmdet 3.3.0 / mmseg 1.2.2 (latest) require 2.0.0rc4 <= mmcv < 2.2.0, and mmcv 2.1.0
#   ships only as a source distribution. Its compiled ops (nms, roi_align, ...) are needed
#   at import time by mmdet/mmseg. We build it once against the installed torch
#   (C++20 for torch >= 2.14 headers, setuptools < 82 for pkg_resources,
#   --no-build-isolation): its CPU ops on a machine without a GPU, its CUDA ops for the
#   visible GPUs (scripts/mmcv_ops.py decides; FLATTEN_MM_MMCV_OPS=cuda|cpu asks), and cache
#   the wheel per torch version and flavour in $FLATTEN_MM_CACHE (default
#   ~/.cache/flatten_mm/wheels), outside the checkout, so later runs and CI reuse it.
# * mmdet / mmseg / mmpretrain are installed with --no-deps because their own requirement
#   pins are ancient; their runtime needs are listed as extras of our setup.py.
# * flatten_mm's optional ONNX Runtime operator (flatten_mm/deploy/ort_ops.py) compiles
#   against ONNX Runtime's C API headers, which the onnxruntime wheels do not ship: the
#   system's libonnxruntime-dev (`apt-get install libonnxruntime-dev` where the distribution
#   has it: Debian 13, Ubuntu) or a folder named by FLATTEN_MM_ORT_INCLUDE; without them the
#   operator is skipped, with one line saying how to get it.
#
# Variables: FLATTEN_MM_VENV, FLATTEN_MM_CACHE, FLATTEN_MM_MMCV_OPS, TORCH_CUDA_ARCH_LIST,
# CUDA_HOME / CUDA_PATH, MAX_JOBS, CXX, PYTHON (docs/get_started.md#environment-variables).
# Idempotent: re-running only installs what is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLATTEN_MM_VENV:-$ROOT/.venv}"
CACHE="${FLATTEN_MM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flatten_mm/wheels}"
PY="${PYTHON:-python3}"

TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
MMCV_VERSION=2.1.0

t0=$(date +%s)
log() { echo "[setup_env +$(( $(date +%s) - t0 ))s] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv at $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q --upgrade pip 'setuptools<82' wheel ninja

have() { "$VPY" - "$@" <<'PYEOF'
import sys
from importlib import metadata
name, version = sys.argv[1], sys.argv[2]
try:
    sys.exit(0 if metadata.version(name) == version else 1)
except metadata.PackageNotFoundError:
    sys.exit(1)
PYEOF
}

if ! have torch "$TORCH_VERSION" || ! have torchvision "$TORCHVISION_VERSION"; then
  log "installing torch $TORCH_VERSION / torchvision $TORCHVISION_VERSION"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

# which ops mmcv is built with follows the machine (scripts/mmcv_ops.py: no GPU visible ->
# CPU ops; a GPU visible -> CUDA ops for it; FLATTEN_MM_MMCV_OPS=cuda|cpu asks for one);
# it stops here, before any build, when nvcc is missing or mismatched. A switch given here
# is remembered by the environment (later runs, e.g. by run_tests.sh, keep it, and every
# message that depends on it names the file)
if [ -n "${FLATTEN_MM_MMCV_OPS:-}" ]; then
  echo "$FLATTEN_MM_MMCV_OPS" > "$VENV/.flatten_mm_mmcv_ops"
fi
PLAN=$("$VPY" "$ROOT/scripts/mmcv_ops.py" plan) || {
  echo "setup_env: stopped before building mmcv (see the message above)" >&2; exit 1; }
eval "$PLAN"   # MMCV_OPS, MMCV_TAG, and the build's MAX_JOBS / FORCE_CUDA / CUDA_HOME / TORCH_CUDA_ARCH_LIST
INSTALLED=$("$VPY" "$ROOT/scripts/mmcv_ops.py" flavour)
if ! have mmcv "$MMCV_VERSION" || [ "$INSTALLED" = none ] \
    || { [ "$MMCV_OPS" = cuda ] && [ "$INSTALLED" != cuda ]; }; then
  mkdir -p "$CACHE"
  TV=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
  # the wheel is cached per torch version and ops flavour (cpu, cu130-sm90, ...)
  WHEEL_DIR="$CACHE/mmcv-$MMCV_VERSION-torch$TV-$MMCV_TAG"
  WHEEL=$(ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$WHEEL" ] && [ "$MMCV_OPS" = cpu ]; then
    # (earlier setups cached without a flavour; any of those wheels has the CPU ops)
    WHEEL=$(ls "$CACHE/mmcv-$MMCV_VERSION-torch$TV"/mmcv-"$MMCV_VERSION"-*.whl 2>/dev/null \
      | head -n1 || true)
  fi
  if [ -z "$WHEEL" ]; then
    log "building mmcv $MMCV_VERSION with $MMCV_OPS ops against torch $TV (once; the CPU ops take ~15 min on 2 cores, the CUDA ops longer; log: $CACHE/mmcv-build.log)"
    BUILD=$(mktemp -d)
    "${PIP[@]}" download -q --no-deps --no-build-isolation --no-binary :all: "mmcv==$MMCV_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/mmcv-"$MMCV_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/mmcv-$MMCV_VERSION"
    sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$SRC/setup.py"
    mkdir -p "$WHEEL_DIR.partial"
    LOG="$CACHE/mmcv-build.log"
    if ! (cd "$SRC" && MMCV_WITH_OPS=1 \
      "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$WHEEL_DIR.partial" . > "$LOG" 2>&1); then
      tail -n 60 "$LOG"; echo "mmcv build failed; full log: $LOG" >&2; exit 1
    fi
    rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.partial" "$WHEEL_DIR"
    rm -rf "$BUILD"
    WHEEL=$(ls "$WHEEL_DIR"/mmcv-"$MMCV_VERSION"-*.whl | head -n1)
  else
    log "reusing cached mmcv wheel $WHEEL"
  fi
  "${PIP[@]}" install -q --force-reinstall --no-deps "$WHEEL"
fi

if ! have mmdet 3.3.0 || ! have mmsegmentation 1.2.2 || ! have mmpretrain 1.2.0; then
  log "installing mmdet 3.3.0, mmsegmentation 1.2.2 and mmpretrain 1.2.0 (--no-deps)"
  "${PIP[@]}" install -q --no-deps mmdet==3.3.0 mmsegmentation==1.2.2 mmpretrain==1.2.0
fi

log "installing flatten_mm (editable) with extras det,seg,cls,dev,deploy (onnx, onnxruntime, onnxscript)"
"${PIP[@]}" install -q --no-build-isolation -e "$ROOT[det,seg,cls,dev,deploy]"

# (after the extras: mmcv was installed without its dependencies, opencv and mmengine)
# the ops run on the CPU and on a visible GPU; a CPU-only mmcv meeting a GPU stops here
"$VPY" "$ROOT/scripts/mmcv_ops.py" verify $([ "$MMCV_OPS" = cuda ] && echo cuda) || {
  echo "setup_env: the installed mmcv cannot serve this machine (see above)" >&2; exit 1; }

"$VPY" - <<'PYEOF'
import mmcv, mmcv.ops, mmdet, mmseg, mmpretrain, mmengine, timm, torch
import mmpretrain.models
import onnx, onnxruntime, onnxscript
import flatten_mm
print(f'torch {torch.__version__} | mmcv {mmcv.__version__} (ops ok) | mmengine {mmengine.__version__} | '
      f'mmdet {mmdet.__version__} | mmseg {mmseg.__version__} | mmpretrain {mmpretrain.__version__} | '
      f'timm {timm.__version__} | flatten_mm {flatten_mm.__version__}')
print(f'onnx {onnx.__version__} | onnxruntime {onnxruntime.__version__} | onnxscript {onnxscript.__version__}')
PYEOF
log "building the fused QuadTree CPU kernel (once per machine and torch version)"
"$VPY" - <<'PYEOF' || log "(the kernel is optional: the pure-PyTorch path is used without it)"
import warnings
from flatten_mm.models.ops import quadtree_cpu as cpu_kernels
with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    cpu_kernels.quadtree_level_kernel()
print('flatten_mm CPU kernels:', cpu_kernels.status())
PYEOF
log "building flatten_mm's ONNX Runtime operators (optional; where ONNX Runtime's C API headers are found)"
"$VPY" - <<'PYEOF' || log "(optional: export_onnx(custom_ops=True) falls back to standard operators)"
import warnings
from flatten_mm.deploy import ort_ops
if ort_ops.header_dir() is None:
    print('skipped the optional ONNX Runtime operator library:', ort_ops.missing_headers_message())
else:
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        ort_ops.library_path()
    print('flatten_mm ONNX Runtime operators:', ort_ops.status())
PYEOF
log "done: activate with 'source $VENV/bin/activate'"
