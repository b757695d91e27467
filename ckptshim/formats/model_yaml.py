"""A model description a producer keeps beside its weights as YAML: Megatron's
``run_config.yaml``, litgpt's ``model_config.yaml``. The head counts a decoder's layout depends
on are there; read with PyYAML's safe loader (plain data only), from a small regular file."""

from __future__ import annotations

from pathlib import Path

from ckptshim.formats.base import reading
from ckptshim.storage import Location

#: The most a model description may hold; real ones are a few KiB (a hostile one is not read whole).
MAX_BYTES = 1024 * 1024
#: litgpt's (``litgpt.utils.save_config``), beside ``lit_model.pth``.
LITGPT = "model_config.yaml"


def read_mapping(where: Path | Location, doing: str) -> dict | None:
    """The mapping the YAML file (or object) ``where`` holds; ``None`` without the file, or for
    anything but a mapping. A file larger than :data:`MAX_BYTES` is refused unread."""
    where = Location.of(where)
    try:
        found = where.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if found.kind != "file":
        return None
    import yaml  # transformers' own dependency: present wherever an HF target is

    with reading(where, doing):
        data = yaml.safe_load(where.read_bytes(MAX_BYTES, found.size))
    return data if isinstance(data, dict) else None


def litgpt_config(path: Path | Location) -> dict | None:
    """litgpt's ``model_config.yaml`` beside the file ``path`` (or in the folder ``path``)."""
    where = Location.of(path)
    folder = where if where.is_dir() else where.parent
    return read_mapping(folder / LITGPT, "reading litgpt's model_config.yaml")
