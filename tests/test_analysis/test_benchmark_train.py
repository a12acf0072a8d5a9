"""Training-step, whole-model and profile modes of the benchmark (structure, not speed).

Tiny architectures on CPU; no timing is asserted (the benchmark is a tool, not a timed
test). What is asserted: ours and the baseline are measured in the same run and their
ratio is computed from those rows, peak memory is reported, a training step really
updates the parameters, autocast is applied, and the profile's counts follow their
documented definitions.
"""
import os.path as osp
import sys

import pytest
import torch

from benchmarks import core as bm
from benchmarks.core import profiling, train

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from benchmark_cli import load_cli  # noqa: E402

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
PAIR = {'flatten-pvt-v2-tiny': ('pvt-v2-tiny (timm)', )}
TINY = dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 2),
            mlp_ratios=(2, 2, 2, 2))


def _tiny_flatten():
    from flatten_mm.models.backbones import FLattenPVTv2
    torch.manual_seed(0)
    return FLattenPVTv2(arch=TINY, drop_path_rate=0.)


def _check_ratios(rows, ratios, suite):
    """Every ratio row is ours / baseline of two rows of the same group of this run."""
    assert ratios
    for r in ratios:
        group = [x for x in rows if x['suite'] == suite and x['group'].startswith(r['ours'])
                 and x.get('step') == r['step'] and x.get('exec') == r['exec']
                 and (x['height'], x['width']) == (r['height'], r['width'])]
        ours = [x for x in group if x['name'] == r['ours']]
        base = [x for x in group if x['name'] == r['baseline']]
        assert len(ours) == 1 and len(base) == 1, (r, group)
        assert ours[0]['group'] == base[0]['group']  # alternated in one measurement
        assert r['ours_ms'] == ours[0]['median_ms'] and r['baseline_ms'] == base[0]['median_ms']
        assert r['ratio_median'] == ours[0]['median_ms'] / base[0]['median_ms']
        assert r['ours_mem_mb'] == ours[0]['peak_mem_mb']
        assert r['mem_ratio'] == ours[0]['peak_mem_mb'] / base[0]['peak_mem_mb']


def test_step_rows_pair_ours_with_baseline_in_one_run():
    rows = bm.run_step_benchmark(pairs=PAIR, resolutions=((64, 48), ), batch=2,
                                 steps=('forward', 'train'), execs=('eager', ), warmup=1,
                                 repeats=2, memory=True, quick=True)
    assert {(r['name'], r['step']) for r in rows} == {
        (n, s) for n in ('flatten-pvt-v2-tiny', 'pvt-v2-tiny (timm)')
        for s in ('forward', 'train')}
    for r in rows:
        assert r['suite'] == 'step' and r.get('note') is None, r
        assert r['median_ms'] > 0 and r['repeats'] == 2 and r['batch'] == 2
        assert r['amp'] == 'fp32' and r['exec'] == 'eager'
        assert r['peak_mem_mb'] is not None and r['peak_mem_mb'] > 0, r
    # a training step keeps activations and gradients: more memory than a no-grad forward
    for name in ('flatten-pvt-v2-tiny', 'pvt-v2-tiny (timm)'):
        fwd, trn = (next(r for r in rows if r['name'] == name and r['step'] == s)
                    for s in ('forward', 'train'))
        assert trn['peak_mem_mb'] > fwd['peak_mem_mb']
    ratios = bm.step_ratio_rows(rows, PAIR)
    assert sorted(r['step'] for r in ratios) == ['forward', 'train']
    _check_ratios(rows, ratios, 'step')


def test_compiled_rows_are_paired_among_themselves():
    # 'eager' backend: dynamo traces the call (what --execs compile exercises) without
    # code generation, so the test stays cheap
    rows = bm.run_step_benchmark(pairs=PAIR, resolutions=((32, 32), ), batch=1,
                                 steps=('train', ), execs=('eager', 'compile'),
                                 compile_backend='eager', warmup=1, repeats=1, memory=False,
                                 quick=True)
    assert {(r['name'], r['exec']) for r in rows if r.get('median_ms')} == {
        (n, e) for n in PAIR['flatten-pvt-v2-tiny'] + ('flatten-pvt-v2-tiny', )
        for e in ('eager', 'compile')}
    ratios = bm.step_ratio_rows(rows, PAIR)
    assert sorted(r['exec'] for r in ratios) == ['compile', 'eager']
    for r in ratios:
        ours = next(x for x in rows if x['name'] == r['ours'] and x['exec'] == r['exec'])
        base = next(x for x in rows if x['name'] == r['baseline'] and x['exec'] == r['exec'])
        assert r['ratio_median'] == ours['median_ms'] / base['median_ms']


def test_unknown_step_or_exec_is_refused():
    with pytest.raises(ValueError, match='unknown step'):
        bm.run_step_benchmark(pairs=PAIR, steps=('backward', ), quick=True)
    with pytest.raises(ValueError, match='unknown exec'):
        bm.run_step_benchmark(pairs=PAIR, execs=('jit', ), quick=True)


def test_train_step_updates_every_parameter_and_forward_none():
    model = _tiny_flatten()
    x = torch.randn(2, 3, 64, 48)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fwd = bm.backbone_step(model, model, x, 'forward')
    out = fwd()
    assert not model.training and all(not t.requires_grad for t in out)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt = train.make_optimizer(model)
    step = bm.backbone_step(model, model, x, 'train', optimizer=opt)
    loss = step()
    assert model.training and torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is None, f'{n}: gradient kept after the step (zero_grad at its end)'
        state = opt.state[p]
        assert state and state['exp_avg'].abs().max() > 0, f'{n}: no gradient from the loss'
        assert not torch.equal(p.detach(), before[n]), f'{n}: not updated by AdamW'


def test_bf16_autocast_is_applied_to_the_step():
    assert train.amp_label(torch.bfloat16) == 'bf16' and train.amp_label(None) == 'fp32'
    model = _tiny_flatten()
    x = torch.randn(1, 3, 64, 48)
    out = bm.backbone_step(model, model, x, 'forward', amp=torch.bfloat16)()
    assert any(t.dtype == torch.bfloat16 for t in out)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay fp32
    before = [p.detach().clone() for p in model.parameters()]
    loss = bm.backbone_step(model, model, x, 'train', amp=torch.bfloat16)()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_output_loss_needs_a_tensor():
    maps = torch.randn(2, 4, 3, 5)
    w = torch.tensor([-1., -1 / 3, 1 / 3, 1.]).view(1, 4, 1, 1)
    tokens = torch.randn(2, 6, 3)
    expected = (maps * w).mean() + (tokens * torch.tensor([-1., 0., 1.])).mean()
    assert torch.allclose(bm.output_loss([maps, (tokens, )]), expected, atol=1e-6)
    # a LayerNorm-ed output still gives a gradient (a plain mean would be constant)
    x = torch.randn(2, 5, 8, requires_grad=True)
    bm.output_loss(torch.nn.functional.layer_norm(x, (8, ))).backward()
    assert x.grad.abs().max() > 1e-3
    with pytest.raises(ValueError, match='no tensor'):
        bm.output_loss({'a': None})


def test_whole_model_training_step_rows():
    pytest.importorskip('mmdet')
    rows = bm.run_whole_model_benchmark(input_hws=((64, 64), ), batch=1, warmup=1, repeats=1,
                                        memory=True, quick=True)
    assert [r['name'] for r in rows] == ['mask-rcnn flatten-pvt-v2-tiny',
                                         'mask-rcnn pvt-v2-tiny (mmdet)']
    for r in rows:
        assert r['suite'] == 'model_step' and r.get('note') is None, r
        assert r['median_ms'] > 0 and r['peak_mem_mb'] > 0
    ratios = bm.step_ratio_rows(rows, bm.whole_model_pairs(quick=True), suite='model_step')
    assert len(ratios) == 1
    _check_ratios(rows, ratios, 'model_step')


def test_whole_model_step_updates_the_backbone():
    pytest.importorskip('mmdet')
    (cfg, _), = train.whole_model_configs(quick=True).values()
    model, step = train.whole_model_step(cfg, (64, 64), 1, torch.device('cpu'))
    before = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    assert torch.isfinite(step())
    changed = [n for n, p in model.backbone.named_parameters()
               if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(before)


def test_classifier_training_step_rows():
    """The ImageNet classifier suite: ours and the softmax counterpart alternate in one
    run (at 64x64 here), each with its peak memory; the ratio comes from those rows."""
    pytest.importorskip('mmpretrain')
    rows = bm.run_classifier_benchmark(batches=(2, ), input_hw=(64, 64),
                                       names=('flatten-pvt-v2-b0', ), warmup=1, repeats=1)
    assert [r['name'] for r in rows] == ['flatten-pvt-v2-b0', 'pvt-v2-b0']
    for r in rows:
        assert r['suite'] == 'classifier_step' and r.get('note') is None, r
        assert r['batch'] == 2 and r['median_ms'] > 0 and r['peak_mem_mb'] > 0
    ratios = bm.step_ratio_rows(rows, bm.classifier_pairs(), suite='classifier_step')
    assert len(ratios) == 1
    _check_ratios(rows, ratios, 'classifier_step')
    with pytest.raises(ValueError, match='unknown classifiers'):
        bm.run_classifier_benchmark(names=('resnet-50', ))


def test_every_classifier_pair_loads_with_the_same_head():
    """Ours and the counterpart of every pair load (package configs included) and build
    1000-class heads."""
    pytest.importorskip('mmpretrain')
    for ours, (path, baselines) in train.CLASSIFIER_PAIRS.items():
        for name, cfg_path in dict({ours: path}, **baselines).items():
            cfg = train._load_config(cfg_path)
            assert cfg.model.type == 'ImageClassifier', name
            assert cfg.model.head.num_classes == 1000, name


def test_classifier_step_updates_every_parameter():
    pytest.importorskip('mmpretrain')
    cfg = train._load_config(train.CLASSIFIER_PAIRS['sima-xcit-s12-p16'][0])
    cfg.model.backbone.update(arch=dict(embed_dims=32, depth=2, num_heads=2),
                              block_indices=(1, 1, 1, 1))
    cfg.model.neck.update(embed_dims=32, num_heads=2)
    cfg.model.head.in_channels = 32
    model, step = train.classifier_step(cfg, (64, 64), 2, torch.device('cpu'))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.isfinite(step())
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []


def test_profile_counts_follow_their_definitions():
    model = _tiny_flatten()
    x = torch.randn(1, 3, 64, 64)
    summary, kernels = bm.profile_backbone(model, model, x, top=5)
    assert summary['blocks'] == 4 and summary['attention_layers'] == 4
    assert summary['infer_launches'] > 0
    assert summary['fwd_launches'] > 0 and summary['bwd_launches'] > 0
    assert summary['fwd_per_block'] == summary['fwd_launches'] / 4
    assert summary['bwd_per_block'] == summary['bwd_launches'] / 4
    assert summary['launch_unit'] == 'top-level aten ops'
    # ideal = input + output activations of every attention layer: (B, N_i, C_i) each way
    expected = sum(2 * 1 * (16 // 2**i)**2 * c * 4
                   for i, c in enumerate(TINY['embed_dims']))
    assert summary['attn_ideal_mb'] * 2**20 == expected
    # unfused ops move at least what one fused kernel per layer would
    assert summary['moved_mb_fwd'] >= summary['attn_moved_mb'] >= summary['attn_ideal_mb']
    assert summary['attn_bytes_ratio'] == summary['attn_moved_mb'] / summary['attn_ideal_mb']
    assert summary['dispatch_ops_fwd'] > 0 and summary['dispatch_ops_bwd'] > 0
    assert 0 < summary['saved_mb'] < summary['moved_mb_fwd']
    assert len(kernels) == 5
    assert [k['self_ms'] for k in kernels] == sorted((k['self_ms'] for k in kernels),
                                                     reverse=True)
    assert 0 < sum(k['share'] for k in kernels) <= 1 + 1e-9


def test_profile_saved_bytes_follow_their_definition():
    """saved_mb = the activations the forward saves for the backward, each storage once,
    parameters excluded: Linear saves its input (the weight is a parameter), ReLU its
    output, the second Linear its input = that same output."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    summary, _ = bm.profile_backbone(model, model, x, top=3)
    assert summary['saved_mb'] * 2**20 == 5 * 8 * 4 + 5 * 16 * 4


def test_profile_block_and_attention_detection_on_timm():
    from timm.models.pvt_v2 import PyramidVisionTransformerV2
    torch.manual_seed(0)
    model = PyramidVisionTransformerV2(depths=(1, 2, 1, 1), embed_dims=(8, 16, 24, 32),
                                       num_heads=(1, 1, 1, 2), mlp_ratios=(2, 2, 2, 2))
    summary, _ = profiling.profile_backbone(
        model, lambda t: model.forward_intermediates(t, intermediates_only=True),
        torch.randn(1, 3, 64, 64), top=3)
    assert summary['blocks'] == 5 and summary['attention_layers'] == 5


def test_markdown_tables_from_stored_csv(tmp_path, capsys):
    ratios = [dict(ours='a', baseline='b (timm)', height=512, width=512, ours_ms=2.0,
                   baseline_ms=4.0, ratio_median=0.5, mem_ratio=0.75, step='train',
                   exec='eager', amp='bf16', kernels='1', batch=8, device='cuda'),
              dict(ours='a', baseline='b (timm)', height=800, width=1344, ours_ms=9.0,
                   baseline_ms=6.0, ratio_median=1.5, step='train', exec='eager',
                   amp='bf16', kernels='1', batch=8, device='cuda')]
    text = bm.markdown_ratio_table(ratios)
    assert '**train step, eager, bf16, FLATTEN_MM_TRITON=1, batch 8, cuda**' in text
    assert '| ours vs | 512² | 800×1344 |' in text
    assert '| a vs b (timm) | 0.50 (2 / 4), mem 0.75 | 1.50 (9 / 6) |' in text
    csv_path, md_path = tmp_path / 'rows.csv', tmp_path / 'table.md'
    bm.write_csv([dict(r, suite='ratio', name=r['ours']) for r in ratios], str(csv_path))
    cli = load_cli()
    assert cli.main(['--markdown', str(md_path), '--from-csv', str(csv_path)]) == 0
    written = md_path.read_text()
    assert '| a vs b (timm) | 0.50 (2 / 4), mem 0.75 | 1.50 (9 / 6) |' in written
    assert '## Op level' not in capsys.readouterr().out  # nothing was run
