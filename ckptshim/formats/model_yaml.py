"""A model description a producer keeps beside its weights as YAML: Megatron's
``run_config.yaml``, litgpt's ``model_config.yaml``. The head counts a decoder's layout depends
on are there; read with PyYAML's safe loader (plain data only), from a small regular file."""

from __future__ import annotations

from pathlib import Path

from ckptshim.formats.base import read_regular, reading

#: The most a model description may hold; real ones are a few KiB (a hostile one is not read whole).
MAX_BYTES = 1024 * 1024
#: litgpt's (``litgpt.utils.save_config``), beside ``lit_model.pth``.
LITGPT = "model_config.yaml"


def read_mapping(where: Path, doing: str) -> dict | None:
    """The mapping the YAML file ``where`` holds; ``None`` without the file, or for anything but
    a mapping."""
    if not where.is_file():
        return None
    import yaml  # transformers' own dependency: present wherever an HF target is

    with reading(where, doing):
        found = yaml.safe_load(read_regular(where, MAX_BYTES))
    return found if isinstance(found, dict) else None


def litgpt_config(path: Path) -> dict | None:
    """litgpt's ``model_config.yaml`` beside the file ``path`` (or in the folder ``path``)."""
    folder = path if path.is_dir() else path.parent
    return read_mapping(folder / LITGPT, "reading litgpt's model_config.yaml")
