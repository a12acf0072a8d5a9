"""Every-config pass of ``swap_backbone``: plan, write and build; then (``--run``) a
forward and a training step of each built config.

``swap_sweep`` checks one representative config per family directory in depth (forward
and one training step). This pass covers every ``.py`` config of every family directory
of the installed ``<package>/.mim/configs`` (the directory's own files, then its
sub-directories', in sorted order, as ``swap_sweep._family_files`` lists them) at the
cost of a build only:

1. the source config is read (``swap.load_source_config``; custom imports are not run);
   a file that cannot be read here or whose ``model`` has no ``backbone`` dict is
   ``skipped`` with the reason (a base config of another package that is not installed:
   ``needs-package``; a new-style ``read_base`` config: ``refused``, as the tool says);
2. the backbone is swapped and the new config written (``swap.swap_backbone``, which also
   builds the neck on the new channels); a ``SwapError`` is a refusal, its message the
   reason;
3. the written config's model is built on CPU (``forward.build_model``, MMSyncBN as BN
   since there is no process group); a build error that the unswapped source shows too,
   with the same message, is ``source-fails``, a missing optional package
   ``needs-package``, anything else ``failed``.

4. (``--run``, ``run_config``) a built config is run as the family sweep runs its
   representative (``swap_sweep.check_adapted``: one forward and one training iteration
   on CPU at a small size), unless a config with the same ``run_key`` -- the same written
   model, training data and optimizer -- was run already: it then takes that result
   (``same_as``). A failed run turns ``adapted`` into ``failed`` / ``source-fails`` /
   ``needs-package`` / ``gpu-only`` with the reason.

Each config runs under a time limit (``swap_sweep._time_limit``). Rows are appended to a
CSV keyed by (scope, config), so an interrupted sweep resumes, and rendered as Markdown
with per-family counts and every refusal and failure with its reason
(``render_markdown_all``).
"""
import contextlib
import copy
import hashlib
import json
import os
import os.path as osp
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from mmengine.config import Config

from flatten_mm.swap.measure import SwapError
from .swap_sweep import (_family_files, _md_cell, _missing_package, _one_line, _time_limit,
                         _type_name, configs_root)
from .table import read_table, upsert_rows

#: the columns of the every-config table
ALL_COLUMNS = ('scope', 'family', 'config', 'status', 'reason', 'build', 'build_error',
               'seconds', 'size', 'forward', 'train_smoke', 'losses_finite',
               'backbone_grads', 'batch', 'run_key', 'same_as', 'run_seconds')

#: statuses, in the order the Markdown counts them
ALL_STATUSES = ('adapted', 'refused', 'needs-package', 'gpu-only', 'source-fails', 'failed',
                'skipped')

#: the run fields a config takes over from an identical one (``same_as``)
RUN_FIELDS = ('status', 'reason', 'size', 'forward', 'train_smoke', 'losses_finite',
              'backbone_grads', 'batch')


@dataclass
class ConfigRow:
    """One config's outcome in the every-config pass.

    Attributes:
        scope: ``mmdet`` / ``mmseg``.
        family: the family directory.
        config: the path under ``.mim/configs`` (``atss/atss_r50_fpn_1x_coco.py``).
        status: ``adapted`` (written and built), ``refused`` (``SwapError``: ``reason``),
            ``needs-package`` (an optional package that is not installed is needed to
            read, swap or build it), ``source-fails`` (written, but the unswapped source
            fails to build the same way here), ``failed`` (the swap or the build of the
            written config failed: a bug; ``reason``), ``skipped`` (unreadable here or
            no ``model.backbone``; ``reason``).
        reason: why, for every status but ``adapted``.
        build: ``ok`` / ``failed`` / ``''`` (not built).
        build_error: the build's one-line error.
        seconds: wall time of the read, swap and build.
        size, forward, train_smoke, losses_finite, backbone_grads, batch: the run
            (``--run``) of a built config, as in the family sweep
            (``swap_sweep.check_adapted``); ``''`` when it was not run. A failed run
            turns ``status`` into ``failed`` / ``source-fails`` / ``needs-package`` /
            ``gpu-only`` with the reason.
        run_key: ``run_key`` of the written config.
        same_as: the config (same scope) whose run this row takes over: its written
            model, training data and optimizer are identical (``''``: run itself).
        run_seconds: wall time of the run (``0`` when taken over).
    """

    scope: str
    family: str
    config: str
    status: str
    reason: str = ''
    build: str = ''
    build_error: str = ''
    seconds: str = ''
    size: str = ''
    forward: str = ''
    train_smoke: str = ''
    losses_finite: str = ''
    backbone_grads: str = ''
    batch: str = ''
    run_key: str = ''
    same_as: str = ''
    run_seconds: str = ''


@contextlib.contextmanager
def cached_metafiles() -> Iterator[None]:
    """Read each package's ``model-index.yml`` metafiles once while the block runs.

    mmengine resolves every scoped ``_base_`` (``mmdet::atss/...``, the first line of
    each written config) by parsing all the metafiles of the package again (~0.3 s per
    name here); the sweep reads thousands. Inside the block
    ``mmengine.config.utils._get_cfg_metainfo`` answers from a per-package index built
    the same way (same result, same ``ValueError`` for a name without a metafile
    entry); the original is restored on exit.
    """
    from mmengine.config import utils
    from mmengine.fileio import load
    original = utils._get_cfg_metainfo
    index: Dict[str, dict] = {}

    def metainfo(package_path: str, cfg_path: str) -> dict:
        if package_path not in index:
            cfg_dict = {}
            mim = osp.join(package_path, '.mim')
            for meta_path in load(osp.join(mim, 'model-index.yml'))['Import']:
                for model_cfg in load(osp.join(mim, meta_path))['Models']:
                    name = model_cfg.get('Config', '').partition('/')[-1]
                    if name and name not in cfg_dict:  # the first weight, as mmengine
                        cfg_dict[name] = model_cfg
            index[package_path] = cfg_dict
        if cfg_path not in index[package_path]:
            raise ValueError(f'Expected configs: {index[package_path].keys()}, but got '
                             f'{cfg_path}')
        return index[package_path][cfg_path]

    utils._get_cfg_metainfo = metainfo
    try:
        yield
    finally:
        utils._get_cfg_metainfo = original


def family_configs(scope: str, family: str) -> List[str]:
    """Every ``.py`` config of the family directory, as ``family/...`` paths under the
    scope's ``.mim/configs``: its own files sorted, then its sub-directories'."""
    return _family_files(configs_root(scope), family)


def read_backbone_config(name: str) -> Tuple[Optional[Config], str, str]:
    """Read the scoped config ``name`` as the swap tool does.

    Returns:
        ``(cfg, '', '')`` when it has a ``model.backbone`` dict, else
        ``(None, status, reason)`` with status ``skipped`` (unreadable here, no backbone),
        ``needs-package`` (its bases are in a package that is not installed) or
        ``refused`` (the tool's refusal, e.g. a new-style ``read_base`` config).
    """
    from flatten_mm.swap.plan import load_source_config
    try:
        cfg, _ = load_source_config(name)
    except SwapError as exc:
        status = 'needs-package' if 'which is not installed' in str(exc) else 'refused'
        return None, status, str(exc)
    except Exception as exc:  # noqa: BLE001 -- the reason of the skip
        missing = _missing_package(exc)
        if missing:
            return None, 'needs-package', f'reading it needs {missing}: {_one_line(exc)}'
        return None, 'skipped', f'cannot be read here: {_one_line(exc)}'
    model = cfg.get('model')
    if isinstance(model, dict) and isinstance(model.get('backbone'), dict):
        return cfg, '', ''
    if isinstance(model, dict) and isinstance(model.get('detector'), dict):
        return None, 'skipped', (
            f'no model.backbone ({_type_name(model.get("type"))} wraps a detector config '
            'under model.detector: swap the backbone of that detector config instead)')
    if not isinstance(model, dict):
        return None, 'skipped', 'no model (a base / dataset / schedule config)'
    if model.get('type') is None:
        return None, 'skipped', ('no model.backbone (a partial model dict with '
                                 f'{", ".join(sorted(model))}, for other configs to merge)')
    return None, 'skipped', f'no model.backbone (model type {_type_name(model.get("type"))})'


def build_config(cfg: Config) -> None:
    """Build ``cfg.model`` on CPU as ``swap.verify_config`` does (MMSyncBN as BN: it
    needs a process group), without running it."""
    from flatten_mm.apis.forward import build_model
    from flatten_mm.swap.smoke import mmsyncbn_as_bn
    cfg = copy.deepcopy(cfg)
    mmsyncbn_as_bn(cfg.model)
    build_model(cfg)


def _try_build(cfg: Config, time_limit: int) -> Optional[BaseException]:
    try:
        with _time_limit(time_limit):
            build_config(cfg)
    except Exception as exc:  # noqa: BLE001 -- classified by the caller
        return exc
    return None


def sweep_config(scope: str, rel: str, backbone: str, work_dir: str,
                 time_limit: int = 120) -> ConfigRow:
    """Swap ``scope::rel`` to ``backbone``, write it under ``work_dir`` and build it.

    Args:
        scope: ``mmdet`` / ``mmseg``.
        rel: ``family/file.py`` under the scope's ``.mim/configs``.
        backbone: catalogue name of the new backbone.
        work_dir: where the written config goes (one file, overwritten per config).
        time_limit: seconds for the swap and for each build.

    Returns:
        ConfigRow (see its statuses).
    """
    t0 = time.perf_counter()
    row = ConfigRow(scope, rel.split('/', 1)[0], rel, 'adapted')

    def done():
        # paths of this machine's site-packages: 'mmdet/.mim/configs/...'
        site = osp.dirname(osp.dirname(osp.dirname(configs_root(scope)))) + os.sep
        row.reason = row.reason.replace(site, '')
        row.build_error = row.build_error.replace(site, '')
        row.seconds = f'{time.perf_counter() - t0:.1f}'
        return row

    name = f'{scope}::{rel}'
    try:
        with _time_limit(time_limit):
            cfg, status, why = read_backbone_config(name)
    except TimeoutError as exc:
        cfg, status, why = None, 'failed', f'read: {_one_line(exc)}'
    if cfg is None:
        row.status, row.reason = status, why
        return done()
    from flatten_mm.swap.plan import load_source_config, swap_backbone
    out = osp.join(work_dir, f'{scope}_swapped.py')
    try:
        with _time_limit(time_limit):
            swap_backbone(name, backbone, out, force=True)
    except SwapError as exc:
        row.status, row.reason = 'refused', str(exc)
        return done()
    except Exception as exc:  # noqa: BLE001 -- recorded
        missing = _missing_package(exc)
        if missing:
            row.status, row.reason = 'needs-package', f'swap needs {missing}: {_one_line(exc)}'
        else:
            traceback.print_exc()
            row.status, row.reason = 'failed', f'swap: {_one_line(exc)}'
        return done()
    exc = _try_build(Config.fromfile(out), time_limit)
    if exc is None:
        row.build = 'ok'
        return done()
    row.build, row.build_error = 'failed', _one_line(exc)
    missing = _missing_package(exc)
    if missing:
        row.status = 'needs-package'
        row.reason = f'written; building it needs {missing}, not installed here'
        return done()
    src_cfg, _ = load_source_config(name)
    src_exc = _try_build(src_cfg, time_limit)
    if src_exc is not None and _one_line(src_exc) == row.build_error:
        row.status = 'source-fails'
        row.reason = 'written; the unswapped source config fails to build the same way here'
    else:
        traceback.print_exception(exc)  # (outside its except block: passed explicitly)
        row.status = 'failed'
        row.reason = 'build of the written config failed' + (
            '' if src_exc is None else f' (the source fails differently: {_one_line(src_exc)})')
    return done()


#: the parts of a written config that decide what its run does: the model (heads, losses,
#: data preprocessor, train / test cfg), the training data (pipeline, dataset, sampler),
#: the optimizer wrapper, custom imports and SSD-style ``input_size``
RUN_KEY_PARTS = ('model', 'train_dataloader', 'optim_wrapper', 'custom_imports',
                 'input_size')


def run_key(cfg: Config) -> str:
    """A digest of the run-deciding parts of a written config (``RUN_KEY_PARTS``): two
    configs with the same key build the same model, train it on the same batch and
    step the same optimizer, so the run of one stands for the other (e.g. the r50 and
    r101 variants of a detector, whose only difference was the swapped-out backbone)."""
    parts = {k: cfg.get(k) for k in RUN_KEY_PARTS}
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def isolated_run(scope: str, config: str, backbone: str, size: int,
                 time_limit: int) -> dict:
    """Swap and run one config (``check_adapted``) as the first model of this process;
    returns its ``RUN_FIELDS``. What ``run_config`` runs in a new process."""
    import tempfile
    from flatten_mm.swap.plan import swap_backbone
    from .swap_sweep import check_adapted
    row = ConfigRow(scope, config.split('/', 1)[0], config, 'adapted', build='ok')
    with tempfile.TemporaryDirectory() as work, cached_metafiles():
        out = osp.join(work, f'{scope}_run.py')
        swap_backbone(f'{scope}::{config}', backbone, out, force=True)
        check_adapted(row, Config.fromfile(out), f'{scope}::{config}', size, True,
                      time_limit)
    return {f: getattr(row, f) for f in RUN_FIELDS}


def _run_in_new_process(row: ConfigRow, backbone: str, size: int,
                        time_limit: int) -> Optional[dict]:
    """``isolated_run`` in a new Python process, which writes its result to a JSON file
    (``None`` if that process fails). This checkout goes first on its ``PYTHONPATH``."""
    import subprocess
    import sys
    import tempfile
    root = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (root, env.get('PYTHONPATH')) if p)
    code = ('import json, sys; from dev.sweeps.swap_sweep_all import isolated_run; '
            'result = isolated_run(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), '
            "int(sys.argv[6])); json.dump(result, open(sys.argv[1], 'w'))")
    with tempfile.TemporaryDirectory() as work:
        out = osp.join(work, 'result.json')
        try:
            subprocess.run(
                [sys.executable, '-c', code, out, row.scope, row.config, backbone, str(size),
                 str(time_limit)], capture_output=True, text=True, timeout=4 * time_limit,
                env=env, cwd=work)
        except subprocess.TimeoutExpired:
            return None
        if not osp.isfile(out):
            return None
        with open(out, encoding='utf-8') as f:
            return json.load(f)


def run_config(row: ConfigRow, backbone: str, work_dir: str, size: int = 128,
               time_limit: int = 600,
               ran: Optional[Dict[str, ConfigRow]] = None,
               isolate_failures: bool = True) -> ConfigRow:
    """Run an adapted, built config: forward and one training iteration
    (``swap_sweep.check_adapted``: sizes, demo / synthetic batch and how failures are
    classified), unless a config with the same ``run_key`` was run already (``ran``:
    key -> its row, updated here), whose run fields it then takes (``same_as``).

    Args:
        row: the config's row from the build pass (status ``adapted``); updated in place.
        backbone: catalogue name of the new backbone (the config is swapped again).
        work_dir: where the written config goes (overwritten per config).
        size: image size of the checks.
        time_limit: seconds for the swap and for each check.
        ran: run rows by key, shared across calls.
        isolate_failures: a run that fails (``failed``, or ``source-fails``: the
            source is compared in the same process) is run again in a new Python
            process, where the config's model is the first one built: the sweep builds
            hundreds of models in one process, and some models' state outlives them
            (mmdet's DDQ-DETR gives non-finite gradients when another DDQ model was
            built before in the process, the unswapped source too). The new process's
            result is kept; when it passes, ``reason`` keeps the first error and says so.

    Returns:
        ``row``.
    """
    from flatten_mm.swap.plan import swap_backbone
    from .swap_sweep import check_adapted
    t0 = time.perf_counter()
    ran = {} if ran is None else ran
    name = f'{row.scope}::{row.config}'
    out = osp.join(work_dir, f'{row.scope}_run.py')
    try:
        with _time_limit(time_limit):
            swap_backbone(name, backbone, out, force=True)
        cfg = Config.fromfile(out)
    except Exception as exc:  # noqa: BLE001 -- it was swapped in the build pass: a bug
        traceback.print_exc()
        row.status, row.reason = 'failed', f'run: swapping again failed: {_one_line(exc)}'
        row.run_seconds = f'{time.perf_counter() - t0:.1f}'
        return row
    row.run_key = run_key(cfg)
    first = ran.get(row.run_key)
    if first is not None and first.scope == row.scope:
        for f in RUN_FIELDS:
            setattr(row, f, getattr(first, f))
        row.same_as, row.run_seconds = first.config, '0'
        return row
    row.same_as = ''
    try:
        check_adapted(row, cfg, name, size, True, time_limit)
        if row.status in ('failed', 'source-fails') and isolate_failures:
            fresh = _run_in_new_process(row, backbone, size, time_limit)
            if fresh is not None and fresh['status'] not in ('failed', 'source-fails'):
                first = row.reason
                for f in RUN_FIELDS:
                    setattr(row, f, fresh[f])
                row.reason = ((row.reason + '; ' if row.reason else '')
                              + 'passed as the first model of a new process; in the '
                              f"sweep's process, after other models: {first}")
    finally:
        row.run_seconds = f'{time.perf_counter() - t0:.1f}'
        site = osp.dirname(osp.dirname(osp.dirname(configs_root(row.scope)))) + os.sep
        row.reason = row.reason.replace(site, '')
    ran[row.run_key] = row
    return row


def runs_by_key(rows: Iterable[ConfigRow]) -> Dict[str, ConfigRow]:
    """``run_key`` -> the row that was run itself (not taken over), from a CSV's rows."""
    return {r.run_key: r for r in rows if r.run_key and r.forward and not r.same_as}


# ------------------------------------------------------------------------------ CSV / MD
def read_all_rows(csv_path: str) -> List[ConfigRow]:
    """Rows of an every-config CSV (``[]`` when it does not exist)."""
    return [ConfigRow(**r) for r in read_table(csv_path, ALL_COLUMNS)]


def append_all_row(csv_path: str, row: ConfigRow) -> None:
    """Add ``row`` (replacing an earlier row of the same scope and config) and rewrite
    the CSV atomically."""
    upsert_rows(csv_path, ALL_COLUMNS, [asdict(row)], key=('scope', 'config'))


def status_counts(rows: List[ConfigRow]) -> dict:
    """``{status: number of rows}`` in ``ALL_STATUSES`` order (absent statuses left
    out)."""
    counts = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    return {k: counts[k] for k in ALL_STATUSES if k in counts} | {
        k: v for k, v in counts.items() if k not in ALL_STATUSES}


def run_summary(rows: List[ConfigRow]) -> str:
    """One line: of the built configs, how many ran (themselves / taken over) and passed,
    and how many were not run yet."""
    built = [r for r in rows if r.build == 'ok']
    run = [r for r in built if r.forward]
    own = [r for r in run if not r.same_as]
    passed = [r for r in run if r.status == 'adapted' and r.train_smoke == 'ok']
    return (f'{len(run)} of {len(built)} built configs were run ({len(own)} themselves, '
            f'{len(run) - len(own)} identical to one of those); {len(passed)} passed the '
            f'forward and the training step; {len(built) - len(run)} not run yet')


def render_markdown_all(rows: List[ConfigRow], backbone: str) -> str:
    """The Markdown page: how the pass was run, totals, per-family counts, then every
    refusal, failure and needs-package / source-fails row with its reason."""
    counts = status_counts(rows)
    by_family = {}
    for r in rows:
        by_family.setdefault((r.scope, r.family), []).append(r)
    lines = [
        '# swap_backbone on every mmdet 3.3 / mmseg 1.2 config',
        '',
        'Generated by `python dev/swap_sweep.py --all-configs` '
        f'(backbone `{backbone}`; do not edit by hand). Every `.py` config of every family '
        'directory of the installed packages\' `.mim/configs` is read as '
        '`tools/swap_backbone.py` reads it; one with a `model.backbone` is swapped (the '
        'plan, the written config, its neck built on the new channels) and the written '
        "config's model is built on CPU. With `--run`, each built config is then run on "
        'CPU as in the family sweep ([swap_support.md](swap_support.md)): one forward and '
        'one training iteration (finite losses, a gradient for every trainable backbone '
        'parameter, an optimizer step) at a small size; a config whose written model, '
        'training data and optimizer are identical to one already run (`run_key`, e.g. '
        'the r50 and r101 variants of a detector once their backbone is swapped) takes '
        "that run's result (`same_as` in the CSV). Statuses: "
        '`adapted` (written and built; passed the run where it was run), `refused` (the '
        "tool's reason), `needs-package` (an optional package not installed here), "
        '`gpu-only` (an mmcv op of the unchanged heads has no CPU kernel), '
        '`source-fails` (the unswapped source fails the same way here), `failed` (a bug: '
        'the swap, the build or the run of the written config failed), `skipped` '
        '(unreadable here or no `model.backbone`).',
        '',
        'Status: ' + ', '.join(f'{v} {k}' for k, v in counts.items())
        + f' ({len(rows)} configs in {len(by_family)} families).',
        '',
        'Run: ' + run_summary(rows) + '.',
        '',
        '## Per family',
        '',
        '`ran`: adapted configs that passed the forward and the training step (run '
        'themselves + identical to one of those) / adapted configs.',
        '',
        '| scope | family | configs | ' + ' | '.join(ALL_STATUSES) + ' | ran |',
        '| --- | --- | --- |' + ' --- |' * (len(ALL_STATUSES) + 1),
    ]
    for (scope, fam), rs in sorted(by_family.items()):
        c = status_counts(rs)
        ok = [r for r in rs if r.status == 'adapted' and r.train_smoke == 'ok']
        own = sum(1 for r in ok if not r.same_as)
        lines.append(f'| {scope} | {_md_cell(fam)} | {len(rs)} | '
                     + ' | '.join(str(c.get(k, 0)) for k in ALL_STATUSES)
                     + f' | {own} + {len(ok) - own} / {c.get("adapted", 0)} |')
    fresh = sorted((r for r in rows if r.status == 'adapted' and r.reason),
                   key=lambda r: (r.scope, r.config))
    if fresh:
        lines += ['', f'## Adapted, passed in a new process only ({len(fresh)})', '',
                  'Their run failed in the sweep\'s long-running process and passed as the '
                  'first model of a new one (state of earlier models in the process).', '',
                  '| scope | config | reason |', '| --- | --- | --- |']
        lines += [f'| {r.scope} | `{_md_cell(r.config)}` | {_md_cell(r.reason)} |'
                  for r in fresh]
    sections = (('Failed', ('failed',), ('reason', 'build_error')),
                ('Refused', ('refused',), ('reason',)),
                ('Needs a package / fails unswapped too', ('needs-package', 'source-fails'),
                 ('status', 'reason', 'build_error')),
                ('Skipped', ('skipped',), ('reason',)))
    for title, wanted, cols in sections:
        listed = sorted((r for r in rows if r.status in wanted),
                        key=lambda r: (r.scope, r.config))
        lines += ['', f'## {title} ({len(listed)})', '']
        if not listed:
            lines.append('None.')
            continue
        lines += ['| scope | config | ' + ' | '.join(c.replace('_', ' ') for c in cols) + ' |',
                  '| --- | --- |' + ' --- |' * len(cols)]
        for r in listed:
            lines.append('| ' + ' | '.join(_md_cell(c) for c in (
                r.scope, f'`{r.config}`', *(getattr(r, c) for c in cols))) + ' |')
    return '\n'.join(lines) + '\n'


__all__ = ['ALL_COLUMNS', 'ALL_STATUSES', 'ConfigRow', 'RUN_FIELDS', 'append_all_row',
           'build_config', 'cached_metafiles', 'family_configs', 'read_all_rows',
           'isolated_run', 'read_backbone_config', 'render_markdown_all', 'run_config',
           'run_key',
           'run_summary', 'runs_by_key', 'status_counts', 'sweep_config']
