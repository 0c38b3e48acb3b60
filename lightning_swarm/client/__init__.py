"""The driving side of a peer: routing microbatches through the swarm and the remote pipeline module."""
