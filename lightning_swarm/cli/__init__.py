"""lightning-swarm: look at a live swarm, plot a run's metrics, start the local demo.

    lightning-swarm status --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3... --run-id gpt
    lightning-swarm status --watch 5            # SWARM_INITIAL_PEERS and SWARM_RUN_ID from the environment
    lightning-swarm plot lightning_logs/ -o run.png
    lightning-swarm demo                        # the same as python examples/demo.py in a checkout
    lightning-swarm arguments                   # every strategy argument and its SWARM_* variable

Exit codes: 0 success, 1 the swarm could not be reached or read (or another error, explained on stderr), 2 bad
usage, 3 the swarm was reached but no peer of the run was found.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from lightning_swarm.cli import arguments, demo, plot, status
from lightning_swarm.cli.arguments import strategy_arguments
from lightning_swarm.cli.common import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_USAGE, CLIError
from lightning_swarm.cli.plot import event_points, load_metrics
from lightning_swarm.cli.status import format_status, read_status, status_dict

__all__ = [
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_USAGE",
    "CLIError",
    "build_parser",
    "entry_point",
    "event_points",
    "format_status",
    "load_metrics",
    "main",
    "read_status",
    "status_dict",
    "strategy_arguments",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-swarm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    for command in (status, plot, demo, arguments):  # one module per command
        command.add_parser(commands)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lightning_swarm")
    except Exception:
        return "unknown"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = [i for i, arg in enumerate(argv) if not arg.startswith("-")]
    demo_args = []
    if commands and argv[commands[0]] == "demo":  # everything after "demo" belongs to the demo, --help included
        argv, demo_args = argv[: commands[0] + 1], argv[commands[0] + 1 :]
    args = parser.parse_args(argv)
    if args.command == "demo":
        args.demo_args = demo_args
    # the CLI reports failures itself, in one line; the DHT process (forked later) inherits these levels
    quiet = [logging.getLogger("hivemind"), logging.getLogger("asyncio")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        return args.handler(args)
    except CLIError as e:
        print(f"lightning-swarm: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head
        return 0
    finally:
        for logger, level in zip(quiet, levels):  # main() may run inside another program (tests)
            logger.setLevel(level)


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
