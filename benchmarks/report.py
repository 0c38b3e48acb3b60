"""Writing benchmark results: each script owns one section of ``benchmarks/RESULTS.md``, between markers, and
rewrites only that section, so that scripts can run separately and hand-written text outside the markers stays.
Raw figures go to ``benchmarks/results/<script>.json``, from which ``benchmarks/plot.py`` draws the plot."""

from __future__ import annotations

import json
import platform
import re
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
DATA = Path(__file__).resolve().parent / "results"  # raw figures per script, for benchmarks/plot.py
TITLE = "# Benchmark results\n"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def machine() -> str:
    """One line on where and when the figures were measured."""
    cpu = platform.processor() or platform.machine()
    return f"{time.strftime('%Y-%m-%d')}, {cpu}, Python {platform.python_version()}"


def update_section(name: str, lines: list[str], path: Path = RESULTS) -> None:
    """Replace (or append) the section ``name`` of the results file with ``lines``."""
    start, end = f"<!-- {name}: start -->", f"<!-- {name}: end -->"
    block = "\n".join([start, *lines, end])
    text = path.read_text() if path.exists() else TITLE
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"wrote section {name!r} of {path}")


def save_data(name: str, data: object, directory: Path = DATA) -> None:
    """Keep a script's raw figures as ``results/<name>.json`` (what the plot is drawn from)."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
