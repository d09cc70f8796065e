"""Trainer utilities: distributed setup, metrics, checkpoints."""
