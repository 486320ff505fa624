"""Checkpoints: sharded directories (every rank writes its own part) and full one-file checkpoints."""
