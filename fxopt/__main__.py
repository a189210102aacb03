"""CLI: compile a model file through fxopt and print what it did, or where its time goes.

    python -m fxopt explain FILE.py:FACTORY [--dump DIR [--dump-all-passes]] [options]
    python -m fxopt profile FILE.py:FACTORY [--warmup N] [--repeat N] [options]

options: --precision bf16|fp16|fp32, --verify, --no-attention, --no-fuse (fxopt's backend options).
FACTORY() returns (model, example_inputs). An unknown option is an argparse error (exit status 2).
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
    sys.modules[mod_spec.name] = module  # dataclasses (and pickling) look their module up there
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_spec.name]
        raise SystemExit(f"fxopt: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, name):
        raise SystemExit(f"fxopt: {path} has no function {name!r}")
    return getattr(module, name)


def _model_and_inputs(spec: str):
    """(model, inputs as a tuple): a single tensor is one input, never unpacked along its first dim."""
    factory = _load_factory(spec)
    try:
        made = factory()
    except Exception as exc:
        raise SystemExit(f"fxopt: {spec}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and callable(made[0])):
        raise SystemExit(f"fxopt: {spec}() must return (model, example_inputs), got {type(made).__name__}"
                         f"{f' of length {len(made)}' if isinstance(made, (tuple, list)) else ''}")
    model, inputs = made
    import torch  # (lazily, as fxopt: argument errors print at once)
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise SystemExit(f"fxopt: {spec}()'s example_inputs must be a tensor or a tuple of inputs, got "
                         f"{type(inputs).__name__}")
    return model, tuple(inputs)


def _backend_options_parser() -> argparse.ArgumentParser:
    """The backend options both commands take (fxopt.Options fields)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("target", help="FILE.py:FACTORY, where FACTORY() returns (model, example_inputs)")
    common.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="default: the model's dtypes")
    common.add_argument("--verify", action="store_true", help="check every pass numerically")
    common.add_argument("--no-attention", action="store_true", help="leave attention as written")
    common.add_argument("--no-fuse", action="store_true", help="leave every op to ATen")
    return common


def _backend_options(args) -> dict:
    options = {"verify": args.verify, "fuse": not args.no_fuse, "attention": not args.no_attention}
    if args.precision:
        options["precision"] = args.precision
    return options


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fxopt")
    sub = parser.add_subparsers(dest="command", required=True)
    common = _backend_options_parser()
    ex = sub.add_parser("explain", parents=[common],
                        help="compile a model through fxopt and print what every pass did")
    ex.add_argument("--dump", metavar="DIR", help="write report.html, passes/, kernels/, wrapper.py here")
    ex.add_argument("--dump-all-passes", action="store_true",
                    help="with --dump: also print the passes that changed nothing (as FXOPT_DUMP_ALL=1)")
    prof = sub.add_parser("profile", parents=[common],
                          help="run the compiled model and time each kernel and ATen call against the roofline")
    prof.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    prof.add_argument("--repeat", type=int, default=10, help="timed steps")
    ex.set_defaults(run=_explain, parser=ex)
    prof.set_defaults(run=_profile, parser=prof)
    return parser


def _explain(args) -> None:
    if args.dump_all_passes and not args.dump:
        args.parser.error("--dump-all-passes needs --dump DIR")
    model, inputs = _model_and_inputs(args.target)
    import fxopt
    from fxopt.dump import write_dump

    rep = fxopt.explain(model, *inputs, **_backend_options(args))
    print(rep)
    if args.dump:
        write_dump(rep, args.dump, all_passes=args.dump_all_passes)
        print(f"wrote {os.path.join(args.dump, 'report.html')}")


def _profile(args) -> None:
    if args.warmup < 0 or args.repeat < 1:
        args.parser.error("--warmup must be >= 0 and --repeat >= 1")
    model, inputs = _model_and_inputs(args.target)
    import fxopt

    print(fxopt.profile(model, *inputs, warmup=args.warmup, repeat=args.repeat, **_backend_options(args)))


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
