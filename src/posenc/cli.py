"""The ``posenc`` command. Subcommands only parse arguments and delegate to the package."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable, Sequence


def _info(args: argparse.Namespace) -> int:
    import torch

    import posenc
    from posenc.registry import ENCODINGS
    from posenc.rope.frequencies import SCALINGS

    print(f"posenc {posenc.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    print("encodings:")
    for name, cls in ENCODINGS.items():
        print(f"  {name:<11} acts on {cls.acts_on.value}")
    print(f"rope types: {', '.join(SCALINGS)}")
    print(f"rotation backends: {', '.join(posenc.available_backends())}")
    return 0


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="list encodings, rope types, backends and versions")
    p.set_defaults(func=_info)


# Each entry adds one subcommand's parser; the parser's `func` does the work.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_info]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posenc", description="Positional encodings for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
