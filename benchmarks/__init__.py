"""Benchmarks and GPU checks of flatten_mm, run from a checkout (not installed).

``benchmark.py`` (speed and memory of operators, backbones and training steps against
their softmax counterparts), ``benchmark_onnx.py`` (ONNX Runtime against eager PyTorch)
and ``gpu_kernel_check.py`` (the Triton kernels against the PyTorch path on a GPU, run by
``scripts/gpu_session.sh``) are thin command lines over the ``core`` package.
"""
