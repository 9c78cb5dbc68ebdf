"""Every GGUF architecture we read loads at parity with the transformers model it was converted from.

For each recipe of ``gguf_convert`` (one per llama.cpp architecture, two for llama and Falcon), a random
tiny transformers model is written as llama.cpp's converter writes it: float32 (logits and every
layer's residual stream within 1e-4 of transformers' eager run) and in one quantised block type
(logits within 1e-4 of the transformers model holding the dequantised weights). F16 and BF16 files
are checked the same way on one architecture.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.integration.gguf_convert import Q, RECIPES, build, quantised_reference, write

TOLERANCE = 1e-4
TOKENS = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", params=sorted(RECIPES))
def converted(request):
    model = build(request.param)
    with torch.no_grad():
        out = model(TOKENS, output_hidden_states=True)
    assert out.logits.abs().max() > 1.0, f"{request.param}: the reference logits are too flat to discriminate"
    return request.param, model, out


def test_float_file_matches_transformers(converted, tmp_path):
    name, _, out = converted
    model = wb.load_model(write(name, converted[1], tmp_path / f"{name}.gguf"), attn_impl="eager")
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_{kind}" for l in range(L) for kind in ("pre", "post")]
    with torch.no_grad():
        logits, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n in names)
    assert max_diff(logits, out.logits) < TOLERANCE, name
    for layer in range(L):
        assert max_diff(cache[f"blocks.{layer}.hook_resid_pre"], out.hidden_states[layer]) < TOLERANCE, (name, layer)
        leaving = cache[f"blocks.{layer}.hook_resid_post"]
        if layer == L - 1:  # transformers reports the last hidden state after the final norm
            leaving = model.apply_final_norm(leaving)
        assert max_diff(leaving, out.hidden_states[layer + 1]) < TOLERANCE, (name, layer)


def test_quantised_file_matches_the_dequantised_transformers_model(converted, tmp_path):
    name, source, out = converted
    quant = RECIPES[name].quant
    model = wb.load_model(write(name, source, tmp_path / f"{name}-{quant.name}.gguf", quant=quant), attn_impl="sdpa")
    with torch.no_grad():
        expected = quantised_reference(name, source, quant)(TOKENS).logits
        assert max_diff(model(TOKENS), expected) < TOLERANCE, (name, quant.name)
        assert max_diff(expected, out.logits) > 10 * TOLERANCE, "the file should really be quantised"


@pytest.mark.parametrize("quant", [Q.F16, Q.BF16])
def test_half_precision_files_load(tmp_path, quant):
    source = build("qwen2")
    model = wb.load_model(write("qwen2", source, tmp_path / "half.gguf", quant=quant))
    with torch.no_grad():
        assert max_diff(model(TOKENS), quantised_reference("qwen2", source, quant)(TOKENS).logits) < TOLERANCE


# ---- what a file we cannot read is told, named in GGUF's own terms ----

@pytest.fixture(scope="module")
def sources():
    return {name: build(name) for name in ("gemma2", "gpt2", "phi3", "qwen2", "falcon")}


def test_a_missing_tensor_is_named_by_its_gguf_name(sources, tmp_path):
    path = write("gemma2", sources["gemma2"], tmp_path / "holed.gguf", skip="blk.1.post_ffw_norm.weight")
    with pytest.raises(wb.CheckpointError, match=r"holed\.gguf: missing tensor 'blk\.1\.post_ffw_norm\.weight'"):
        wb.load_model(path)


def test_a_tensor_nothing_reads_is_named(sources, tmp_path):
    path = write("qwen2", sources["qwen2"], tmp_path / "extra.gguf", extra_tensors={"blk.0.attn_gate.weight": torch.ones(4, 64)})
    with pytest.raises(wb.CheckpointError, match=r"extra\.gguf: unexpected tensor\(s\) \['blk\.0\.attn_gate\.weight'\]"):
        wb.load_model(path)


def test_a_misshapen_tensor_is_named_in_its_stored_layout_before_anything_is_dequantised(sources, tmp_path, monkeypatch):
    """GPT-2's MLP width read as 97: transformers' c_fc [64, 97] is stored transposed, so the file's
    ffn_up must be (97, 64); the message gives both in the stored layout."""
    from workbench.loading.gguf import loader as gguf_loader

    file = gguf_loader.GGUFFile(write("gpt2", sources["gpt2"], tmp_path / "gpt2.gguf", quant=Q.Q8_0))
    real_field = file.field
    monkeypatch.setattr(file, "field", lambda key, *default: 97 if key == "gpt2.feed_forward_length"
                        else real_field(key, *default))
    monkeypatch.setattr(gguf_loader, "_dequantised", lambda *args: pytest.fail("dequantised before the shape check"))
    with pytest.raises(wb.CheckpointError, match=r"gpt2\.gguf: tensor 'blk\.0\.ffn_up\.weight' has shape \(256, 64\) "
                                                 r"\(rows, cols as stored\), expected \(97, 64\)"):
        gguf_loader.read_tensors(file, gguf_loader.model_config_from_gguf(file))


@pytest.mark.parametrize("key, value, error, message", [
    ("falcon.attention.head_count", 0, wb.ConfigError, r"field 'falcon\.attention\.head_count' = 0 .*positive integer"),
    ("falcon.block_count", 10**12, wb.CheckpointError,
     r"field 'falcon\.block_count' declares 1000000000000 layers, but the weights hold tensors for 2"),
])
def test_hostile_metadata_is_refused_naming_the_field(sources, tmp_path, monkeypatch, key, value, error, message):
    from workbench.loading.gguf import loader as gguf_loader

    file = gguf_loader.GGUFFile(write("falcon", sources["falcon"], tmp_path / "falcon.gguf"))
    real_field = file.field
    monkeypatch.setattr(file, "field", lambda name, *default: value if name == key else real_field(name, *default))
    with pytest.raises(error, match=message):
        gguf_loader.model_config_from_gguf(file)


def test_longrope_and_unknown_architectures_are_refused_by_name(sources, tmp_path):
    longrope = write("phi3", sources["phi3"], tmp_path / "long.gguf", extra_tensors={"rope_factors_long.weight": torch.ones(8)})
    with pytest.raises(wb.ConfigError, match=r"long\.gguf: field 'rope_factors_long\.weight' = 'present' .*longrope"):
        wb.load_model(longrope)
    unknown = write("qwen2", sources["qwen2"], tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(wb.CheckpointError, match=r"mamba\.gguf: unknown architecture 'mamba' \(field 'general\.architecture'\); "
                                                 r"supported: \['llama', 'qwen2'"):
        wb.load_model(unknown)


@pytest.mark.parametrize("name", ["gemma2", "phi3", "qwen2"])
def test_sentencepiece_vocabularies_tokenize_as_transformers_builds_them_for_the_architecture(tmp_path, name):
    """Gemma's and Phi-3's files get transformers' own per-architecture sentencepiece builders (Gemma: no
    prefix space, merges by position; Phi-3: the prefix space from a normalizer); others Llama's."""
    from transformers import AutoTokenizer

    from workbench.loading.gguf.loader import GGUFFile
    from workbench.loading.gguf.tokenizer import tokenizer_from_gguf

    path = write(name, build(name), tmp_path / f"{name}.gguf", tokenizer="llama")
    ours = tokenizer_from_gguf(GGUFFile(path).field, str(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["the and in", "  the  an", "héllo x\nthe", "ünïcödé 🤖", " a"]:
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, prepend_bos=False) == ids, (name, text)
        assert ours.decode(ids) == theirs.decode(ids), (name, text)
