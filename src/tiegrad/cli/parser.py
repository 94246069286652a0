"""The command's parser, built from the subcommands' own parts.

Each subcommand module (``COMMANDS``, in the order ``--help`` lists them) adds its
parser with ``add_parser(sub)`` and sets its ``handler``, the function that runs it;
a new option of a subcommand is a change to its module alone. Errors are one line
(``options.Parser``); an unknown argument names the closest option and the help of
the subcommand it was given to.
"""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

from . import export, inspect, resume, sample, train
from .exits import fail
from .options import Parser

COMMANDS = (train, sample, inspect, resume, export)


def build_parser() -> argparse.ArgumentParser:
    """The ``tiegrad`` parser: ``--version`` and one subparser per command."""
    from .. import __version__

    parser = Parser(
        prog="tiegrad",
        description="Train and sample tied-weight language models with tiegrad.",
    )
    parser.add_argument("--version", action="version", version=f"tiegrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def unknown_arguments(
    parser: argparse.ArgumentParser, command: str | None, unknown: list[str]
) -> NoReturn:
    """One line naming the unknown arguments, the closest option and the right help."""
    sub = _subparser(parser, command)
    target = sub or parser
    options = [o for action in target._actions for o in action.option_strings]
    flag = next((a.split("=", 1)[0] for a in unknown if a.startswith("-")), None)
    close = difflib.get_close_matches(flag, options, n=1) if flag else []
    hint = f"; did you mean {close[0]}?" if close else ""
    fail(f"unrecognized arguments: {' '.join(unknown)}{hint} (see '{target.prog} --help')")


def _subparser(
    parser: argparse.ArgumentParser, command: str | None
) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None
