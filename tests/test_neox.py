"""GPT-NeoX <-> Hugging Face GPT-NeoX, without convert scripts.

The NeoX side is a mirror of GPT-NeoX's own pipeline layers (``megatron/model``: class names,
attribute names, and the rotary ``inv_freq`` buffer registered with
``persistent=rotary_save_freqs_buffer``), sized for one tensor-parallel rank, with the forward
pass NeoX runs at tensor-parallel degree 1 (parallel residual, partial rotary, exact GELU).
Fixtures: ``hf_gptneox_tf4.30.2`` (legacy buffers saved), ``hf_gptneox_tf5_resaved`` (none), and
NeoX's own pipeline checkpoints in ``neox_deepspeed`` with NeoX's reference logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckptshim  # noqa: F401  (attaches the hooks)
from ckptshim.errors import CorruptCheckpointError, PlanError
from ckptshim.formats import tensor_parallel
from ckptshim.formats.detect import open_checkpoint
from ckptshim.loading.deepspeed import layer_state_dicts
from ckptshim.inventory import join_key
from ckptshim.layouts import neox as neox_layout
from ckptshim.rules.profiles import neox
from support.fixtures import FIXTURES, copy_fixture
from support.processes import environment, worker

NEOX = FIXTURES / "neox_deepspeed"
HF4 = FIXTURES / "hf_gptneox_tf4.30.2"
HF5 = FIXTURES / "hf_gptneox_tf5_resaved"
HIDDEN, HEADS, LAYERS, VOCAB, ROTARY_PCT = 64, 4, 2, 256, 0.25


# -- a mirror of GPT-NeoX's pipeline layers (megatron/model/{word_embeddings,transformer}.py) --

class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000, save_inv_freqs: bool = False) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=save_inv_freqs)


class ParallelSelfAttention(nn.Module):
    def __init__(self, tp: int, save_inv_freqs: bool) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN // tp)
        self.rotary_emb = RotaryEmbedding(int(HIDDEN // HEADS * ROTARY_PCT), save_inv_freqs=save_inv_freqs)
        self.dense = nn.Linear(HIDDEN // tp, HIDDEN)


class ParallelMLP(nn.Module):
    def __init__(self, tp: int, legacy: bool = False) -> None:
        super().__init__()
        up, down = ("dense_h_to_4h", "dense_4h_to_h") if legacy else ("linear1", "linear2")
        setattr(self, up, nn.Linear(HIDDEN, 4 * HIDDEN // tp))
        setattr(self, down, nn.Linear(4 * HIDDEN // tp, HIDDEN))


class ParallelTransformerLayerPipe(nn.Module):
    def __init__(self, tp: int = 1, save_inv_freqs: bool = False, legacy: bool = False) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.attention = ParallelSelfAttention(tp, save_inv_freqs)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = ParallelMLP(tp, legacy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._attend(self.input_layernorm(x)) + self._mlp(self.post_attention_layernorm(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self.mlp, n, None) for n in ("linear1", "linear2"))
        up, down = up or self.mlp.dense_h_to_4h, down or self.mlp.dense_4h_to_h
        return down(F.gelu(up(x)))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head = HIDDEN // HEADS
        q, k, v = self.attention.query_key_value(x).view(batch, seq, HEADS, 3 * head).split(head, dim=-1)
        inv_freq = self.attention.rotary_emb.inv_freq
        rot = 2 * inv_freq.numel()
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]
        q, k = (torch.cat((_rotate(t[..., :rot], emb), t[..., rot:]), dim=-1) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head)
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, HIDDEN)
        return self.attention.dense(out)


def _rotate(t: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * emb.cos() + rotated * emb.sin()


class EmbeddingPipe(nn.Module):
    def __init__(self, tp: int = 1, vocab: int = VOCAB) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab // tp, HIDDEN)


class NormPipe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)


class ParallelLinearPipe(nn.Module):
    def __init__(self, tp: int = 1, vocab: int = VOCAB) -> None:
        super().__init__()
        self.final_linear = nn.Linear(HIDDEN, vocab // tp, bias=False)


class Stateless(nn.Module):
    """Pipeline indices 1 and L+2 are functions in NeoX (no state, no layer file)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def neox_layers(tp: int = 1, save_inv_freqs: bool = False, legacy: bool = False,
                vocab: int = VOCAB) -> dict[int, nn.Module]:
    """GPT2ModelPipe's layers by pipeline index (what ``PipelineModule.forward_funcs`` holds)."""
    layers: dict[int, nn.Module] = {0: EmbeddingPipe(tp, vocab), 1: Stateless()}
    for i in range(LAYERS):
        layers[neox_layout.FIRST_BLOCK + i] = ParallelTransformerLayerPipe(tp, save_inv_freqs, legacy)
    layers[LAYERS + 2] = Stateless()
    layers[neox_layout.final_norm_index(LAYERS)] = NormPipe()
    layers[neox_layout.output_index(LAYERS)] = ParallelLinearPipe(tp, vocab)
    return layers


class NeoXSequential(nn.Module):
    """NeoX's ``to_sequential()`` model: the same layers under ``sequential.<index>``."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.sequential = nn.Sequential(*neox_layers(**options).values())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.sequential[0].word_embeddings(tokens)
        for layer in self.sequential[neox_layout.FIRST_BLOCK:neox_layout.FIRST_BLOCK + LAYERS]:
            x = layer(x)
        x = self.sequential[neox_layout.final_norm_index(LAYERS)].norm(x)
        return self.sequential[neox_layout.output_index(LAYERS)].final_linear(x)


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".bin":
        return torch.load(path, weights_only=True)
    from safetensors.torch import load_file

    return load_file(path)


HF_FILES = {
    "tf4.30.2-bin": (HF4 / "pytorch_model_bin" / "pytorch_model.bin", HF4 / "ref_logits.npy"),
    "tf4.30.2-safetensors": (HF4 / "safetensors" / "model.safetensors", HF4 / "ref_logits.npy"),
    "tf5-resaved": (HF5 / "save_pretrained_default" / "model.safetensors", HF5 / "ref_logits_tf5.npy"),
}


@pytest.mark.parametrize("save_inv_freqs", [False, True], ids=["inv_freq-unsaved", "inv_freq-saved"])
@pytest.mark.parametrize("name", sorted(HF_FILES))
def test_hf_weights_load_strictly_into_neox_layers(name: str, save_inv_freqs: bool) -> None:
    weights, logits = HF_FILES[name]
    model = NeoXSequential(save_inv_freqs=save_inv_freqs).eval()
    result = model.load_state_dict(_hf_state_dict(weights), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    tokens = torch.from_numpy(np.load(HF4 / "ref_input_ids.npy"))
    with torch.no_grad():
        out = model(tokens)
    np.testing.assert_allclose(out.numpy(), np.load(logits), atol=1e-5, rtol=0)


def _neox_state_dict(variant: str) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(NEOX / variant / "checkpoint")
    return {join_key(key): torch.from_numpy(np.array(checkpoint.read(entry)))
            for key, entry in checkpoint.inventory.items()}


def _reference(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.load(NEOX / variant / "reference_logits_neox.pt", weights_only=True)
    return ref["tokens"], ref["logits"]


@pytest.mark.parametrize("variant", ["pp1_mp1", "pp2_mp2", "old_pp1_mp1"])
def test_neox_pipeline_checkpoint_loads_into_hf_gptneox(variant: str) -> None:
    import transformers

    config = transformers.AutoConfig.from_pretrained(NEOX / variant / "hf")
    model = transformers.GPTNeoXForCausalLM(config).eval()
    result = model.load_state_dict(_neox_state_dict(variant), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    tokens, expected = _reference(variant)
    with torch.no_grad():
        out = model(tokens).logits
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["pp1_mp1", "pp2_mp2", "old_pp1_mp1"])
def test_neox_checkpoint_any_degree_into_neox_layers_at_degree_1(variant: str) -> None:
    """Per-layer loads as ``load_state_dir`` makes them: pp2_mp2 merges 2 -> 1, old names map."""
    model = NeoXSequential().eval()
    layers = dict(enumerate(model.sequential))
    states = layer_state_dicts(open_checkpoint(NEOX / variant / "checkpoint"), layers, 0, 1)
    for index, layer in layers.items():
        layer.load_state_dict(states.get(index, {}), strict=True)
    tokens, expected = _reference(variant)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=0)


def test_tensor_parallel_1_to_2_to_1_is_bit_exact() -> None:
    checkpoint = open_checkpoint(NEOX / "pp1_mp1" / "checkpoint")
    ranks = [neox_layers(tp=2) for _ in range(2)]
    states = [layer_state_dicts(checkpoint, ranks[r], r, 2) for r in range(2)]
    for key, entry in checkpoint.inventory.items():
        index, name = int(key[1]), join_key(key[2:])
        shards = [states[r][index][name].numpy() for r in range(2)]
        assert shards[0].shape == tuple(ranks[0][index].state_dict()[name].shape)
        merged = tensor_parallel.merge(key, shards, entry.dtype, name)
        assert merged.tobytes() == np.ascontiguousarray(checkpoint.read(entry)).tobytes(), name


def test_tensor_parallel_2_to_1_to_2_is_bit_exact() -> None:
    checkpoint = open_checkpoint(NEOX / "pp2_mp2" / "checkpoint")
    full = NeoXSequential()
    merged = layer_state_dicts(checkpoint, dict(enumerate(full.sequential)), 0, 1)
    for key, entry in checkpoint.inventory.items():
        value = merged[int(key[1])][join_key(key[2:])].numpy()
        for rank in range(2):
            shard = tensor_parallel.split(key, value, rank, 2, entry.dtype, "")
            assert shard.tobytes() == np.ascontiguousarray(checkpoint.read_shard(key, rank)).tobytes()


def test_hf_pythia_into_tensor_parallel_neox_with_vocab_padding() -> None:
    """HF (vocab 256) into NeoX at degree 2 whose padded vocab is 512: rows padded with zeros."""
    checkpoint = open_checkpoint(HF5 / "save_pretrained_default")
    padded = 512  # NeoX's _vocab_size_with_padding of VOCAB + 1 at 2 ranks: the next multiple of 128 x 2
    for rank in range(2):
        layers = neox_layers(tp=2, vocab=padded)
        states = layer_state_dicts(checkpoint, layers, rank, 2)
        for index, layer in layers.items():
            layer.load_state_dict(states.get(index, {}), strict=True)
        embed = layers[0].word_embeddings.weight.detach().numpy()
        hf = np.array(checkpoint.read(checkpoint.inventory[("gpt_neox", "embed_in", "weight")]))
        np.testing.assert_array_equal(embed, np.concatenate([hf, np.zeros_like(hf)])[rank * 256:(rank + 1) * 256])


def test_missing_tensor_is_refused_before_any_write(tmp_path: Path) -> None:
    import shutil

    copy_fixture("neox_deepspeed/pp1_mp1/checkpoint", tmp_path, "ckpt")
    layers = neox_layers()
    before = {i: {k: v.clone() for k, v in m.state_dict().items()} for i, m in layers.items()}
    (tmp_path / "ckpt" / "global_step0" / "layer_03-model_00-model_states.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match="layer_03-model_00-model_states.pt: missing"):
        layer_state_dicts(open_checkpoint(tmp_path / "ckpt"), layers, 0, 1)
    shutil.copy(NEOX / "pp1_mp1/checkpoint/global_step0/layer_03-model_00-model_states.pt",
                tmp_path / "ckpt" / "global_step0")
    # no output-layer file reads as a tied model; a model with its own output layer is refused
    (tmp_path / "ckpt" / "global_step0" / "layer_06-model_00-model_states.pt").unlink()
    with pytest.raises(PlanError, match="sequential.6.final_linear.weight"):
        layer_state_dicts(open_checkpoint(tmp_path / "ckpt"), layers, 0, 1)
    for index, layer in layers.items():
        for k, v in layer.state_dict().items():
            assert torch.equal(v, before[index][k])


def test_a_degree_that_cuts_a_head_is_refused_by_the_head_count() -> None:
    """4 heads of 16 at degree 8: every tensor's rows divide evenly (3 x 64 / 8 = 24), but a
    rank's 24 rows of the per-head query_key_value would be half a head. The head count is
    config.json's, not the shapes'."""
    checkpoint = open_checkpoint(HF5 / "save_pretrained_default")
    with pytest.raises(PlanError, match="4 heads do not divide over 8 tensor-parallel ranks"):
        layer_state_dicts(checkpoint, neox_layers(tp=8), 0, 8)


def test_uneven_tensor_parallel_split_is_refused() -> None:
    checkpoint = open_checkpoint(NEOX / "pp1_mp1" / "checkpoint")
    with pytest.raises(PlanError, match="do not split evenly"):
        tensor_parallel.split(("sequential", "0", "word_embeddings", "weight"), np.zeros((5, 3)), 0, 2, "float32", "x")
    assert checkpoint.tp_degree == 1


def test_profile_matches_neox_converter_mapping() -> None:
    """Every NeoX -> HF name in the fixture's hf_mapping.json (NeoX's converter) is our alias."""
    mapping = json.loads((NEOX / "pp2_mp2" / "hf_mapping.json").read_text())["hf_dirs"]["hf"]["mapping"]
    for row in mapping:
        neox_key = ("sequential", str(row["neox_layer_file"])) + tuple(row["neox_key"].split("."))
        hf_key = tuple(row["hf_key"].split("."))
        assert neox.pipeline_key(hf_key, neox.HF, LAYERS) == neox_key[:2] + tuple(
            {"linear1": "dense_h_to_4h", "linear2": "dense_4h_to_h"}.get(p, p) for p in neox_key[2:]) \
            or neox.pipeline_key(hf_key, neox.HF, LAYERS) == neox_key
        rule = {"cat_dim0": ("concat", 0), "cat_dim1": ("concat", 1), "sum_over_mp": ("sum", None),
                "mean_over_mp": ("replicated", None)}.get(row["rule"])
        if rule is not None:
            merge, _ = neox_layout.spread(neox_key).merge(neox_layout.shard_keys(neox_key, 2), neox_key, (4, 4))
            assert (merge.kind, getattr(merge, "axis", None)) == rule, row


def test_real_deepspeed_load_state_dir(tmp_path: Path) -> None:
    """DeepSpeed 0.19.8's own PipelineModule.load_state_dir, patched on `import deepspeed`:
    HF weights (both transformers eras), NeoX at another tensor-parallel degree and with older
    names load into NeoX's layers; a matching NeoX checkpoint is left to DeepSpeed; a missing
    layer file is refused with its name."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    broken = copy_fixture("neox_deepspeed/pp1_mp1/checkpoint/global_step0", tmp_path, "broken")
    (broken / "layer_03-model_00-model_states.pt").unlink()
    hf_tokens = str(HF4 / "ref_input_ids.npy")
    jobs, expected = [], []
    for name, source, logits, options in (
            ("tf4", HF4 / "pytorch_model_bin", HF4 / "ref_logits.npy", {"save_inv_freqs": True}),
            ("tf5", HF5 / "save_pretrained_default", HF5 / "ref_logits_tf5.npy", {})):
        jobs.append({"source": str(source), "tokens": hf_tokens, "out": str(tmp_path / f"{name}.npy"),
                     "options": options})
        expected.append((np.load(logits), True))
    for variant, shimmed in (("pp1_mp1", False), ("pp2_mp2", True), ("old_pp1_mp1", True)):
        tokens, logits = _reference(variant)
        np.save(tmp_path / f"{variant}_tokens.npy", tokens.numpy())
        jobs.append({"source": str(NEOX / variant / "checkpoint" / "global_step0"),
                     "tokens": str(tmp_path / f"{variant}_tokens.npy"),
                     "out": str(tmp_path / f"{variant}.npy"), "options": {}})
        expected.append((logits.numpy(), shimmed))
    jobs.append({"source": str(broken), "tokens": hf_tokens, "out": "", "options": {}})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run = subprocess.run([sys.executable, worker("deepspeed_worker.py"),
                          str(tmp_path / "jobs.json"), "0", "1", _free_port()],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment())
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["patched"]
    for job, outcome, (logits, shimmed) in zip(jobs, result["jobs"], expected):
        assert outcome == {"shimmed": shimmed}, (job["source"], outcome)
        np.testing.assert_allclose(np.load(job["out"]), logits, atol=1e-5, rtol=0, err_msg=job["source"])
    assert "layer_03-model_00-model_states.pt: missing" in result["jobs"][-1]["error"]


def test_each_pipeline_stage_and_rank_gets_exactly_its_files_shards() -> None:
    """pp2_mp2 loaded stage by stage, rank by rank, equals its own layer files bit for bit; HF
    weights load into a later stage alone (other stages' tensors are not its business)."""
    checkpoint = open_checkpoint(NEOX / "pp2_mp2" / "checkpoint")
    for rank in range(2):
        layers = neox_layers(tp=2)
        for stage in ((0, 1, 2), (3, 4, 5, 6)):
            states = layer_state_dicts(checkpoint, {i: layers[i] for i in stage}, rank, 2)
            assert set(states) == {i for i in stage if not isinstance(layers[i], Stateless)}
            for index, state in states.items():
                assert state.keys() == layers[index].state_dict().keys()
                for name, value in state.items():
                    key = ("sequential", str(index)) + tuple(name.split("."))
                    assert value.numpy().tobytes() == np.ascontiguousarray(checkpoint.read_shard(key, rank)).tobytes()
    hf = open_checkpoint(HF4 / "safetensors")
    layers = neox_layers(save_inv_freqs=True)
    late = {i: layers[i] for i in (3, 4, 5, 6)}
    states = layer_state_dicts(hf, late, 0, 1)
    for index in (3, 5, 6):
        late[index].load_state_dict(states[index], strict=True)
    inv_freq = hf.read(hf.inventory[("gpt_neox", "layers", "1", "attention", "rotary_emb", "inv_freq")])
    np.testing.assert_array_equal(late[3].attention.rotary_emb.inv_freq.numpy(), inv_freq)


def test_other_pipeline_models_are_left_to_deepspeed(tmp_path: Path) -> None:
    """A Megatron-DeepSpeed-style layer file (``self_attention``) is not NeoX: the hook stays out."""
    from ckptshim.loading.deepspeed import is_neox

    step = tmp_path / "global_step1"
    step.mkdir()
    torch.save({"self_attention.query_key_value.weight": torch.zeros(6, 2)},
               step / "layer_02-model_00-model_states.pt")
    torch.save({"word_embeddings.weight": torch.zeros(4, 2)}, step / "layer_00-model_00-model_states.pt")
    assert not is_neox(open_checkpoint(step))
    assert is_neox(open_checkpoint(NEOX / "old_pp1_mp1" / "checkpoint"))
    assert is_neox(open_checkpoint(HF5 / "save_pretrained_default"))


def test_cutting_vocab_rows_warns_and_strict_refuses(monkeypatch, caplog) -> None:
    checkpoint = open_checkpoint(HF5 / "save_pretrained_default")
    layers = neox_layers(vocab=128)
    with caplog.at_level("WARNING", logger="ckptshim"):
        states = layer_state_dicts(checkpoint, layers, 0, 1)
    assert "256 vocab rows but the model's padded vocab is 128" in caplog.text
    assert states[0]["word_embeddings.weight"].shape == (128, HIDDEN)
    monkeypatch.setenv("CKPTSHIM_STRICT", "1")
    with pytest.raises(PlanError, match="CKPTSHIM_STRICT=1 refuses"):
        layer_state_dicts(checkpoint, neox_layers(vocab=128), 0, 1)


def test_real_deepspeed_load_state_dir_at_tensor_parallel_degree_2(tmp_path: Path) -> None:
    """Two gloo processes, DeepSpeed's own grid (num_mp=2): NeoX at degree 1 is split 1 -> 2 and
    HF weights are split per rank; NeoX at degree 2 is DeepSpeed's own load. Each rank ends
    up with exactly its slice."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    sources = {"pp1_mp1": NEOX / "pp1_mp1/checkpoint/global_step0",
               "pp2_mp2": NEOX / "pp2_mp2/checkpoint/global_step0",
               "hf": HF5 / "save_pretrained_default"}
    results = []
    for rank in range(2):
        jobs = [{"source": str(path), "tokens": "", "out": str(tmp_path / f"{name}_{rank}.npz"),
                 "options": {}} for name, path in sources.items()]
        (tmp_path / f"jobs{rank}.json").write_text(json.dumps(jobs))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, worker("deepspeed_worker.py"), str(tmp_path / f"jobs{rank}.json"),
                               str(rank), "2", port], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=environment())
             for rank in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, out[-3000:] + err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    for rank, result in enumerate(results):
        assert [job["shimmed"] for job in result["jobs"]] == [True, False, True]
        for name, path in sources.items():
            checkpoint = open_checkpoint(path)
            loaded = np.load(tmp_path / f"{name}_{rank}.npz")
            assert len(loaded.files) == 28
            for field in loaded.files:
                index, tensor = field.split("|")
                key = ("sequential", index) + tuple(tensor.split("."))
                if name == "pp2_mp2":
                    expected = checkpoint.read_shard(key, rank)
                else:
                    source_key = key if name != "hf" else _hf_key(key)
                    expected = tensor_parallel.split(key, checkpoint.read(checkpoint.inventory[source_key]),
                                                     rank, 2, "float32", field)
                assert loaded[field].tobytes() == np.ascontiguousarray(expected).tobytes(), (name, field)


def _hf_key(key: tuple[str, ...]) -> tuple[str, ...]:
    """The HF GPT-NeoX name of a NeoX key (its slot on the decoder hub under HF's names)."""
    return neox.HF.key(neox.NEOX.locate(key))


def _free_port() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])
