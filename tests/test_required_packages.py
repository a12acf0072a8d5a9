"""The CI rule of tests/required_packages.py, run on small pytest sessions of their own:
with ``CI=true`` (or ``FLATTEN_MM_REQUIRE_ALL=1``) an ``importorskip`` of a missing
mmdet / mmseg / mmcv / onnxruntime / triton fails, in a test or at module level, naming
the package; without them it skips with the import error as the reason; a missing
package outside the list skips in CI too."""
import os
import os.path as osp
import subprocess
import sys

import pytest

from required_packages import REQUIRED_IN_CI

TESTS_DIR = osp.dirname(osp.abspath(__file__))

# ``sys.modules[name] = None`` makes ``import name`` raise ImportError: a missing package
# without uninstalling anything
IN_TEST = '''
import sys
import pytest

def test_needs_it():
    sys.modules[{name!r}] = None
    pytest.importorskip({name!r})
'''
AT_MODULE_LEVEL = '''
import sys
import pytest
sys.modules[{name!r}] = None
pytest.importorskip({name!r})

def test_never_collected():
    pass
'''


def run_session(tmp_path, source, env_update):
    test = tmp_path / 'test_inner.py'
    test.write_text(source)
    (tmp_path / 'pytest.ini').write_text('[pytest]\n')
    env = {k: v for k, v in os.environ.items() if k not in ('CI', 'FLATTEN_MM_REQUIRE_ALL')}
    env.update(env_update, PYTHONPATH=TESTS_DIR)
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'required_packages', '-rs',
                           '-p', 'no:cacheprovider', str(test)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout


@pytest.mark.parametrize('env', [{'CI': 'true'}, {'CI': '1'}, {'FLATTEN_MM_REQUIRE_ALL': '1'}],
                         ids=['CI=true', 'CI=1', 'FLATTEN_MM_REQUIRE_ALL'])
def test_missing_required_package_fails_in_ci(tmp_path, env):
    code, out = run_session(tmp_path, IN_TEST.format(name='mmseg'), env)
    assert code == 1, out
    assert '1 failed' in out and 'skipped' not in out.splitlines()[-1], out
    assert 'mmseg is required in CI' in out and "could not import 'mmseg'" in out, out


def test_missing_required_package_at_module_level_fails_collection_in_ci(tmp_path):
    code, out = run_session(tmp_path, AT_MODULE_LEVEL.format(name='onnxruntime'), {'CI': 'true'})
    assert code != 0 and code != 5, out  # 5: nothing collected, nothing failed
    assert 'onnxruntime is required in CI' in out and '1 error' in out, out


@pytest.mark.parametrize('source', [IN_TEST, AT_MODULE_LEVEL], ids=['in-test', 'module-level'])
def test_partial_install_skips_with_the_reason(tmp_path, source):
    code, out = run_session(tmp_path, source.format(name='mmdet'), {'CI': 'false'})
    assert code in (0, 5) and '1 skipped' in out, out
    assert "could not import 'mmdet'" in out and 'required in CI' not in out, out


def test_other_packages_still_skip_in_ci(tmp_path):
    assert 'matplotlib' not in REQUIRED_IN_CI
    code, out = run_session(tmp_path, IN_TEST.format(name='matplotlib'), {'CI': 'true'})
    assert code == 0 and '1 skipped' in out and 'required in CI' not in out, out


def test_every_required_package_fails_in_ci(tmp_path):
    """One test per package of the list: one failure each."""
    assert set(REQUIRED_IN_CI) == {'mmdet', 'mmseg', 'mmcv', 'mmpretrain', 'onnxruntime',
                                   'triton'}
    source = 'import sys\nimport pytest\n' + ''.join(
        f'\ndef test_{name}():\n    sys.modules[{name!r}] = None\n'
        f'    pytest.importorskip({name!r})\n' for name in REQUIRED_IN_CI)
    code, out = run_session(tmp_path, source, {'CI': 'true'})
    assert code == 1 and f'{len(REQUIRED_IN_CI)} failed' in out, out
    for name in REQUIRED_IN_CI:
        assert f'{name} is required in CI' in out, (name, out)
