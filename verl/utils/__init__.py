"""Trainer utilities: the local tiny model, distributed setup, metrics, checkpoints."""
