"""LocalSwarm's peers, in-process: what a peer's log shows."""

from __future__ import annotations

from lightning_swarm.launch import Peer


def test_peer_log_drops_torch_kernel_listings_printed_or_escaped_in_a_remote_error(tmp_path):
    """A dispatcher error's kernel list (hundreds of lines) must not push the error itself out of a log's tail."""
    listing = (
        "CPU: registered at /a/b.cpp:1 [kernel]\nAutogradCPU: fallthrough registered at /c.cpp:6 [backend fallback]\n"
    )
    escaped = listing.replace("\n", "\\n")
    log = tmp_path / "peer.log"
    log.write_text(
        f"Traceback\nNotImplementedError: Could not run 'x::y'.\n{listing}P2PHandlerError('z.\\n{escaped}')\nend\n"
    )
    peer = Peer("p", None, log, tmp_path / "p.addr")
    assert peer.log() == "Traceback\nNotImplementedError: Could not run 'x::y'.\nP2PHandlerError('z.\\n')\nend\n"
