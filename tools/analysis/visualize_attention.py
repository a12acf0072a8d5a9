"""PNG overlays of what a query token attends to, and FLA's rank plot.

    python tools/analysis/visualize_attention.py IMAGE --backbone flatten-pvt-v2-b1 \
        [--checkpoint CKPT] [--stage 1] [--block 0] [--query X Y] [--size 448] [-o OUT_DIR]

Depending on the attention operator of the chosen layer:
* FLA: ``fla_map_s{S}b{B}.png`` (effective attention of the query) and
  ``fla_rank_s{S}b{B}.png`` (attention matrix with / without the DWC term and their
  singular values, on a 14x14 token grid by default);
* SimA: ``sima_map_*.png`` (signed row of n1(Q) n1(K)^T), ``sima_qnorm_*.png`` and
  ``sima_knorm_*.png`` (l2 norms of the normalised queries / keys);
* QuadTree: ``quadtree_level{l}_*.png`` per pyramid level (scores of the candidate keys,
  the kept top-K cells outlined; level 0 = coarsest).
Overlays have the size of IMAGE; the query (default: the image centre) is marked.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

from flatten_mm.analysis.visualize import visualize_attention  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('image')
    p.add_argument('--backbone', required=True, help='catalogue name (swap_backbone.py --list)')
    p.add_argument('--checkpoint', help='converted checkpoint (tools/convert_checkpoint.py)')
    p.add_argument('--stage', type=int, default=1, help='1-based stage (SimA-XCiT: 1)')
    p.add_argument('--block', type=int, default=0, help='block in the stage (-1: last)')
    p.add_argument('--query', type=float, nargs=2, metavar=('X', 'Y'),
                   help='query pixel in IMAGE (default: centre)')
    p.add_argument('--size', type=int, default=448, help='short side of the model input')
    p.add_argument('--rank-size', type=int, help='input size of the FLA rank plot')
    p.add_argument('-o', '--out-dir', default='work_dirs/attention_maps')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        paths = visualize_attention(args.image, args.backbone, args.out_dir, args.checkpoint,
                                    args.stage, args.block,
                                    tuple(args.query) if args.query else None, args.size,
                                    args.rank_size)
    except (ValueError, NotImplementedError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == '__main__':
    sys.exit(main())
