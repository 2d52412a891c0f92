"""The `ringcc` command: demo, plan, rewrite. Each subcommand lives in its own module and
is imported only when used (importing torch is the slow part)."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function that adds arguments, function that runs); see each module.
SUBCOMMANDS = {
    "demo": ("ringcc.demo", "Train a small GPT with ringcc on several CPU processes (gloo)."),
    "plan": ("ringcc.planner_cli", "Symbolic per-rank memory plan of a model: O(n/p) verdict, peak, budget."),
    "rewrite": ("ringcc.rewrite", "Offline: export a model, rewrite it, save program, code, report, plan."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringcc", description="ring attention compiler toolkit for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        parser.error(f"subcommand {args.command!r} is not available in this build ({args._missing} missing)")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
