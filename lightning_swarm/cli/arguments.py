"""``lightning-swarm arguments``: every ``SwarmStrategy`` argument (a
:class:`~lightning_swarm.settings.SwarmSettings` field) with its ``SWARM_*`` variable, default and meaning."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


def strategy_arguments() -> list:
    """Every ``SwarmStrategy`` argument (a :class:`~lightning_swarm.settings.SwarmSettings` field): name,
    environment variable, type (as the strategy takes it), default and description."""
    from lightning_swarm import settings
    from lightning_swarm.strategy import SwarmStrategy

    try:
        hints = typing.get_type_hints(SwarmStrategy.__init__)
    except Exception:  # an annotation that does not resolve: show the field's
        hints = {}
    described = settings.descriptions()
    out = []
    for f in dataclasses.fields(settings.SwarmSettings):
        value = settings.default(f.name)
        if isinstance(value, (list, tuple, set, frozenset)):
            value = ",".join(map(str, value)) or "(empty)"
        out.append(
            {
                "name": f.name,
                "env": settings.ENV_PREFIX + f.name.upper(),
                "type": _type_name(hints.get(f.name, f.type)),
                "default": "-" if value is None else str(value),
                "description": described.get(f.name, ""),
            }
        )
    return out


def _type_name(annotation: Any) -> str:
    """``Optional[Literal['a', 'b']]`` -> ``'a' | 'b'``; ``Optional[Union[str, list[str]]]`` -> ``str | list[str]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if isinstance(annotation, type) and not args:
        return annotation.__name__
    return str(annotation).replace("typing.", "")


MARKDOWN_HEADER = """# SwarmStrategy's arguments

Every argument of `SwarmStrategy` left unset (None) is read from the environment variable `SWARM_<ARGUMENT>`,
then takes the default below. Lists (multiaddrs, peer ids) are comma separated in the environment. The same
arguments are the `init_args` of `trainer.strategy` in a LightningCLI config (see
[command_line.md](command_line.md)).

Generated from the fields of `lightning_swarm.settings.SwarmSettings` (their docstrings and defaults) by
`lightning-swarm arguments --markdown > docs/arguments.md` (run it again after changing them).
`lightning-swarm arguments` prints the same list in a terminal, and
`python examples/gpt_cli.py fit --trainer.strategy.help SwarmStrategy` shows them as LightningCLI flags.
"""


def cmd_arguments(args: argparse.Namespace) -> int:
    arguments = strategy_arguments()
    if args.markdown:
        print(MARKDOWN_HEADER)
        print("| argument | environment variable | default | meaning |")
        print("| --- | --- | --- | --- |")
        for a in arguments:
            cells = [f"`{a['name']}` ({a['type']})", f"`{a['env']}`", f"`{a['default']}`", a["description"]]
            print("| " + " | ".join(c.replace("|", "\\|").replace("``", "`") for c in cells) + " |")
        return 0
    import textwrap

    for a in arguments:
        print(f"{a['name']} ({a['type']}, default {a['default']}), env {a['env']}")
        text = a["description"].replace("``", "`")
        print(textwrap.fill(text, width=100, initial_indent="    ", subsequent_indent="    "))
    return 0


def add_parser(commands: Any) -> None:
    """Add this command to ``lightning-swarm``'s subcommands."""
    arguments = commands.add_parser(
        "arguments",
        help="list every SwarmStrategy argument with its SWARM_* environment variable, default and meaning",
        description="Every SwarmStrategy argument; each is also read from its environment variable when not given.",
    )
    arguments.add_argument("--markdown", action="store_true", help="print a Markdown table (docs/arguments.md)")
    arguments.set_defaults(handler=cmd_arguments)
