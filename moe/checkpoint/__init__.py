"""Checkpoints: tensor codecs, manifests, tiers of experts, the store that writes, verifies,
retains and restores them, and the sharded (DCP) writer and reader. Imports no model code."""
