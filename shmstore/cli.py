"""Command line: `shmstore demo` (also `python -m shmstore demo`)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmstore", description=(
        "Shared-memory object store and caches for multimodal LLM serving."))
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a frontend and N workers sharing image tensors")
    from .demo import add_arguments

    add_arguments(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
