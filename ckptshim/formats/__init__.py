"""Checkpoint formats: recognise, list (metadata only) and read exactly the bytes asked for."""
