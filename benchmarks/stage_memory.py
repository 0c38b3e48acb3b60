"""Where a stage peer's device memory goes: one stage server (examples/gpt.py's blocks) with its real stage
optimizer, driven in this process the way a trainer drives it (each batch's microbatches forward together, kept,
then backward together), without the network. After every batch it prints what PyTorch's allocator holds (allocated
and reserved, now and at their peak) next to what the stage should hold: parameters, gradients, gradient
accumulators, optimizer state, and the kept activations as the server counted them.

    python benchmarks/stage_memory.py                 # d_model 1024, 4 blocks, 8 x 512 tokens, 4 microbatches
    python benchmarks/stage_memory.py --d-model 2048 --delayed
    python benchmarks/stage_memory.py --precision bf16-mixed   # the Trainer's precision, as a stage server takes it
    SWARM_MEMORY_SNAPSHOT=/tmp/stage.pickle python benchmarks/stage_memory.py   # and a memory snapshot
    python benchmarks/stage_memory.py --smoke --device cpu    # a short check that the script works

Open a snapshot at https://pytorch.org/memory_viz.

`--precision` is the Trainer's, as the strategy gives it to a stage server: `-true` precisions convert the stage's
parameters (and the activations it takes) to their dtype; `-mixed` ones keep fp32 parameters and compute under
autocast.

On a CPU only the expected figures are printed (the allocator's are CUDA's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch
from hivemind.proto import runtime_pb2
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import Block  # noqa: E402
from harness import script_parser  # noqa: E402

from lightning_swarm import compression, protocol  # noqa: E402
from lightning_swarm.node import SwarmNode  # noqa: E402
from lightning_swarm.optimizer import swarm_optimizer  # noqa: E402
from lightning_swarm.precision import PRECISIONS, parameter_dtype  # noqa: E402
from lightning_swarm.server.stage_server import StageServer  # noqa: E402

MIB = 2**20


def main() -> None:
    parser = script_parser(__doc__, "a tiny stage and 3 batches")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4, help="blocks of the stage")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=512, help="tokens per sample")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--step-every", type=int, default=16, help="batches per optimizer step")
    parser.add_argument("--delayed", action="store_true", help="delayed updates (offloaded optimizer)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="32-true", help="the Trainer's")
    parser.add_argument("--codec", default="8bit")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="write the figures here (JSON)")
    a = parser.parse_args()
    if a.smoke:
        a.d_model, a.block_size, a.batches, a.step_every = 64, 16, 3, 2
    node = SwarmNode().start()
    try:
        expected, rows = measure(a, node)
    finally:
        node.shutdown()
    if a.out:
        Path(a.out).write_text(json.dumps(dict(args=vars(a), expected=expected, batches=rows), indent=1))


def measure(a: argparse.Namespace, node: SwarmNode) -> tuple[dict, list[dict]]:
    """One stage in ``a.precision`` trained ``a.batches`` batches: the bytes expected on the device, and the figures
    of each batch (printed as they come)."""
    device, precision, dtype = torch.device(a.device), a.precision, parameter_dtype(a.precision)
    torch.manual_seed(0)
    stage = nn.Sequential(*(Block(a.d_model, max(1, a.d_model // 64)) for _ in range(a.blocks))).to(device, dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    optimizer = swarm_optimizer(
        node.dht,
        f"stage_memory_{precision}",
        torch.optim.AdamW(stage.parameters(), lr=1e-4),
        a.batch_size * a.step_every,
        1.0,
        10.0,
        delayed=a.delayed,
    )
    server = StageServer(f"stage_memory_{precision}", 0, stage, device, optimizer=optimizer, precision=precision)
    micro = a.batch_size // a.microbatches
    expected = dict(
        parameters=param_bytes,
        gradients=param_bytes,  # .grad between a backward and zero_grad
        accumulators=param_bytes,  # hivemind's gradient accumulators, on the parameters' device
        optimizer_state=0 if a.delayed else 2 * param_bytes,  # AdamW's moments (delayed: on the host)
    )
    rows = []
    print(f"precision {precision}: stage parameters in {dtype}")
    try:
        for batch in range(a.batches):
            xs = [torch.randn(micro, a.block_size, a.d_model, dtype=dtype) for _ in range(a.microbatches)]
            keys = [f"{batch}.{i}" for i in range(a.microbatches)]
            asyncio.run(_together(server, "forward", [[x] for x in xs], keys, a.codec))
            kept = server.kept.nbytes
            asyncio.run(_together(server, "backward", [[torch.randn_like(x)] for x in xs], keys, a.codec))
            row = dict(batch=batch, kept_bytes=kept, kept_forwards_dropped=server.kept.dropped)
            row.update(server.info()["device_memory"])
            rows.append(row)
            print(
                f"batch {batch}: kept {kept / MIB:.0f} MiB (dropped so far {server.kept.dropped})"
                + "".join(f", {k} {v / MIB:.0f} MiB" for k, v in server.info()["device_memory"].items())
            )
    finally:
        server.shutdown()
        optimizer.shutdown()
    print(
        f"expected on the device ({precision}): "
        + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in expected.items())
        + f", plus the kept activations (max {max(r['kept_bytes'] for r in rows) / MIB:.0f} MiB) and one backward's "
        "workspace"
    )
    return expected, rows


async def _together(server: StageServer, kind: str, tensors: list, keys: list[str], codec: str) -> None:
    """The microbatches' requests at once, as a trainer's threads send them."""
    await asyncio.gather(*(server.answer(kind, _request(server, t, key, kind, codec)) for t, key in zip(tensors, keys)))


def _request(server: StageServer, tensors: list, key: str, kind: str, codec: str) -> runtime_pb2.ExpertRequest:
    metadata = {"codec": codec, "keep" if kind == "forward" else "kept": key}
    return runtime_pb2.ExpertRequest(
        uid=server.uid,
        tensors=[compression.serialize(t, codec) for t in tensors],
        metadata=protocol.encode_metadata(metadata),
    )


if __name__ == "__main__":
    main()
