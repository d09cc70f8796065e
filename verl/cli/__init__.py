"""Command-line entry points (`verl doctor|train|bench`)."""
