"""Trainer utilities: metrics and checkpoints."""
