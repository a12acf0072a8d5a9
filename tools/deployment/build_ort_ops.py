"""Build flatten_mm's ONNX Runtime operator library (``flatten_mm.deploy.ort_ops``).

    python tools/deployment/build_ort_ops.py fetch-headers  # ONNX Runtime's C API headers
    python tools/deployment/build_ort_ops.py build          # prints the library's path
    python tools/deployment/build_ort_ops.py status

``fetch-headers`` takes the headers from Debian's ``libonnxruntime-dev`` (checked against
the SHA-256 of Debian's package index) and prints their folder; ``scripts/setup_env.sh``
runs it. ``build`` compiles the library, or finds it in the cache, and prints its path: copy
it next to a model exported with ``--custom-ops`` and register it with
``SessionOptions.register_custom_ops_library``. It exits 1, saying why, when the library
cannot be built. See docs/user_guides/deploy.md.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))


def main(argv=None) -> int:
    from flatten_mm.deploy import ort_ops
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('command', choices=('fetch-headers', 'build', 'status'))
    p.add_argument('--suite', default=ort_ops.DEBIAN_SUITE,
                   help='Debian release to take libonnxruntime-dev from (fetch-headers; '
                        f'default {ort_ops.DEBIAN_SUITE})')
    args = p.parse_args(argv)
    if args.command == 'fetch-headers':
        print(ort_ops.fetch_headers(args.suite))
    elif args.command == 'build':
        library = ort_ops.library_path()
        if library is None:
            print(f'not built: {ort_ops.status()}', file=sys.stderr)
            return 1
        print(library)
    else:
        print(ort_ops.status())
    return 0


if __name__ == '__main__':
    sys.exit(main())
