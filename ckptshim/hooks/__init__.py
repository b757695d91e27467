"""Adapters at the frameworks' load functions; see :mod:`ckptshim.hooks.registry`."""
