"""Sweep ``swap_backbone`` over the installed mmdet 3.x / mmseg 1.x configs.

One representative config per family directory of ``<package>/.mim/configs``: the first
``.py`` file of the directory, in sorted file-name order (then of its sub-directories),
that can be read and whose ``model`` has a ``backbone`` dict. A directory without one
(trackers, semi-supervised and Detectron2 wrappers, whose detector is under
``model.detector``; dataset-only folders) is listed with that reason; a directory whose configs cannot be read here
(another package's ``_base_``) gets the reading error of its first file.

For each representative, the backbone is swapped (``swap.swap_backbone``); a
``SwapError`` is a refusal (its message is the reason). An adapted config is then built
and run once (``swap.verify_config``), and trained one iteration
(``swap_smoke.train_smoke``, fewer RoIs) at a small size (SSD: its ``input_size``).
Results are appended to a CSV (one row per family, so an interrupted sweep resumes) and
rendered as a Markdown table (``render_markdown``).
"""
import contextlib
import math
import os
import os.path as osp
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Iterator, List, Optional, Tuple

from mmengine.config import Config

from flatten_mm.swap.measure import SwapError

from .table import read_table, upsert_rows

#: the columns of the sweep table
COLUMNS = ('scope', 'family', 'config', 'status', 'reason', 'size', 'forward', 'train_smoke',
           'losses_finite', 'backbone_grads', 'batch', 'seconds')


@dataclass
class SweepRow:
    """One family's outcome.

    Attributes:
        status: ``adapted`` (written, built, run and trained), ``refused`` (SwapError:
            ``reason``), ``skipped`` (no config with a ``model.backbone``), ``gpu-only``
            (written and built, but an op of its unchanged neck / heads has no CPU kernel
            in mmcv, so nothing ran here), ``needs-package`` (written and built; its
            heads need an optional package not installed here), ``failed`` (adapted but the forward or the
            training step failed: a bug; ``reason``), ``source-fails`` (adapted, but the
            unswapped source config fails the same check the same way here).
        size: the square image size the checks ran at.
        forward / train_smoke: ``ok``, ``failed`` or ``''`` (not run).
        losses_finite: ``yes`` / ``no`` / ``''``.
        backbone_grads: ``'184/184'`` trainable backbone tensors with a gradient.
        batch: which training batch was used (``demo``, ``dataset``, ``synthetic: why``).
    """

    scope: str
    family: str
    config: str
    status: str
    reason: str = ''
    size: str = ''
    forward: str = ''
    train_smoke: str = ''
    losses_finite: str = ''
    backbone_grads: str = ''
    batch: str = ''
    seconds: str = ''


def _type_name(t) -> str:
    return t.rsplit('.', 1)[-1] if isinstance(t, str) else getattr(t, '__name__', str(t))


def configs_root(scope: str) -> str:
    from mmengine.config.utils import MODULE2PACKAGE
    from mmengine.utils import get_installed_path
    return osp.join(get_installed_path(MODULE2PACKAGE[scope]), '.mim', 'configs')


def _family_files(root: str, family: str) -> List[str]:
    """``.py`` files of ``family``: its own sorted, then its sub-directories' sorted."""
    top = osp.join(root, family)
    own = sorted(f for f in os.listdir(top) if f.endswith('.py'))
    subs = []
    for dirpath, dirnames, files in sorted(os.walk(top)):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith('__'))
        if dirpath == top:
            continue
        subs += sorted(osp.relpath(osp.join(dirpath, f), top) for f in files
                       if f.endswith('.py'))
    return [f'{family}/{f}' for f in own + subs]


def representative(scope: str, family: str) -> Tuple[Optional[str], str]:
    """``(scoped config name, '')`` of the family's representative, or ``(None, why)``."""
    from flatten_mm.swap.plan import load_source_config
    root = configs_root(scope)
    first_error = ''
    wrapped = ''
    files = _family_files(root, family)
    for rel in files:
        name = f'{scope}::{rel}'
        try:
            cfg, _ = load_source_config(name)
        except Exception as exc:  # noqa: BLE001 -- remembered as the family's reason
            if not first_error:
                first_error = f'{rel}: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}'
            continue
        model = cfg.get('model')
        if isinstance(model, dict) and isinstance(model.get('backbone'), dict):
            return name, ''
        if isinstance(model, dict) and isinstance(model.get('detector'), dict):
            wrapped = wrapped or _type_name(model.get('type'))
    if not files:
        return None, 'no config files'
    why = 'no config with a model.backbone'
    if wrapped:
        why += (f' (e.g. {wrapped} wraps a detector config under model.detector: swap '
                'the backbone of that detector config instead)')
    if first_error:
        why += f'; first unreadable: {first_error}'
    return None, why


def families(scope: str) -> List[str]:
    root = configs_root(scope)
    return sorted(d for d in os.listdir(root)
                  if osp.isdir(osp.join(root, d)) and not d.startswith(('_', '.')))


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def handler(signum, frame):
        raise TimeoutError(f'took longer than {seconds}s')
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _needs_gpu(exc: BaseException) -> bool:
    text = str(exc)
    return ('implementation for device cpu not found' in text
            or 'not compiled with GPU support' in text or 'only supports CUDA' in text
            or 'Torch not compiled with CUDA' in text)


def _missing_package(exc: BaseException) -> str:
    """The package an mmdet / mmseg component asked for (``'skimage is not installed'``,
    ``ModuleNotFoundError``), else ``''``."""
    import re
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name
    m = (re.search(r'(\S+) is not installed', str(exc))
         or re.search(r'pip install ([A-Za-z0-9_.\-]*[A-Za-z0-9_])', str(exc)))
    return m.group(1) if m else ''


def _one_line(exc: BaseException) -> str:
    msg = str(exc).splitlines()[0][:300] if str(exc) else ''
    return f'{type(exc).__name__}: {msg}' if msg else type(exc).__name__


def _check(cfg: Config, hw: Tuple[int, int], train: bool, time_limit: int):
    """Forward, then (``train``) one training iteration. Returns ``(stage, exception,
    SmokeReport or None)``: ``stage`` is ``'forward'`` / ``'train smoke'`` where an
    exception was raised, else ``''``."""
    from flatten_mm.swap.plan import verify_config
    from flatten_mm.swap.smoke import train_smoke
    try:
        with _time_limit(time_limit):
            verify_config(cfg, input_hw=hw)
    except Exception as exc:  # noqa: BLE001 -- classified by the caller
        return 'forward', exc, None
    if not train:
        return '', None, None
    try:
        with _time_limit(time_limit):
            return '', None, train_smoke(cfg, input_hw=hw, few_rois=True)
    except Exception as exc:  # noqa: BLE001
        return 'train smoke', exc, None


def sweep_one(scope: str, family: str, backbone: str, work_dir: str, size: int = 128,
              train: bool = True, time_limit: int = 600) -> SweepRow:
    """Swap, verify and train-smoke the family's representative config (the checks and
    how their failures are classified: ``check_adapted``)."""
    from flatten_mm.swap.plan import swap_backbone
    t0 = time.perf_counter()
    src, why = representative(scope, family)
    if src is None:
        return SweepRow(scope, family, '', 'skipped', why)
    row = SweepRow(scope, family, src.split('::', 1)[1], 'adapted')

    def done(r):
        r.seconds = f'{time.perf_counter() - t0:.0f}'
        return r

    out = osp.join(work_dir, f'{scope}_{family}.py')
    try:
        swap_backbone(src, backbone, out, force=True)
    except SwapError as exc:
        row.status, row.reason = 'refused', str(exc)
        return done(row)
    except Exception as exc:  # noqa: BLE001 -- a bug of the swap: recorded
        row.status, row.reason = 'failed', f'swap: {_one_line(exc)}'
        traceback.print_exc()
        return done(row)
    check_adapted(row, Config.fromfile(out), src, size, train, time_limit)
    return done(row)


def check_adapted(row, cfg: Config, src: str, size: int = 128, train: bool = True,
                  time_limit: int = 600):
    """Run a written (swapped) config once and, with ``train``, one training iteration,
    and record the outcome in ``row`` (a ``SweepRow`` or anything with its ``status``,
    ``reason``, ``size``, ``forward``, ``train_smoke``, ``losses_finite``,
    ``backbone_grads`` and ``batch`` attributes; ``status`` is left as it is when
    everything passed).

    The checks run at ``size`` (a config's own ``input_size`` where it has one, SSD),
    and again at twice and four times that when they fail there (DETR-likes select more
    queries than a 128x128 image has tokens; deformable convs and DDOD's head need
    larger maps). A failure that the
    unswapped source config ``src`` (``scope::family/file.py``) shows too, at the same
    size, is ``source-fails`` (a limitation of mmdet / mmseg on this machine, not of the
    swap); a missing optional package ``needs-package``; an mmcv op without a CPU kernel
    ``gpu-only``.

    Returns:
        ``row``.
    """
    from flatten_mm.swap.plan import load_source_config
    isize = cfg.get('input_size')
    sizes = [isize] if isinstance(isize, int) else [size, 2 * size, 4 * size]
    for n in sizes:
        stage, exc, rep = _check(cfg, (n, n), train, time_limit)
        if stage == '' or _missing_package(exc) or _needs_gpu(exc):
            break
    row.size = str(n)
    if stage == 'forward':
        row.forward = 'failed'
    else:
        row.forward = 'ok'
        if stage == 'train smoke':
            row.train_smoke = 'failed'
    if exc is not None:
        missing = _missing_package(exc)
        if missing:
            row.status = 'needs-package'
            row.reason = f'adapted; the {stage} needs {missing}, not installed here: {_one_line(exc)}'
            row.forward = 'needs package' if stage == 'forward' else row.forward
            row.train_smoke = 'needs package' if stage == 'train smoke' else row.train_smoke
        elif _needs_gpu(exc):
            row.status = 'gpu-only'
            row.reason = (f'adapted; the {stage} needs a GPU: {_one_line(exc)} (an mmcv op '
                          'of the unchanged neck / heads without a CPU kernel)')
            row.forward = 'needs GPU' if stage == 'forward' else row.forward
            row.train_smoke = 'needs GPU' if stage == 'train smoke' else row.train_smoke
        else:
            traceback.print_exception(exc)  # (outside its except block: passed explicitly)
            row.status = 'failed'
            row.reason = f'{stage}: {_one_line(exc)}'
            src_cfg, _ = load_source_config(src)
            s_stage, s_exc, _ = _check(src_cfg, (n, n), train, time_limit)
            if s_stage == stage and _one_line(s_exc) == _one_line(exc):
                row.status = 'source-fails'
                row.reason = (f'adapted; the unswapped source config fails the {stage} the '
                              f'same way here: {_one_line(exc)}')
        return row
    if rep is not None:
        row.losses_finite = 'yes' if all(math.isfinite(v) for v in rep.losses.values()) \
            else 'no'
        row.backbone_grads = f'{rep.backbone_params - len(rep.no_grad)}/{rep.backbone_params}'
        row.batch = rep.batch
        row.train_smoke = 'ok' if rep.ok else 'failed'
        if not rep.ok:
            row.status = 'failed'
            row.reason = 'train smoke: ' + '; '.join(rep.summary().splitlines()[2:])
            nonfinite = [k for k, v in rep.losses.items() if not math.isfinite(v)]
            if nonfinite:  # does the unswapped source (random init too) do the same?
                from flatten_mm.swap.smoke import train_smoke
                src_cfg, _ = load_source_config(src)
                try:
                    with _time_limit(time_limit):
                        src_rep = train_smoke(src_cfg, input_hw=(n, n), few_rois=True,
                                              step=False)
                    if any(not math.isfinite(src_rep.losses.get(k, 0.)) for k in nonfinite):
                        row.status = 'source-fails'
                        row.reason = ('adapted; the unswapped source config (random init, '
                                      'the same demo images and seed) gives non-finite '
                                      f'{", ".join(nonfinite)} too')
                except Exception:  # noqa: BLE001 -- keep 'failed' with its reason
                    traceback.print_exc()
    return row


def read_rows(csv_path: str) -> List[SweepRow]:
    return [SweepRow(**r) for r in read_table(csv_path, COLUMNS)]


def append_row(csv_path: str, row: SweepRow) -> None:
    """Add ``row`` (replacing an earlier row of the same family) and rewrite the CSV."""
    upsert_rows(csv_path, COLUMNS, [asdict(row)], key=('scope', 'family'))


def _md_cell(text: str) -> str:
    return str(text).replace('|', '\\|').replace('\n', ' ')


def render_markdown(rows: List[SweepRow], backbone: str, size: int) -> str:
    """The Markdown page: how the sweep was run, counts, and one row per family."""
    counts = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [
        '# swap_backbone on every mmdet 3.3 / mmseg 1.2 config family',
        '',
        'Generated by `python dev/swap_sweep.py` '
        f'(backbone `{backbone}`, smoke size {size}; do not edit by hand). '
        'One config per family directory of the installed packages\' `.mim/configs`: the '
        'first `.py` in sorted file-name order (the directory\'s own files, then its '
        'sub-directories\') that can be read and has a `model.backbone`. Each is swapped '
        'with `tools/swap_backbone.py`; an adapted config is built and run once on CPU '
        '(`--verify`) and trained one iteration (`--train-smoke`, fewer RPN proposals / '
        'RoIs): finite losses and a gradient for every trainable backbone parameter, '
        'then an optimizer step. `batch` says which training batch was used: `demo` '
        '(the config\'s train pipeline on the bundled demo images and annotations) or '
        '`synthetic` (and why the pipeline could not run on the demo data).',
        '',
        'Status: ' + ', '.join(f'{counts[k]} {k}' for k in
                               ('adapted', 'gpu-only', 'needs-package', 'source-fails',
                                'refused', 'skipped', 'failed')
                               if k in counts)
        + f' ({len(rows)} families).',
        '',
        '| scope | family | config | status | reason | size | forward | train smoke | '
        'losses finite | backbone grads | batch |',
        '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |',
    ]
    for r in sorted(rows, key=lambda r: (r.scope, r.family)):
        batch = r.batch.split(':', 1)[0] if r.batch.startswith(('demo', 'dataset')) \
            else r.batch
        lines.append('| ' + ' | '.join(_md_cell(c) for c in (
            r.scope, r.family, f'`{osp.basename(r.config)}`' if r.config else '', r.status,
            r.reason, r.size, r.forward, r.train_smoke, r.losses_finite, r.backbone_grads,
            batch)) + ' |')
    return '\n'.join(lines) + '\n'


__all__ = ['COLUMNS', 'SweepRow', 'append_row', 'families', 'read_rows', 'render_markdown',
           'representative', 'sweep_one']
