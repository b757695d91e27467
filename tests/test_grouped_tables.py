"""Rows that differ only in a layer index are one row, wherever they stand in the table: the INFO
table of a load, and ``inspect``'s listing.

A GPT-NeoX pipeline checkpoint (``sequential.{2..L+1}`` layer files, keys as
``convert_neox_to_hf.py`` reads them -- the demo's NeoX story) loaded into transformers'
``GPTNeoXForCausalLM``: its table has the same rows for 2 layers and for 64 (a layer ``i`` and the
pipeline stage ``i + 2`` it was saved as move in step). A Megatron-Core folder's ``inspect`` lists
``linear_fc1`` and ``linear_fc2`` once each over every layer, though their shapes differ.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckptshim.keytext import compress, group_rows
from support.fixtures import FIXTURES
from support.markers import QUIET
from support.processes import environment

pytestmark = QUIET
NEOX = FIXTURES / "neox_deepspeed" / "pp1_mp1"

#: The demo's NeoX story with ``L`` layers, for each ``L`` given: GPT-NeoX's names (what
#: convert_neox_to_hf.py reads, transcribed in the fixture's hf_mapping.json) of a model's own
#: values, loaded with the INFO table. One process for every ``L`` (torch and transformers imported
#: once); a ``LAYERS L`` line on stderr opens each load's output.
NEOX_LOAD = """
import json, sys
import ckptshim, torch, transformers
fixture, counts = sys.argv[1], [int(arg) for arg in sys.argv[2:]]
mapping = json.load(open(fixture + "/hf_mapping.json"))["hf_dirs"]["hf"]["mapping"]
loaded = []
for layers in counts:
    print(f"LAYERS {layers}", file=sys.stderr, flush=True)
    config = transformers.AutoConfig.from_pretrained(fixture + "/hf", num_hidden_layers=layers)
    torch.manual_seed(0)
    values = transformers.GPTNeoXForCausalLM(config).state_dict()
    values["embed_out.weight"] = values["lm_head.weight"]  # the mapping's (transformers 4) name of the head
    saved = {}
    for entry in mapping:
        stage = entry["neox_layer_file"]
        if stage == 2:  # the first layer's keys, for every layer
            for i in range(layers):
                saved[f"sequential.{i + 2}.{entry['neox_key']}"] = values[entry["hf_key"].replace(".layers.0.", f".layers.{i}.")]
        elif stage in (0, 5, 6):  # embedding; final norm and output after the layers
            saved[f"sequential.{stage if stage == 0 else layers + stage - 2}.{entry['neox_key']}"] = values[entry["hf_key"]]
    model = transformers.GPTNeoXForCausalLM(config)
    model.load_state_dict(saved)
    loaded.append(all(torch.equal(v, values[k]) for k, v in model.state_dict().items()))
print(json.dumps(loaded))
"""


def _info_tables(*counts: int) -> list[list[str]]:
    """The INFO table of each load, in the order of ``counts``."""
    run = subprocess.run([sys.executable, "-c", NEOX_LOAD, str(NEOX), *map(str, counts)], capture_output=True,
                         text=True, env=environment({"CKPTSHIM_LOG": "info"}), timeout=240)
    assert run.returncode == 0 and json.loads(run.stdout.strip().splitlines()[-1]) == [True] * len(counts), \
        run.stderr[-3000:]
    tables = []
    for layers, output in zip(counts, run.stderr.split("LAYERS ")[1:], strict=True):
        lines = output.splitlines()
        assert lines[0] == str(layers), lines[0]
        start = next(i for i, line in enumerate(lines) if line.split()[:5] == ["Key", "|", "Status", "|", "Details"])
        tables.append([" ".join(line.split()) for line in lines[start + 2:] if line.startswith("  ")])
    return tables


def test_a_neox_load_table_of_64_layers_is_as_long_as_one_of_2():
    two, sixty_four = _info_tables(2, 64)
    assert two and len(sixty_four) == len(two), "\n".join(sixty_four)
    assert "gpt_neox.layers.{0..1}.attention.dense.weight | renamed | from sequential.{2..3}.attention.dense.weight" in two
    assert "gpt_neox.layers.{0..63}.attention.dense.weight | renamed | from sequential.{2..65}.attention.dense.weight" \
        in sixty_four
    assert not any(".layers.0." in row or ".layers.1." in row for row in two), two


def test_rows_apart_group_and_rows_in_step_by_an_offset_too():
    rows = [(f"layers.{i}.mlp.fc{j}.weight", "float32", str((20, 12) if j == 1 else (12, 20)), "960 B")
            for i in range(4) for j in (1, 2)]  # interleaved, and fc1/fc2 shapes differ
    assert [cells for cells, _ in group_rows(rows)] == [("layers.{0..3}.mlp.fc1.weight", "float32", "(20, 12)", "960 B"),
                                                        ("layers.{0..3}.mlp.fc2.weight", "float32", "(12, 20)", "960 B")]
    assert compress([f"sequential.{i + 2}.w -> layers.{i}.w" for i in range(64)]) == \
        ["sequential.{2..65}.w -> layers.{0..63}.w"]
    # numbers that do not move in step are not made to look as if they did
    assert compress(["x.0 -> y.5", "x.1 -> y.6", "x.2 -> y.9"]) == ["x.0 -> y.5", "x.1 -> y.6", "x.2 -> y.9"]


@pytest.mark.parametrize("folder", ["torch_dist/tp1_pp1"])
def test_inspect_of_a_megatron_core_folder_groups_every_layer(folder, capsys):
    from ckptshim import cli

    cli.main(["inspect", str(FIXTURES / "megatron_core" / folder)])
    shown = capsys.readouterr().out
    assert "decoder.layers.{0..3}.mlp.linear_fc1.weight" in shown and "decoder.layers.{0..3}.mlp.linear_fc2.weight" in shown
    assert "decoder.layers.0." not in shown, shown
