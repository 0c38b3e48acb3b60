"""``python -m lightning_swarm``: the same as the ``lightning-swarm`` command."""

from lightning_swarm.cli import entry_point

entry_point()
