"""``lightning-swarm demo``: the local demo swarm (examples/demo.py of a checkout)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_swarm.cli.common import CLIError


def demo_candidates() -> list:
    """Where examples/demo.py may be: the checkout this package was installed from, then the current directory."""
    checkout = Path(__file__).resolve().parents[2]
    return [checkout / "examples" / "demo.py", Path.cwd() / "examples" / "demo.py"]


def cmd_demo(args: argparse.Namespace) -> int:
    found = [path for path in demo_candidates() if path.is_file()]
    if not found:
        looked = ", ".join(str(p) for p in demo_candidates())
        raise CLIError(
            "the demo runs examples/demo.py (and examples/gpt.py) from a checkout of the lightning_swarm repository; "
            f"not found (looked at {looked}): clone the repository and run lightning-swarm demo inside it"
        )
    command = [sys.executable, str(found[0]), *args.demo_args]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the demo, which stops its peers
    try:
        return subprocess.call(command)
    finally:
        signal.signal(signal.SIGINT, previous)


def add_parser(commands: Any) -> None:
    """Add this command to ``lightning-swarm``'s subcommands."""
    demo = commands.add_parser(
        "demo",
        help="run the local demo swarm (examples/demo.py of a checkout); arguments go to the demo",
        description="Run examples/demo.py of a lightning_swarm checkout; every argument after 'demo' is passed on "
        "(lightning-swarm demo --help shows the demo's own options).",
        add_help=False,
    )
    demo.set_defaults(handler=cmd_demo, demo_args=[])
