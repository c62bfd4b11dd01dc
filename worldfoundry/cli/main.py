"""The ``worldfoundry`` command line.

Each subcommand lives in its own module that exposes ``add_parser(subparsers)``; that function adds one
sub-parser and sets ``func=run`` on it (``run(args) -> int``). :data:`COMMANDS` maps the command name to the
module; adding a command is one line there.

Example:
    >>> from worldfoundry.cli.main import main
    >>> main(["plugins", "--json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any, Final

from worldfoundry import __version__

logger = logging.getLogger(__name__)

#: Subcommand name -> module exposing ``add_parser(subparsers)``.
COMMANDS: Final[dict[str, str]] = {
    "plugins": "worldfoundry.cli.plugins_cmd",
    "generate": "worldfoundry.cli.generate_cmd",
    "estimate-residency": "worldfoundry.cli.estimate_residency_cmd",
    "bench": "worldfoundry.cli.bench_cmd",
    "calibrate": "worldfoundry.cli.calibrate_cmd",
    "tune": "worldfoundry.cli.tune_cmd",
}


def _add_unavailable(subparsers: Any, name: str, module: str, exc: BaseException) -> None:
    """A command whose module failed to import still appears, and says why when it is run."""
    reason = f"{type(exc).__name__}: {exc}"
    parser = subparsers.add_parser(name, help=f"(unavailable: {reason})", add_help=False)

    def run(args: argparse.Namespace) -> int:
        print(f"worldfoundry {name}: cannot load {module}: {reason}", file=sys.stderr)
        return 2

    parser.set_defaults(func=run, unavailable_command=True)


def build_parser(commands: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of ``commands`` (default :data:`COMMANDS`)."""
    parser = argparse.ArgumentParser(
        prog="worldfoundry",
        description="Pluggable, reversible, verifiable inference accelerations for video diffusion transformers.",
    )
    parser.add_argument("--version", action="version", version=f"worldfoundry {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in (commands if commands is not None else COMMANDS).items():
        try:
            module = importlib.import_module(module_name)
            module.add_parser(subparsers)
        except Exception as exc:  # one broken command must not take the others down
            logger.debug("command %s unavailable", name, exc_info=True)
            _add_unavailable(subparsers, name, module_name, exc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line. Returns the process exit status.

    Args:
        argv: arguments without the program name (``sys.argv[1:]`` when ``None``).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(list(argv) if argv is not None else None)
    if extra and not getattr(args, "unavailable_command", False):  # an unavailable command says why instead
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from worldfoundry.errors import WorldFoundryError

    try:
        return int(func(args) or 0)
    except WorldFoundryError as exc:  # a typed error is the whole message: no traceback for a CLI user
        logger.debug("%s failed", args.command, exc_info=True)
        print(f"worldfoundry {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
