"""Speed and memory benchmark of the attention operators and backbones.

Suites, all measured the same way (``timing``):

* **op level** (``ops``) -- each attention on given ``q, k, v`` (after the projections)
  over a range of token counts ``N = s x s`` and head dims: Focused Linear Attention
  (fused and unfused), a plain ReLU linear attention of the same shape (the yardstick of
  the FLA kernel), SimA in both matmul orders and its automatic choice, QuadTree A/B
  (pyramid + attention, no projections) and softmax attention through
  ``F.scaled_dot_product_attention``;
* **backbone level** (``cases``) -- each flatten_mm backbone against its softmax
  counterpart from timm and (if installed) mmdet, at several input resolutions,
  inference;
* **training step** (``train``) -- forward + backward + AdamW step of the same backbones
  (and of whole detectors / segmentors and ImageNet classifiers built from configs: what
  fine-tuning and pretraining cost), optionally under bf16
  autocast and ``torch.compile``, with the peak memory of a step;
* **profile** (``profiling``) -- one forward + backward under ``torch.profiler``: top
  kernels by self time, launches per forward / backward and per block, bytes moved
  against the ideal of the attention (without a GPU: with our operators on their Triton
  kernels, run by Triton's interpreter);
* **host syncs** (``syncs``) -- the ops of a forward / backward that make the host wait
  for the device (``.item()``, tensors from Python data, value-dependent sizes), found
  on any device.

Timing: every case of a group (all ops at one shape, or one backbone family with its
baselines at one resolution) runs in the same process, **alternating** round-robin after
warm-up, so slow drifts (other processes, allocator state, CPU frequency) hit all sides
alike. Reported are the median and the minimum of the per-call wall times (CUDA: CUDA
events), the median per-call process CPU time (CPU only; less sensitive to other
processes on a shared machine), images/s, and the peak memory of one call (CUDA: the
caching allocator's peak; CPU: the peak of the allocations recorded by the PyTorch
profiler). Ratios are given both as a ratio of medians and as the median of the
per-round ratios.

Everything is importable without mmdet; the backbones of this package need mmengine
(``flatten_mm.models``), the baselines timm (and optionally mmdet). Results are plain
dicts (one per measured case), written as a table, a CSV / JSON (``output``) and a
log-log PNG with the fitted scaling exponent of every op (``plots``). Modules:
``timing`` (protocol), ``ops``, ``cases`` (backbones and ratios), ``train``,
``profiling``, ``syncs``, ``compilation`` (graph breaks), ``scale`` (largest image),
``output``, ``plots``, ``env``.
"""
from .cases import (BACKBONE_PAIRS, RESOLUTIONS, BackboneCase, backbone_cases, parse_ints,
                    parse_resolutions, quick_pairs, ratio_rows, run_backbone_benchmark,
                    select_pairs, tiny_backbones)
from .env import environment
from .compilation import compile_report
from .ops import (OPS, QUADRATIC_OPS, make_op, op_exponents, quadtree_levels,
                  relu_linear_attention, run_op_benchmark, run_sima_order_grid)
from .output import (BACKBONE_COLUMNS, CSV_COLUMNS, OP_COLUMNS, RATIO_COLUMNS, SIMA_COLUMNS,
                     STEP_COLUMNS, STEP_RATIO_COLUMNS, CLASSIFIER_COLUMNS,
                     CLASSIFIER_RATIO_COLUMNS, format_table, markdown_ratio_table,
                     read_csv, write_csv)
from .plots import plot_scale, plot_scaling
from .profiling import KERNEL_COLUMNS, PROFILE_COLUMNS, profile_backbone, run_profile
from .syncs import backbone_host_syncs, host_syncs, training_step_syncs
from .timing import Timing, fit_exponent, measure_alternating, peak_memory_bytes
from .train import (CLASSIFIER_BATCHES, CLASSIFIER_PAIRS, EXECS, STEPS, TRAIN_RESOLUTIONS,
                    WHOLE_MODEL_PAIRS, backbone_step, classifier_pairs, output_loss,
                    run_classifier_benchmark, run_step_benchmark, run_whole_model_benchmark,
                    step_ratio_rows, whole_model_pairs)

__all__ = [
    'BACKBONE_COLUMNS', 'BACKBONE_PAIRS', 'CSV_COLUMNS', 'EXECS', 'KERNEL_COLUMNS', 'OPS',
    'OP_COLUMNS', 'PROFILE_COLUMNS', 'QUADRATIC_OPS', 'RATIO_COLUMNS', 'RESOLUTIONS',
    'SIMA_COLUMNS', 'STEPS', 'STEP_COLUMNS', 'STEP_RATIO_COLUMNS', 'CLASSIFIER_COLUMNS',
    'CLASSIFIER_RATIO_COLUMNS', 'TRAIN_RESOLUTIONS',
    'WHOLE_MODEL_PAIRS', 'BackboneCase', 'Timing', 'backbone_step', 'markdown_ratio_table',
    'output_loss', 'parse_ints', 'parse_resolutions', 'profile_backbone', 'run_profile', 'backbone_host_syncs', 'host_syncs',
    'training_step_syncs', 'run_step_benchmark', 'run_whole_model_benchmark',
    'step_ratio_rows', 'whole_model_pairs', 'CLASSIFIER_BATCHES', 'CLASSIFIER_PAIRS',
    'classifier_pairs', 'run_classifier_benchmark',
    'backbone_cases', 'plot_scale', 'compile_report', 'environment', 'fit_exponent',
    'format_table', 'make_op', 'measure_alternating', 'op_exponents', 'peak_memory_bytes',
    'plot_scaling', 'quick_pairs', 'quadtree_levels', 'ratio_rows', 'read_csv',
    'relu_linear_attention', 'run_backbone_benchmark', 'run_op_benchmark',
    'run_sima_order_grid', 'select_pairs', 'tiny_backbones', 'write_csv'
]
