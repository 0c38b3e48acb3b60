"""Smoke of the benchmark that runs its swarms on emulated hosts (benchmarks/wiring.py): a star/chain pair of a tiny
3-stage GPT, every peer on a host of its own. Needs root and the ``ip`` command, and skips without."""

from __future__ import annotations

import json
import math

import pytest
from helpers.benchmark_smoke import smoke
from helpers.emulated_hosts import unavailable_reason


def test_wiring_smoke(tmp_path):
    """Both wirings trained every step to a finite loss, and the bytes on the trainer's link fit each wiring: every
    sample's input and output and their gradients cross it (4 activations, fp32 in the smoke), and star also relays
    each of the 2 inner stage boundaries both ways, forward and backward (12 in all, with 3 stages), so that chain's
    trainer moves well under star's bytes per sample (a third of them, less what both wirings send besides the
    activations: a CI run saw 0.52, with chain at 5.8 activations per sample). Byte counts, not times: they hold on a
    loaded machine, within a step's share at the edges of the counted window."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    text = smoke(tmp_path, "wiring", timeout=240)
    rows = {row["wiring"]: row for row in json.loads((tmp_path / "results" / "wiring.json").read_text())}
    assert rows.keys() == {"star", "chain"}, rows
    for row in rows.values():
        assert row["samples_per_s"], row.get("error")
        assert row["steps"] == row["load"]["steps"] and math.isfinite(row["last_loss"]), row
        assert f"| {row['samples_per_s']:.2f} | {row['trainer_bytes_per_sample'] / 1024:.1f} |" in text, text
    activation = row["load"]["block"] * row["d_model"] * 4  # one sample's, fp32
    # The link's counters at each edge of the window are interpolated between reads around the step's end: bytes of
    # the neighbouring steps may fall on either side of it, together well within one step.
    measured = row["load"]["steps"] - row["load"]["warmup"]
    edges = (measured - 1) / measured
    star, chain = rows["star"]["trainer_bytes_per_sample"], rows["chain"]["trainer_bytes_per_sample"]
    assert star >= edges * 4 * row["stages"] * activation, (star, activation)
    assert chain >= edges * 4 * activation, (chain, activation)
    calls = {w: {k: rows[w][k] for k in ("failovers", "direct_calls", "p2p_calls")} for w in rows}
    assert chain < 0.6 * star, (chain, star, calls)
