"""What the benchmark smokes (tests/swarm/test_benchmarks*.py) share: running a script's ``--smoke``, and the bytes
the 8-bit wire carries."""

from __future__ import annotations

from helpers import ROOT, run_script
from lightning_swarm.settings import SwarmSettings


def eight_bit_bytes(elements: int) -> int:
    """The bytes of an 8-bit tensor on the wire: one per element, and a float32 scale per block of 4096."""
    return elements + 4 * -(-elements // 4096)


def sent_per_step(setup: dict, wiring: str = SwarmSettings().wiring) -> int:
    """What a drive-only trainer of the 2-stage GPT sends per step, 8-bit, for each microbatch: relaying every
    boundary (``"star"``), its input to stage 0, stage 0's output on to stage 1, and the gradients of both stages'
    outputs back (4 activation-sized tensors); stage to stage (``"chain"``), its input to stage 0 and its output's
    gradient to stage 1 (2)."""
    count = setup["microbatches"]
    elements = setup["batch_size"] // count * setup["block_size"] * setup["d_model"]
    return (4 if wiring == "star" else 2) * count * eight_bit_bytes(elements)


def smoke(tmp_path, name: str, timeout: float) -> str:
    """Run ``benchmarks/<name>.py --smoke`` as a test swarm's peer starts (``helpers.run_script``); returns the
    results it wrote."""
    out = tmp_path / "RESULTS.md"
    result = run_script([ROOT / "benchmarks" / f"{name}.py", "--smoke", "--out", out], tmp_path / "smoke.log", timeout)
    assert result.returncode == 0, result.stdout[-3000:]
    return out.read_text()
