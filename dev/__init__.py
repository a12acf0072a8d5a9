"""Developer tooling, run from a checkout (not installed): parity against the official
implementations' golden fixtures (``parity``, ``check_parity.py``), the swap / export
sweeps over upstream configs and their report tables (``sweeps``, ``swap_sweep.py``,
``export_sweep.py``, ``flops_table.py``) and the ahead-of-time kernel limit table
(``kernel_limits.py``)."""
