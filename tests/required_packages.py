"""In CI a missing mmdet / mmseg / mmcv / mmpretrain / onnxruntime / triton is an error, not a skip.

Tests reach these packages through ``pytest.importorskip``, so that a user's partial
install (mmdet without mmseg, no deploy extra...) skips what it cannot run, with the
reason. In CI the same skip would hide a broken install behind a green run. With ``CI``
set to ``true`` / ``1`` (CI services set it) or ``FLATTEN_MM_REQUIRE_ALL=1`` (``.ci/run``
exports it), these hooks turn the skip of an ``importorskip`` of one of
``REQUIRED_IN_CI`` -- at collection (module level) or in a test -- into a failure that
names the package. Other skips (CUDA-only tests, ``../shared`` absent) are untouched.

tests/conftest.py re-exports the hooks; another pytest run loads them with
``-p required_packages`` (tests/ on ``sys.path``).
"""
import os
import re

import pytest

REQUIRED_IN_CI = ('mmdet', 'mmseg', 'mmcv', 'mmpretrain', 'onnxruntime', 'triton')
#: the reason ``pytest.importorskip`` gives when the import fails
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")


def require_all() -> bool:
    """Whether this run must have every package of ``REQUIRED_IN_CI``."""
    return (os.environ.get('FLATTEN_MM_REQUIRE_ALL') == '1'
            or os.environ.get('CI', '').lower() in ('true', '1'))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_missing_required(report) -> None:
    if not report.skipped or not require_all():
        return
    reason = _skip_reason(report)
    match = _IMPORT_SKIP.search(reason)
    if match is None or match.group(1).split('.')[0] not in REQUIRED_IN_CI:
        return
    report.outcome = 'failed'
    report.longrepr = (
        f'{match.group(1).split(".")[0]} is required in CI (CI / FLATTEN_MM_REQUIRE_ALL set): '
        f'the test would have been skipped because {reason.removeprefix("Skipped: ")}. '
        'Install it (scripts/setup_env.sh), or unset CI for a partial install.')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_missing_required(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_missing_required(outcome.get_result())
