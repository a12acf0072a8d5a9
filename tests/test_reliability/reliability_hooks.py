"""Test-only mmengine hook and metric used by the distributed / resume tests.

Imported by the test configs through ``custom_imports`` (the test puts this directory on
``PYTHONPATH``); it registers into mmengine's root registries, which the mmseg / mmdet
registries fall back to.

* ``RecordLossHook`` appends ``{"iter", "rank", "loss"}`` (full float precision) of every
  training iteration to ``<out_dir>/losses_rank<r>.jsonl``, one file per rank (mmengine's
  own logs only keep rank 0 and round values). With the environment variable
  ``FLATTEN_MM_TEST_HANG_AFTER_ITER=k`` it writes ``<out_dir>/hanging`` after iteration
  ``k`` (after the checkpoint hook ran) and sleeps, so a test can kill a job that is
  known to be mid-run with a checkpoint on disk.
* ``GatheredSamplesMetric`` records the image paths that reach ``compute_metrics`` on
  rank 0 after mmengine gathered the results of all ranks, into
  ``<out_dir>/gathered_<n>.json``.
"""
import json
import os
import os.path as osp
import time
from typing import Optional, Sequence

from mmengine.dist import get_rank
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, METRICS


@HOOKS.register_module(force=True)
class RecordLossHook(Hook):
    """Write each rank's training losses to ``out_dir`` (see the module docstring)."""

    priority = 'LOWEST'  # after CheckpointHook (VERY_LOW)

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def after_train_iter(self, runner, batch_idx: int, data_batch=None,
                         outputs: Optional[dict] = None) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        rank = get_rank()
        record = dict(iter=runner.iter + 1, rank=rank,
                      loss=float(outputs['loss']) if outputs else float('nan'))
        with open(osp.join(self.out_dir, f'losses_rank{rank}.jsonl'), 'a') as f:
            f.write(json.dumps(record) + '\n')
        hang = os.environ.get('FLATTEN_MM_TEST_HANG_AFTER_ITER')
        if hang is not None and runner.iter + 1 == int(hang):
            with open(osp.join(self.out_dir, 'hanging'), 'w') as f:
                f.write(str(os.getpid()))
            while True:  # a long job, killed by the test
                time.sleep(1)


@METRICS.register_module(force=True)
class GatheredSamplesMetric(BaseMetric):
    """Record which samples reach rank 0's ``compute_metrics`` (after the gather)."""

    def __init__(self, out_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.calls = 0

    def process(self, data_batch, data_samples: Sequence[dict]) -> None:
        for sample in data_samples:
            self.results.append(dict(img_path=sample['img_path'], rank=get_rank()))

    def compute_metrics(self, results: list) -> dict:
        self.calls += 1
        os.makedirs(self.out_dir, exist_ok=True)
        with open(osp.join(self.out_dir, f'gathered_{self.calls}.json'), 'w') as f:
            json.dump(results, f)
        return dict(num_samples=len(results),
                    num_ranks=len({r['rank'] for r in results}))
