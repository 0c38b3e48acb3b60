"""The serving side of a peer: the stage server and the optimizer that trains its stage."""
