"""Degenerate inputs to the native QuadTree operators raise named errors, never crash
(issue #56): the fused PyTorch CPU kernel (``torch.ops.flatten_mm.quadtree_level`` and its
backward) and the ONNX Runtime operator (``flatten_mm::QuadTreeLevel``). Each operator's
cases run in one subprocess, one after another: a crash (a negative return code: SIGSEGV,
SIGABRT from std::terminate) fails the case it stopped in; a Python exception with the
expected message passes. Also: an exception thrown inside a thread-pool callback of the
shared C++ forward (``quadtree_level.h``: a bad_alloc on a worker thread) is carried out to
the caller instead of reaching std::terminate.

The ONNX Runtime cases need the operator library (ONNX Runtime's C API headers: skipped
without them, naming the system package); the PyTorch cases need the compiled kernel
(skipped with the build error, an error in CI)."""
import json
import os
import os.path as osp
import re
import shutil
import subprocess
import sys

import pytest

#: tests/ (the subprocesses import its ort_level_model)
TESTS_DIR = osp.dirname(osp.dirname(osp.abspath(__file__)))

from flatten_mm.models.ops import quadtree_cpu as cpu_kernels

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CSRC = osp.join(REPO, 'flatten_mm', 'models', 'ops', 'csrc')

# Shared by both scripts: run each case in turn, print its result as one JSON line (the
# case's name goes out first, flushed, so a crash names the case it stopped in).
_RUNNER = r'''
import json, sys, traceback
import numpy as np
import torch

def run(cases):
    for name, case in cases.items():
        print(json.dumps({'start': name}), flush=True)
        try:
            out = case()
            result = {'ok': [list(np.shape(o)) for o in out]}
        except Exception as e:  # what the test wants: a clean, named error
            result = {'error': f'{type(e).__name__}: {e}'}
        print(json.dumps(dict(result, case=name)), flush=True)
'''

_TORCH_CASES = _RUNNER + r'''
from flatten_mm.models.ops import quadtree_cpu
op = quadtree_cpu.quadtree_level_kernel()
backward = torch.ops.flatten_mm.quadtree_level_backward
g = torch.Generator().manual_seed(0)
BH, W, M, d, Kp = 2, 8, 64, 8, 2
q = torch.randn(BH, M, d, generator=g)
idx = torch.randint(0, M // 4, (BH, M // 4, Kp), generator=g)
score = torch.rand(BH, M // 4, Kp, generator=g)
none = torch.empty(BH, M, 0, dtype=torch.long)

def fwd(q=q, k=q, v=q, idx=idx, score=None, msg=None, width=W, topk=2, type_a=False):
    msg = torch.zeros_like(q) if msg is None else msg
    return op(q, k, v, idx, score, msg, width, 0.5, topk, type_a)

def bwd(grad=q, q=q, k=q, v=q, idx=idx, score=None, next_idx=none, type_a=False):
    return backward(grad, q, k, v, idx, score, next_idx, None, W, 0.5, type_a)

empty_q = torch.zeros(0, M, d)
empty_idx = torch.zeros(0, M // 4, Kp, dtype=torch.long)
run({
    'kp0': lambda: fwd(idx=idx[..., :0].contiguous(), topk=0),
    'kp0_variant_a': lambda: fwd(idx=idx[..., :0].contiguous(), score=score[..., :0].contiguous(),
                                 topk=0, type_a=True),
    'kp0_backward': lambda: bwd(idx=idx[..., :0].contiguous()),
    'empty_batch': lambda: fwd(q=empty_q, k=empty_q, v=empty_q, idx=empty_idx),
    'empty_batch_variant_a': lambda: fwd(q=empty_q, k=empty_q, v=empty_q, idx=empty_idx,
                                         score=torch.zeros(0, M // 4, Kp), type_a=True),
    'empty_batch_backward': lambda: bwd(grad=empty_q, q=empty_q, k=empty_q, v=empty_q,
                                        idx=empty_idx, next_idx=none[:0]),
    'empty_map': lambda: fwd(q=torch.zeros(BH, 0, d), k=torch.zeros(BH, 0, d),
                             v=torch.zeros(BH, 0, d), idx=torch.zeros(BH, 0, Kp, dtype=torch.long)),
    'mismatched_k': lambda: fwd(k=torch.randn(BH, M // 2, d)),
    'mismatched_msg': lambda: fwd(msg=torch.zeros(BH, M, d + 1)),
    'mismatched_prev_idx': lambda: fwd(idx=idx[:1].contiguous()),
    'mismatched_prev_score': lambda: fwd(score=score[..., :1].contiguous(), type_a=True),
    'missing_prev_score': lambda: fwd(type_a=True),
    'mismatched_backward_grad': lambda: bwd(grad=q[:1].contiguous()),
    'rank_2_q': lambda: fwd(q=q[0], k=q[0], v=q[0]),
    'odd_width': lambda: fwd(width=3),
    'zero_width': lambda: fwd(width=0),
    'topk_too_large': lambda: fwd(topk=4 * Kp + 1),
    'float64_q': lambda: fwd(q=q.double()),
    'float64_prev_score': lambda: fwd(score=score.double(), type_a=True),
    'int32_prev_idx': lambda: fwd(idx=idx.int()),
    'float64_backward': lambda: bwd(grad=q.double()),
    'non_contiguous_q': lambda: fwd(q=torch.randn(BH, d, M).transpose(1, 2)),
    'non_contiguous_prev_idx': lambda: fwd(idx=torch.zeros(BH, Kp, M // 4, dtype=torch.long)
                                           .transpose(1, 2)),
    'non_contiguous_msg': lambda: fwd(msg=torch.zeros(BH, d, M).transpose(1, 2)),
    'cell_past_the_grid': lambda: fwd(idx=torch.full_like(idx, M // 4)),
    'negative_cell': lambda: fwd(idx=idx - idx.max() - 1),
    'cell_past_the_grid_backward': lambda: bwd(idx=torch.full_like(idx, M // 4)),
})
'''

_ORT_CASES = _RUNNER + r'''
import onnxruntime as ort
from flatten_mm.deploy import ort_ops

def model(width=8, topk=2, type_a=False):
    from ort_level_model import level_model  # (tests/, on PYTHONPATH)
    m = level_model(ort_ops.DOMAIN, type_a, width, 0.5, topk)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 4
    ort_ops.register(opts)
    return ort.InferenceSession(m, opts, providers=['CPUExecutionProvider'])

rng = np.random.default_rng(0)
BH, W, M, d, Kp = 2, 8, 64, 8, 2
q = rng.standard_normal((BH, M, d)).astype(np.float32)
idx = rng.integers(0, M // 4, (BH, M // 4, Kp))
score = rng.random((BH, M // 4, Kp)).astype(np.float32)
empty = np.zeros(0, np.float32)
sessions = {}

def run_op(q=q, k=q, v=q, idx=idx, score=empty, init=empty, width=W, topk=2, type_a=False):
    key = (width, topk, type_a)
    if key not in sessions:
        sessions[key] = model(width, topk, type_a)
    return sessions[key].run(None, dict(q=q, k=k, v=v, prev_idx=idx, prev_score=score,
                                        init=init))

z = lambda *s: np.zeros(s, np.float32)
run({
    'kp0': lambda: run_op(idx=idx[..., :0], topk=0),
    'kp0_variant_a': lambda: run_op(idx=idx[..., :0], score=score[..., :0], topk=0, type_a=True),
    'empty_batch': lambda: run_op(q=z(0, M, d), k=z(0, M, d), v=z(0, M, d),
                                  idx=np.zeros((0, M // 4, Kp), np.int64)),
    'empty_batch_variant_a': lambda: run_op(q=z(0, M, d), k=z(0, M, d), v=z(0, M, d),
                                            idx=np.zeros((0, M // 4, Kp), np.int64),
                                            score=z(0, M // 4, Kp), type_a=True),
    'empty_map': lambda: run_op(q=z(BH, 0, d), k=z(BH, 0, d), v=z(BH, 0, d),
                                idx=np.zeros((BH, 0, Kp), np.int64)),
    'mismatched_k': lambda: run_op(k=z(BH, M // 2, d)),
    'mismatched_prev_idx': lambda: run_op(idx=idx[:1]),
    'mismatched_prev_score': lambda: run_op(score=score[..., :1].copy(), type_a=True),
    'mismatched_init': lambda: run_op(init=z(BH, M, d + 1)),
    'rank_2_q': lambda: run_op(q=q[0], k=q[0], v=q[0]),
    'odd_width': lambda: run_op(width=3),
    'zero_width': lambda: run_op(width=0),
    'topk_too_large': lambda: run_op(topk=4 * Kp + 1),
    'float64_q': lambda: run_op(q=q.astype(np.float64)),
    'int32_prev_idx': lambda: run_op(idx=idx.astype(np.int32)),
    'non_contiguous_q': lambda: run_op(q=np.ascontiguousarray(q.transpose(0, 2, 1))
                                       .transpose(0, 2, 1)),
    'cell_past_the_grid': lambda: run_op(idx=np.full_like(idx, M // 4)),
    'negative_cell': lambda: run_op(idx=idx - idx.max() - 1),
})
'''

# case -> expected: ('ok', output shapes) or ('error', regex of the message)
TORCH_EXPECTED = {
    'kp0': ('error', r'quadtree_level: prev_idx has no selected cells \(Kp = 0\)'),
    'kp0_variant_a': ('error', r'quadtree_level: prev_idx has no selected cells \(Kp = 0\)'),
    'kp0_backward': ('error', r'quadtree_level_backward: prev_idx has no selected cells'),
    'empty_batch': ('ok', [[0, 64, 2], [0, 64, 0]]),
    'empty_batch_variant_a': ('ok', [[0, 64, 2], [0, 64, 2]]),
    'empty_batch_backward': ('ok', [[0, 64, 8], [0, 64, 8], [0, 64, 8], [0]]),
    'empty_map': ('ok', [[2, 0, 2], [2, 0, 0]]),
    'mismatched_k': ('error', r'q, k and v must have the same shape'),
    'mismatched_msg': ('error', r'msg must be a contiguous float32 CPU tensor shaped like q'),
    'mismatched_prev_idx': ('error', r'prev_idx must be \(BH, M / 4, Kp\)'),
    'mismatched_prev_score': ('error', r'prev_score must be a float32 CPU tensor like prev_idx'),
    'missing_prev_score': ('error', r'variant A needs prev_score'),
    'mismatched_backward_grad': ('error', r'quadtree_level_backward: grad must be'),
    'rank_2_q': ('error', r'q must be \(BH, M, d\)'),
    'odd_width': ('error', r'the level must have even height and width'),
    'zero_width': ('error', r'the level must have even height and width'),
    'topk_too_large': ('error', r'topk must be in \[0, 4 Kp\]'),
    'float64_q': ('error', r'q must be float32'),
    'float64_prev_score': ('error', r'prev_score must be a float32'),
    'int32_prev_idx': ('error', r'prev_idx must be int64'),
    'float64_backward': ('error', r'grad must be a contiguous float32'),
    'non_contiguous_q': ('error', r'q must be contiguous'),
    'non_contiguous_prev_idx': ('error', r'prev_idx must be contiguous'),
    'non_contiguous_msg': ('error', r'msg must be a contiguous'),
    'cell_past_the_grid': ('error', r'prev_idx entry 16 is outside the parent grid of 16'),
    'negative_cell': ('error', r'prev_idx entry -\d+ is outside the parent grid'),
    'cell_past_the_grid_backward': ('error', r'prev_idx entry 16 is outside the parent grid'),
}

_OP = r'flatten_mm::QuadTreeLevel: '
ORT_EXPECTED = {
    'kp0': ('error', _OP + r'prev_idx has no selected cells \(Kp = 0\)'),
    'kp0_variant_a': ('error', _OP + r'prev_idx has no selected cells \(Kp = 0\)'),
    'empty_batch': ('ok', [[0, 64, 8], [0, 64, 2], [0, 64, 0]]),
    'empty_batch_variant_a': ('ok', [[0, 64, 8], [0, 64, 2], [0, 64, 2]]),
    'empty_map': ('ok', [[2, 0, 8], [2, 0, 2], [2, 0, 0]]),
    'mismatched_k': ('error', _OP + r'q, k and v must have the same shape'),
    'mismatched_prev_idx': ('error', _OP + r'prev_idx must be \(BH, M / 4, Kp\)'),
    'mismatched_prev_score': ('error', _OP + r'variant A: prev_score must be shaped like'),
    'mismatched_init': ('error', _OP + r'init must be empty or shaped like q'),
    'rank_2_q': ('error', _OP + r'q must be \(BH, M, d\)'),
    'odd_width': ('error', _OP + r'the level must have even height and width'),
    'zero_width': ('error', _OP + r'the level must have even height and width'),
    'topk_too_large': ('error', _OP + r'topk must be in \[0, 4 Kp\]'),
    # (ONNX Runtime checks the input types against the operator's declaration first)
    'float64_q': ('error', r'(?i)unexpected input data type|must be float32'),
    'int32_prev_idx': ('error', r'(?i)unexpected input data type|must be int64'),
    'non_contiguous_q': ('ok', [[2, 64, 8], [2, 64, 2], [2, 64, 0]]),  # (copied by the binding)
    'cell_past_the_grid': ('error', _OP + r'prev_idx entry 16 is outside the parent grid of 16'),
    'negative_cell': ('error', _OP + r'prev_idx entry -\d+ is outside the parent grid'),
}


def _run_cases(script: str) -> dict:
    """Runs a case script in a subprocess: {case: result}, and the crash, if any, under
    the key None (the case it stopped in and the return code)."""
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS='2',
                                                PYTHONPATH=os.pathsep.join(filter(None, (
                                                    TESTS_DIR, os.environ.get('PYTHONPATH'))))))
    results, started = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith('{'):
            record = json.loads(line)
            if 'start' in record:
                started = record['start']
            else:
                results[record.pop('case')] = record
    if proc.returncode != 0:
        results[None] = dict(case=started, returncode=proc.returncode,
                             stderr=proc.stderr[-3000:])
    return results


def _check(results: dict, case: str, expected) -> None:
    crash = results.get(None)
    if case not in results:
        assert crash is not None, f'{case}: no result'
        pytest.fail(f'{case}: the operator process died (return code {crash["returncode"]}) '
                    f'in case {crash["case"]!r} before this case ran:\n{crash["stderr"]}')
    kind, want = expected
    got = results[case]
    if kind == 'ok':
        assert got == {'ok': want}, got
    else:
        assert 'error' in got, f'{case}: no error raised, outputs {got}'
        assert re.search(want, got['error']), got['error']


@pytest.fixture(scope='module')
def torch_results():
    if cpu_kernels.quadtree_level_kernel() is None:  # (an error in CI: REQUIRE_CPU_KERNELS)
        pytest.skip(f'fused CPU kernel: {cpu_kernels.status()}')
    return _run_cases(_TORCH_CASES)


@pytest.fixture(scope='module')
def ort_results():
    pytest.importorskip('onnxruntime')
    from flatten_mm.deploy import ort_ops
    if ort_ops.library_path() is None:  # no headers: a skip naming the system package
        pytest.skip(f'flatten_mm ONNX Runtime operators: {ort_ops.status()}')
    return _run_cases(_ORT_CASES)


@pytest.mark.parametrize('case', sorted(TORCH_EXPECTED))
def test_pytorch_kernel_refuses_or_handles(torch_results, case):
    _check(torch_results, case, TORCH_EXPECTED[case])


def test_pytorch_kernel_cases_all_ran(torch_results):
    assert None not in torch_results, torch_results[None]
    assert set(torch_results) == set(TORCH_EXPECTED)


@pytest.mark.parametrize('case', sorted(ORT_EXPECTED))
def test_ort_operator_refuses_or_handles(ort_results, case):
    _check(ort_results, case, ORT_EXPECTED[case])


def test_ort_operator_cases_all_ran(ort_results):
    assert None not in ort_results, ort_results[None]
    assert set(ort_results) == set(ORT_EXPECTED)


# A pool like ONNX Runtime's: worker threads call a C function pointer (from a noexcept
# function: an exception leaving it reaches std::terminate, SIGABRT), and allocations on a
# worker fail once armed. run_level must report the bad_alloc on the calling thread.
_POOL_HARNESS = r'''
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <thread>
#include <vector>
#include "quadtree_level.h"

static std::atomic<bool> armed{false};
static thread_local bool on_worker = false;

void* operator new(std::size_t n) {
  if (armed.load() && on_worker) throw std::bad_alloc();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using Callback = void (*)(void*, size_t);

void call_chunks(Callback fn, void* data, size_t first, size_t step, size_t chunks) noexcept {
  on_worker = true;
  for (size_t c = first; c < chunks; c += step) fn(data, c);
}

struct CPool {  // run_level's parallel_for, through a C callback on 3 threads
  template <typename Fn>
  void operator()(int64_t tasks, int64_t grain, const Fn& fn) const {
    struct Job { const Fn* fn; int64_t tasks, grain; } job{&fn, tasks, grain};
    Callback chunk = [](void* data, size_t c) {
      const Job* j = static_cast<const Job*>(data);
      const int64_t begin = static_cast<int64_t>(c) * j->grain;
      (*j->fn)(begin, std::min(j->tasks, begin + j->grain));
    };
    const size_t chunks = static_cast<size_t>((tasks + grain - 1) / grain);
    std::thread workers[3];  // (created before allocations fail)
    for (size_t t = 0; t < 3; ++t)
      workers[t] = std::thread(call_chunks, chunk, static_cast<void*>(&job), t, 3, chunks);
    for (auto& w : workers) w.join();
  }
};

int main() {
  const int64_t BH = 2, W = 8, M = 64, d = 32, Kp = 2, topk = 3;
  std::vector<float> q(BH * M * d, 0.5f), msg(BH * M * d), score(BH * M * topk);
  std::vector<int64_t> idx(BH * (M / 4) * Kp, 1), next(BH * M * topk);
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int64_t>(i % (M / 4));
  const flatten_mm_quadtree::LevelArgs args{q.data(), q.data(), q.data(), idx.data(),
                                            nullptr, msg.data(), next.data(), nullptr,
                                            BH, M, d, W, Kp, topk, 0.2f, false};
  flatten_mm_quadtree::run_level<32>(args, CPool{});  // runs clean first
  std::printf("clean run: msg[0] = %g\n", msg[0]);
  armed = true;
  for (int variant = 0; variant < 2; ++variant) {
    try {
      if (variant == 0) flatten_mm_quadtree::run_level<32>(args, CPool{});
      else flatten_mm_quadtree::run_level<0>(args, CPool{});
      std::printf("variant %d: no exception\n", variant);
      return 1;
    } catch (const std::bad_alloc&) {
      std::printf("variant %d: bad_alloc carried out\n", variant);
    }
  }
  return 0;
}
'''


def test_exception_in_a_pool_callback_reaches_the_caller(tmp_path):
    """The shared forward (run_level) on a pool whose workers call a C function pointer,
    as ONNX Runtime's do: a bad_alloc on a worker comes back to the caller as a bad_alloc
    (before the fix: std::terminate, SIGABRT)."""
    compiler = os.environ.get('CXX', 'c++')
    if shutil.which(compiler) is None:
        pytest.skip(f'no C++ compiler ({compiler})')
    source = tmp_path / 'pool.cpp'
    source.write_text(_POOL_HARNESS)
    binary = tmp_path / 'pool'
    build = subprocess.run([compiler, '-std=c++17', '-O1', '-pthread', f'-I{CSRC}', str(source),
                            '-o', str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert 'variant 0: bad_alloc carried out' in proc.stdout
    assert 'variant 1: bad_alloc carried out' in proc.stdout
