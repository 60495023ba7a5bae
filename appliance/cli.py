"""The `appliance` command: one verb per stage, each mapped to one function in one module.

A verb is registered here only when it works end to end (no placeholders).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from appliance import __version__
from appliance.core.errors import ApplianceError
from appliance.core.values import OneLineParser, one_line
from appliance.core.manifest import remember_command
from appliance.train.cli import k8s_parser, slurm_parser
from appliance.core.progress import set_quiet

# Modules that contribute verbs. Each exposes `register(subparsers)` and sets `func` on its
# parsers: a function, or "module:function" of a handler module that imports heavy libraries
# (torch, tvm) at its top and is imported when its verb runs, so `appliance --help` stays fast.
VERB_MODULES = [  # in the order of the pipeline, as `appliance --help` lists them
    "appliance.doctor",
    "data_tools.cli",
    "appliance.train.cli",
    "appliance.tune.cli",
    "appliance.deploy.cli",  # export, quantize, compile, package, edge
    "appliance.pipeline.cli",
    "appliance.bundle.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="appliance",
        description="Offline on-prem training: check TFRecord data, train with torchrun, "
        "ship quantized ARM models. Every stage works with no network.",
    )
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    for name in VERB_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def handler(func):
    """A verb's function, or "module:function": a handler module that imports heavy libraries (torch,
    numpy, tvm) at its top, imported only when its verb runs (tests/test_layers.py STRING_IMPORTS)."""
    if isinstance(func, str):
        module, _, name = func.partition(":")
        return getattr(importlib.import_module(module), name)
    return func


def _verb_label(args) -> str:
    """`data check`, `edge verify`, ...: the words the user typed, for the one-line error."""
    if getattr(args, "verb_label", None):
        return args.verb_label
    sub = next((getattr(args, k) for k in ("data_verb", "edge_verb", "bundle_verb") if getattr(args, k, None)), None)
    return f"{args.verb} {sub}" if sub else str(args.verb)


def main(argv: list[str] | None = None) -> int:
    argv_given = None if argv is None else list(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line, not only before the verb.
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    if argv[:2] == ["train", "slurm"]:  # a sub-verb of `train`, whose own first argument is a file

        args = slurm_parser().parse_args(argv[2:])
    elif argv[:2] == ["train", "k8s"]:
        args = k8s_parser().parse_args(argv[2:])
        args.argv = argv[2:]  # the manifests' header says how they were made
    else:
        args = parser.parse_args(argv)
    args.debug = debug

    remember_command(list(sys.argv[1:]) if argv_given is None else argv_given)  # as typed, --debug too
    if getattr(args, "quiet", False):
        set_quiet(True)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(handler(args.func)(args) or 0)
    except ApplianceError as err:
        if args.debug:
            traceback.print_exc()
        print(one_line(f"appliance {_verb_label(args)}: error: {err}"), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"appliance {_verb_label(args)}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # an unexpected failure still gets one line, with a hint
        if args.debug:
            traceback.print_exc()
        else:
            print(one_line(f"appliance {_verb_label(args)}: internal error: {type(err).__name__}: {err} "
                           "(rerun with --debug for the traceback)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
