"""CLI: python -m fxopt explain FILE.py:FACTORY [--dump DIR] [options]

FACTORY() returns (model, example_inputs); the report is printed, and written to DIR with --dump.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def _load_factory(spec: str):
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise SystemExit(f"fxopt: expected FILE.py:FACTORY, got {spec!r}")
    if not os.path.isfile(path):
        raise SystemExit(f"fxopt: no such file: {path}")
    mod_spec = importlib.util.spec_from_file_location("fxopt_cli_model", path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:
        raise SystemExit(f"fxopt: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, name):
        raise SystemExit(f"fxopt: {path} has no function {name!r}")
    return getattr(module, name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxopt")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="compile a model through fxopt and print what every pass did")
    ex.add_argument("target", help="FILE.py:FACTORY, where FACTORY() returns (model, example_inputs)")
    ex.add_argument("--dump", metavar="DIR", help="write report.html, passes/, kernels/, wrapper.py here")
    ex.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    ex.add_argument("--no-fuse", action="store_true", help="leave every op to ATen")
    ex.add_argument("--verify", action="store_true", help="check every pass numerically")
    args = parser.parse_args(argv)

    factory = _load_factory(args.target)
    try:
        model, inputs = factory()
    except Exception as exc:
        raise SystemExit(f"fxopt: {args.target}() raised {type(exc).__name__}: {exc}") from exc
    import fxopt

    options = {"verify": args.verify, "fuse": not args.no_fuse}
    if args.precision:
        options["precision"] = args.precision
    rep = fxopt.explain(model, *inputs, **options)
    print(rep)
    if args.dump:
        rep.save(args.dump)
        print(f"wrote {os.path.join(args.dump, 'report.html')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
