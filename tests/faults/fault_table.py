"""The fault table: each supported format, which of its files to damage, and how far a damage
can be detected -- when the checkpoint is opened (``open``), when its completeness is checked
against its own metadata (``complete``), or only when its bytes are read (``read``).

``inspect`` (open + completeness check) is run for damage found at ``open`` or ``complete``,
``plan`` for damage found at ``open``, and every hook for all of them. An empty folder
(``listing``) is no checkpoint at all: ckptshim's own calls say so, while a hook leaves a call
on something that is not a checkpoint to the framework, whose own error stands. Damage that nothing can
notice -- a flipped byte in an uncompressed tensor, the unused tail of a file -- is not in the
table: without checksums no reader can tell, and pretending otherwise would test nothing.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from fault_damage import duplicate_first_json_member, middle_member_header, rewrite_msgpack, rewrite_safetensors_header, zip_member_offset

OPEN, COMPLETE, READ, LISTING = "open", "complete", "read", "listing"
_TRUNCATE = {"truncate_0": COMPLETE, "truncate_64": COMPLETE, "truncate_half": COMPLETE}


@dataclass(frozen=True)
class Format:
    """One row: ``fixture`` (under tests/fixtures, or ``built:<name>`` for one the suite saves
    with the real library first) is copied; ``load`` is what the calls are pointed at."""

    name: str
    fixture: str
    load: str
    data: str
    metadata: str
    stages: Mapping[str, str]
    hooks: tuple[str, ...]
    names_missing: str = ""
    escape_target: str = ""
    msgpack_file: str = ""
    target: str = ""  # the layout the hooks' destination has (default: the checkpoint's own)
    target_keys: tuple[str, ...] = field(default=())  # top-level keys of it to ask for
    step: int | None = None  # for a CheckpointManager root: the step to restore
    item: str = ""  # ... and the item folder in it that holds the arrays

    def flip_offset(self, path: Path) -> int:
        return 0

    def record_offset(self, path: Path) -> int:
        return 0

    def data_name(self, path: Path) -> str:
        """How a refusal names the damaged data file."""
        return path.name


# -- torch side -------------------------------------------------------------------------------


class Safetensors(Format):
    def flip_offset(self, path: Path) -> int:
        return 8  # the header's opening brace

    def _file(self, root: Path) -> Path:
        return root / self.metadata

    def retype(self, root: Path, what: str) -> str:
        path = self._file(root)

        def edit(header: dict) -> None:
            info = header[next(k for k in header if k != "__metadata__")]
            if what == "dtype":
                info["dtype"] = {"F32": "F64"}.get(info["dtype"], "F32")
            else:
                info["shape"] = [info["shape"][0] + 1, *info["shape"][1:]]
        rewrite_safetensors_header(path, edit)
        return path.name

    def duplicate(self, root: Path) -> str:
        path = self._file(root)
        rewrite_safetensors_header(path, text=duplicate_first_json_member)
        return path.name


class HFSharded(Safetensors):
    """A Hugging Face folder with ``model.safetensors.index.json``; header edits hit a shard."""

    def flip_offset(self, path: Path) -> int:
        return 0

    def _file(self, root: Path) -> Path:
        return root / self.data

    def duplicate(self, root: Path) -> str:
        path = root / self.metadata
        path.write_text(duplicate_first_json_member(path.read_text(), "weight_map"))
        return path.name

    def point_at(self, root: Path, reference: str) -> str:
        path = root / self.metadata
        index = json.loads(path.read_text())
        shard = Path(self.escape_target).name
        index["weight_map"] = {k: (reference if v == shard else v) for k, v in index["weight_map"].items()}
        path.write_text(json.dumps(index))
        return shard


class TorchZip(Format):
    """A ``torch.save`` archive; the metadata is its ``data.pkl``."""

    def flip_offset(self, path: Path) -> int:
        return zip_member_offset(path, "data.pkl")

    def record_offset(self, path: Path) -> int:
        """The local header of the archive's middle member."""
        return middle_member_header(path)

    def plant_global(self, root: Path, obj: Any) -> str:
        import torch

        path = root / self.metadata
        state = torch.load(path, weights_only=True)
        state["planted"] = obj
        torch.save(state, path)
        return path.name


class Dcp(Format):
    """A DCP folder; ``.metadata`` is edited through torch's own classes and pickled back."""

    def _edit(self, root: Path, edit) -> str:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(root / self.load)).read_metadata()
        edit(metadata)
        (root / self.metadata).write_bytes(pickle.dumps(metadata))
        return ".metadata"

    def retype(self, root: Path, what: str) -> str:
        import torch
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        def edit(metadata) -> None:
            meta = next(m for m in metadata.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))
            if what == "dtype":
                meta.properties.dtype = torch.float64 if meta.properties.dtype != torch.float64 else torch.float32
            else:
                meta.size = torch.Size([meta.size[0] + 1, *meta.size[1:]])
        return self._edit(root, edit)

    def point_at(self, root: Path, reference: str) -> str:
        import dataclasses

        def edit(metadata) -> None:
            metadata.storage_data = {k: dataclasses.replace(v, relative_path=reference)
                                     for k, v in metadata.storage_data.items()}
        self._edit(root, edit)
        return reference

    def plant_global(self, root: Path, obj: Any) -> str:
        def edit(metadata) -> None:
            metadata.planner_data[next(iter(metadata.planner_data))] = obj
        return self._edit(root, edit)


class NeoxPipeline(TorchZip):
    """DeepSpeed/GPT-NeoX: ``latest`` names the step folder; layer files are torch archives."""

    def flip_offset(self, path: Path) -> int:
        return 0 if path.name == "latest" else zip_member_offset(path, "data.pkl")

    def point_at(self, root: Path, reference: str) -> str:
        (root / "latest").write_text(reference)
        return "latest"


# -- JAX side ---------------------------------------------------------------------------------


class OrbaxTree(Format):
    """Orbax ``_METADATA`` (OCDBT layouts): JSON whose ``tree_metadata`` lists every leaf."""

    def data_name(self, path: Path) -> str:
        """Which of an OCDBT database's data files holds a value only tensorstore knows; a
        refusal names the database (and the key)."""
        return "OCDBT database"

    def duplicate(self, root: Path) -> str:
        path = root / self.metadata
        path.write_text(duplicate_first_json_member(path.read_text(), "tree_metadata"))
        return path.name


class Zarr(Format):
    """One zarr folder per array (per-leaf Orbax, PaxML, T5X legacy): ``.zarray`` edits."""

    def data_name(self, path: Path) -> str:
        return f"{path.parent.name}/{path.name}"

    def _zarray(self, root: Path) -> Path:
        return (root / self.data).parent / ".zarray"

    def retype(self, root: Path, what: str) -> str:
        path = self._zarray(root)
        meta = json.loads(path.read_text())
        if what == "dtype":
            meta["dtype"] = "<f8" if meta["dtype"] != "<f8" else "<f4"
        else:
            meta["shape"] = [meta["shape"][0] * 2, *meta["shape"][1:]]
            meta["chunks"] = list(meta["shape"])
        path.write_text(json.dumps(meta))
        # a shape is refused where it meets the target, by key: its last component but one
        return path.parent.name if what == "dtype" else path.parent.name.split(".")[-2]

    def duplicate(self, root: Path) -> str:
        path = self._zarray(root)
        text = path.read_text()
        path.write_text(text.replace('"dtype":', '"dtype":"<f8","dtype":', 1)
                        if '"dtype":' in text else text.replace('"dtype": ', '"dtype": "<f8", "dtype": ', 1))
        return path.parent.name


class OrbaxAggregateZarr(Zarr):
    """Orbax before ``_METADATA``: an aggregate msgpack of ``PLACEHOLDER://<folder>`` leaves."""

    def point_at(self, root: Path, reference: str) -> str:
        folder = Path(self.escape_target).name

        def edit(tree: Any) -> None:
            _replace_strings(tree, "PLACEHOLDER://" + folder, "PLACEHOLDER://" + reference)
        rewrite_msgpack(root / self.msgpack_file, edit)
        return reference


class T5xLegacy(Zarr):
    """T5X's msgpack of tensorstore specs, each naming its zarr folder relative to the step."""

    def point_at(self, root: Path, reference: str) -> str:
        folder = Path(self.escape_target).name

        def edit(tree: Any) -> None:
            _replace_strings(tree, folder + "/", reference + "/")
        rewrite_msgpack(root / self.msgpack_file, edit)
        return reference


class FlaxMsgpack(Format):
    """Flax msgpack (legacy file, or Orbax's aggregate with arrays inline): ndarray ext records."""

    def flip_offset(self, path: Path) -> int:
        return 1  # the first key's header: still msgpack, no longer a tree

    def record_offset(self, path: Path) -> int:
        return len(path.read_bytes()) // 2  # in the middle of the record stream

    def retype(self, root: Path, what: str) -> str:
        path = root / self.metadata

        def edit(tree: Any) -> None:
            parent, key = _first_ext(tree)
            shape, dtype, data = msgpack.unpackb(parent[key].data)
            if what == "dtype":
                dtype = "float64" if dtype != "float64" else "float32"
            else:
                shape = [shape[0] + 1, *shape[1:]]
            parent[key] = msgpack.ExtType(1, msgpack.packb([shape, dtype, data]))
        rewrite_msgpack(path, edit)
        return path.name

    def duplicate(self, root: Path) -> str:
        """The top-level map lists its first key twice (msgpack maps are key/value sequences)."""
        path = root / self.metadata
        data = path.read_bytes()
        tree = msgpack.unpackb(data, raw=False, strict_map_key=False)
        first = next(iter(tree))
        body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in tree.items())
        extra = msgpack.packb(first) + msgpack.packb(tree[first])
        count = len(tree) + 1
        head = bytes([0x80 | count]) if count < 16 else b"\xde" + struct.pack(">H", count)
        path.write_bytes(head + extra + body)
        return path.name


def _first_ext(tree: Any) -> tuple[dict, Any]:
    stack = [tree]
    while stack:
        node = stack.pop(0)
        for key, value in node.items():
            if isinstance(value, msgpack.ExtType):
                return node, key
            if isinstance(value, dict):
                stack.append(value)
    raise AssertionError("no array record in the msgpack tree")


def _replace_strings(tree: Any, old: str, new: str) -> None:
    for key, value in tree.items():
        if isinstance(value, dict):
            _replace_strings(value, old, new)
        elif isinstance(value, str) and old in value:
            tree[key] = value.replace(old, new)


# -- the table --------------------------------------------------------------------------------

_ESCAPES = {"escape_dotdot": OPEN, "escape_absolute": OPEN, "escape_symlink": OPEN}
_BOMBS = {"msgpack_bomb_count": OPEN, "msgpack_bomb_bytes": OPEN, "msgpack_bomb_shape": OPEN}
_TORCH = ("dcp",)
_STEP = "orbax_0.12.8_scanned/standard_checkpointer_scanned"
_MAXTEXT_1 = "maxtext_runs/tiny_unscanned/checkpoints/1/items"
_PAX_STATE = "state"
_PAX_VAR = "state/mdl_vars.params.lm.softmax.logits_ffn.linear.w"

FORMATS: tuple[Format, ...] = (
    Safetensors(
        "safetensors", "hf_gptneox_tf4.30.2/safetensors", "model.safetensors", "model.safetensors",
        "model.safetensors", {**_TRUNCATE, "flip_metadata": OPEN, "wrong_dtype": OPEN, "wrong_shape": OPEN},
        _TORCH),  # a tensor named twice alike is no damage: safetensors itself reads it (the last one)
    HFSharded(
        "hf-sharded", "built:hf_sharded", "", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        {**_TRUNCATE, "delete": COMPLETE, "flip_metadata": OPEN, "wrong_dtype": OPEN, "wrong_shape": OPEN,
         "duplicate_key": OPEN, **_ESCAPES, "empty_directory": LISTING}, _TORCH,
        escape_target="model-00002-of-00002.safetensors"),
    TorchZip(
        "torch-save", "torch_dcp_single/torch_save", "model.pt", "model.pt", "model.pt",
        {"truncate_64": OPEN, "truncate_half": OPEN, "zero_chunk": COMPLETE, "flip_metadata": OPEN,
         "forbidden_global": OPEN}, _TORCH),
    TorchZip(
        "hf-bin", "hf_gptneox_tf4.30.2/pytorch_model_bin", "", "pytorch_model.bin", "pytorch_model.bin",
        {"delete": OPEN, "truncate_64": OPEN, "truncate_half": OPEN, "zero_chunk": COMPLETE, "flip_metadata": OPEN,
         "forbidden_global": OPEN, "empty_directory": LISTING}, _TORCH),
    Dcp(
        "dcp", "torch_dcp_single/dcp_plain", "", "__0_0.distcp", ".metadata",
        {**_TRUNCATE, "delete": COMPLETE, "zero_chunk": READ, "flip_metadata": OPEN, "wrong_dtype": READ,
         "wrong_shape": COMPLETE, "escape_dotdot": OPEN, "escape_absolute": OPEN, "forbidden_global": OPEN,
         "empty_directory": LISTING}, _TORCH, escape_target="__0_0.distcp"),
    OrbaxTree(
        "orbax-ocdbt", _STEP, "", "ocdbt.process_0/d/5b61ef96a1d7f22bd76c93a4341b0f01", "_METADATA",
        {**_TRUNCATE, "delete": COMPLETE, "zero_chunk": READ, "bad_compression": READ, "flip_metadata": OPEN,
         "duplicate_key": OPEN, "empty_directory": LISTING}, ("orbax",),
        target="orbax_0.2.3_unscanned/pytree_checkpointer"),
    OrbaxTree(
        "maxtext-ocdbt", _MAXTEXT_1, "", "ocdbt.process_0/d/dc775d40b3bf42803307423c42910092", "_METADATA",
        {**_TRUNCATE, "delete": COMPLETE, "zero_chunk": READ, "bad_compression": READ, "flip_metadata": OPEN,
         "duplicate_key": OPEN}, ("orbax",),
        target="maxtext_runs/tiny_scanned/checkpoints/1/items", target_keys=("params",)),
    OrbaxTree(
        "orbax-manager-root", "maxtext_runs/tiny_unscanned/checkpoints", "",
        "1/items/ocdbt.process_0/d/dc775d40b3bf42803307423c42910092", "1/items/_METADATA",
        {**_TRUNCATE, "delete": COMPLETE, "zero_chunk": READ, "bad_compression": READ, "flip_metadata": OPEN,
         "duplicate_key": OPEN}, ("manager",),
        target="maxtext_runs/tiny_scanned/checkpoints/1/items", target_keys=("params",), step=1, item="1/items"),
    OrbaxAggregateZarr(
        "orbax-per-leaf-zarr", "orbax_0.2.3_unscanned/pytree_checkpointer", "",
        "params.decoder.logits_dense.kernel/0.0", "params.decoder.logits_dense.kernel/.zarray",
        {"delete": COMPLETE, "truncate_0": READ, "truncate_64": READ, "truncate_half": READ, "zero_chunk": READ,
         "bad_compression": READ, "flip_metadata": OPEN, "wrong_dtype": READ, "wrong_shape": READ,
         "duplicate_key": OPEN, **_ESCAPES, **_BOMBS, "empty_directory": LISTING}, ("orbax", "pytree"),
        target=_STEP, names_missing="params.decoder.logits_dense.kernel",
        escape_target="params.decoder.logits_dense.kernel", msgpack_file="checkpoint"),
    FlaxMsgpack(
        "orbax-aggregate-msgpack", "flax_0.6.11_legacy_msgpack/flax_default_orbax_backend/checkpoint_2", "",
        "checkpoint", "checkpoint",
        {"truncate_64": OPEN, "truncate_half": OPEN, "zero_chunk": OPEN, "flip_metadata": OPEN,
         "wrong_dtype": OPEN, "wrong_shape": OPEN, "duplicate_key": OPEN, **_BOMBS, "empty_directory": LISTING},
        ("orbax",), msgpack_file="checkpoint"),
    FlaxMsgpack(
        "flax-legacy-msgpack", "flax_0.6.11_legacy_msgpack/legacy_msgpack", "checkpoint_2",
        "checkpoint_2", "checkpoint_2",
        {"truncate_64": OPEN, "truncate_half": OPEN, "zero_chunk": OPEN, "flip_metadata": OPEN,
         "wrong_dtype": OPEN, "wrong_shape": OPEN, "duplicate_key": OPEN, **_BOMBS}, ("orbax", "flax"),
        msgpack_file="checkpoint_2"),
    T5xLegacy(
        "t5x-legacy", "t5x_tiny_decoder/legacy_checkpointer/checkpoint_0", "",
        "target.decoder.token_embedder.embedding/0.0", "target.decoder.token_embedder.embedding/.zarray",
        {"delete": COMPLETE, "truncate_0": READ, "truncate_64": READ, "truncate_half": READ, "zero_chunk": READ,
         "bad_compression": READ, "flip_metadata": OPEN, "wrong_dtype": READ, "wrong_shape": READ,
         "duplicate_key": OPEN, **_ESCAPES, **_BOMBS}, ("orbax",),
        names_missing="target.decoder.token_embedder.embedding",
        escape_target="target.decoder.token_embedder.embedding", msgpack_file="checkpoint"),
    OrbaxTree(
        "t5x-orbax-era", "t5x_tiny_decoder/orbax_checkpoint_manager/checkpoint_0", "",
        "state/ocdbt.process_0/d/4345960922ecbf6f6214af8f183bf189", "state/_METADATA",
        {**_TRUNCATE, "delete": COMPLETE, "zero_chunk": READ, "bad_compression": READ, "flip_metadata": OPEN,
         "duplicate_key": OPEN}, ("t5x",)),
    Zarr(
        "paxml-tensorstore", "paxml_runs/TinySpmdRepeat/checkpoints/checkpoint_00000000", _PAX_STATE,
        _PAX_VAR + "/0.0", _PAX_VAR + "/.zarray",
        {"delete": COMPLETE, "truncate_0": READ, "truncate_64": READ, "truncate_half": READ, "zero_chunk": READ,
         "bad_compression": READ, "flip_metadata": OPEN, "wrong_dtype": READ, "wrong_shape": READ,
         "duplicate_key": OPEN}, ("orbax",), names_missing="mdl_vars.params.lm.softmax.logits_ffn.linear.w"),
    NeoxPipeline(
        "neox-deepspeed", "neox_deepspeed/pp1_mp1/checkpoint", "", "global_step0/layer_03-model_00-model_states.pt",
        "global_step0/layer_03-model_00-model_states.pt",
        {"delete": COMPLETE, "truncate_0": OPEN, "truncate_64": OPEN, "truncate_half": OPEN, "flip_metadata": OPEN,
         "forbidden_global": OPEN, **_ESCAPES}, ("deepspeed",), escape_target="global_step0"),
    NeoxPipeline(
        "neox-deepspeed-latest", "neox_deepspeed/pp1_mp1/checkpoint", "", "latest", "latest",
        {"flip_metadata": OPEN}, ("deepspeed",)),
)

BY_NAME = {fmt.name: fmt for fmt in FORMATS}
