"""Executors: write a planned load into one array library's live tensors (see :mod:`.torch`)."""
