#!/usr/bin/env bash
# The main job: prepares the environment if needed, then trains and evaluates the two
# quick-start models on the bundled real data (CPU, a few minutes each):
#   1. Mask R-CNN + FLatten-PVTv2-b0 on COCO images  -> COCO bbox / segm mAP
#   2. Semantic FPN + FLatten-PVTv2-b0 on ADE20K images -> mIoU
# Work dirs: work_dirs/quickstart/{det,seg} (QUICKSTART_WORK_DIR); painted predictions in
# .../show. It ends with a summary: the metrics, what to expect, the next command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
PY="${FLATTEN_MM_VENV:-$ROOT/.venv}/bin/python"
DET=configs/quickstart/mask-rcnn_flatten-pvt-v2-b0_fpn_quickstart_coco-mini.py
SEG=configs/quickstart/fpn_flatten-pvt-v2-b0_quickstart_ade20k-mini.py
OUT=${QUICKSTART_WORK_DIR:-work_dirs/quickstart}

"$PY" tools/train.py "$DET" --work-dir "$OUT/det"
"$PY" tools/test.py "$DET" "$OUT/det/iter_40.pth" --work-dir "$OUT/det" --show-dir "$OUT/det/show"
"$PY" tools/train.py "$SEG" --work-dir "$OUT/seg"
"$PY" tools/test.py "$SEG" "$OUT/seg/iter_40.pth" --work-dir "$OUT/seg" --show-dir "$OUT/seg/show"
"$PY" scripts/quickstart_summary.py "$DET" "$OUT/det" "$SEG" "$OUT/seg"
