"""``scripts/gpu_session.sh``: every command it would run on the GPU parses, and its CPU
smoke mode runs a step end to end (the script is only ever run for real on a lent GPU,
so a typo must show here)."""
import importlib.util
import os
import os.path as osp
import shlex
import subprocess
import sys

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from benchmark_cli import load_cli  # noqa: E402

from benchmarks import core as bm  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
SCRIPT = osp.join(ROOT, 'scripts', 'gpu_session.sh')


def _dry_run(**env):
    out = subprocess.run(['bash', SCRIPT, '--dry-run'], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    steps = {}
    for line in out.stdout.splitlines():
        if line.startswith('[') and '] (min ' in line:
            name, _, rest = line[1:].partition('] ')
            steps[name] = shlex.split(rest.split(') ', 1)[1])
    return steps


def test_every_gpu_command_parses():
    cli = load_cli()
    steps = _dry_run(OUT='/tmp/never-written')
    expected = {'profile_fp32', 'profile_bf16', 'check', 'steps_fp32_triton1',
                'steps_bf16_triton1', 'steps_fp32_triton0', 'steps_bf16_triton0',
                'whole_models_fp32', 'compile_fp32_flatten-pvt-v2-b0',
                'compile_bf16_flatten-swin-t'}
    assert expected <= set(steps), sorted(steps)
    assert not osp.exists('/tmp/never-written')  # a dry run writes nothing
    order = list(steps)
    # the cheapest / most important first: profiles, then eager rows, compile last
    assert order.index('profile_bf16') < order.index('steps_fp32_triton1') < order.index(
        'steps_fp32_triton0') < order.index('compile_fp32_flatten-pvt-v2-b0')
    for name, argv in steps.items():
        if 'benchmarks/gpu_kernel_check.py' in argv:
            spec = importlib.util.spec_from_file_location(
                'gpu_kernel_check', osp.join(ROOT, 'benchmarks/gpu_kernel_check.py'))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.parse_args(argv[argv.index('benchmarks/gpu_kernel_check.py') + 1:])
            continue
        if 'benchmarks/benchmark.py' not in argv:
            continue
        args = cli.parse_args(argv[argv.index('benchmarks/benchmark.py') + 1:])
        assert args.device == 'cuda' and not args.quick, name
        cli._pairs(args, quick=False)  # family names exist (SystemExit otherwise)
        if name.startswith('steps_'):
            assert argv[1] == f'FLATTEN_MM_TRITON={name[-1]}' and args.steps == 'forward,train'
            assert args.amp == name.split('_')[1] and args.batch == 8
            assert bm.parse_resolutions(args.resolutions) == ((512, 512), (1024, 1024),
                                                              (800, 1344))
        if name.startswith('profile_'):
            assert args.profile and args.batch == 8 and args.resolutions == '512'
        if name.startswith('compile_'):
            assert args.execs == 'compile' and args.compile_backend == 'inductor'


def test_smoke_mode_runs_a_step_and_the_tables(tmp_path):
    out = tmp_path / 'out'
    # (the interpreter running the tests: the checkout may have no .venv of its own)
    env = dict(os.environ, SMOKE='1', OUT=str(out), ONLY='steps_fp32_triton1,tables',
               OMP_NUM_THREADS='1', PYTHON=sys.executable)
    res = subprocess.run(['bash', SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    status = dict(line.split('\t')[:2] for line in (out / 'steps.tsv').read_text().splitlines()[1:])
    assert status['steps_fp32_triton1'] == 'ok' and status['tables'] == 'ok', status
    assert status['profile_fp32'] == 'not_in_ONLY'
    tables = (out / 'tables.md').read_text()
    assert '**forward step, eager, fp32, FLATTEN_MM_TRITON=1, batch 2, cpu**' in tables
    assert '**train step, eager, fp32, FLATTEN_MM_TRITON=1, batch 2, cpu**' in tables
    assert '| flatten-pvt-v2-tiny vs pvt-v2-tiny (timm) |' in tables


def test_a_failing_step_is_logged_and_the_script_goes_on(tmp_path):
    # a python that always fails: every step fails, each is logged, the script finishes
    fake = tmp_path / 'python'
    fake.write_text('#!/bin/sh\necho "boom $*" >&2\nexit 3\n')
    fake.chmod(0o755)
    out = tmp_path / 'out'
    env = dict(os.environ, SMOKE='1', OUT=str(out), PYTHON=str(fake),
               ONLY='profile_fp32,check,whole_models_fp32')
    res = subprocess.run(['bash', SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 3, res.stdout + res.stderr  # exit status = failed steps
    status = dict(line.split('\t')[:2] for line in (out / 'steps.tsv').read_text().splitlines()[1:])
    assert status['profile_fp32'] == status['check'] == status['whole_models_fp32'] \
        == 'failed_rc=3'
    assert 'boom' in (out / 'logs' / 'check.log').read_text()
    assert 'FAIL  whole_models_fp32' in (out / 'session.log').read_text()


def test_steps_that_do_not_fit_the_budget_are_skipped(tmp_path):
    out = tmp_path / 'out'
    env = dict(os.environ, SMOKE='1', OUT=str(out), BUDGET_S='0',
               ONLY='profile_fp32,steps_fp32_triton1')
    res = subprocess.run(['bash', SCRIPT], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    status = dict(line.split('\t')[:2] for line in (out / 'steps.tsv').read_text().splitlines()[1:])
    assert status['profile_fp32'] == status['steps_fp32_triton1'] == 'skipped'
