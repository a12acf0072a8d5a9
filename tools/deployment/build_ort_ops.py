"""Build flatten_mm's ONNX Runtime operator library (``flatten_mm.deploy.ort_ops``).

    python tools/deployment/build_ort_ops.py build    # prints the library's path
    python tools/deployment/build_ort_ops.py status   # the library, or why there is none
    python tools/deployment/build_ort_ops.py headers  # where the C API headers come from

``build`` compiles the library against ONNX Runtime's C API headers, or finds it in the
cache, and prints its path: copy it next to a model exported with ``--custom-ops`` and
register it with ``SessionOptions.register_custom_ops_library``. It exits 1, saying why,
when the library cannot be built. The headers are not downloaded: they come from
``$FLATTEN_MM_ORT_INCLUDE`` or the system's ``libonnxruntime-dev``; ``headers`` prints the
folder in use, or how to get them, and exits 1 without them. See
docs/user_guides/deploy.md.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))


def main(argv=None) -> int:
    from flatten_mm.deploy import ort_ops
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('command', choices=('build', 'status', 'headers'))
    args = p.parse_args(argv)
    if args.command == 'headers':
        include = ort_ops.header_dir()
        if include is None:
            print(ort_ops.missing_headers_message(), file=sys.stderr)
            return 1
        try:
            print(ort_ops.check_api(include))
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
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
