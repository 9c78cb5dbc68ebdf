"""``model.save(d)`` then ``wb.load_model(d)`` gives back the same model, bit for bit.

The reference is the saved model itself: every parameter must be *equal* (not close), the
config identical, tied weights still one Parameter, the tokenizer and its BOS policy intact,
and the outputs therefore identical.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.integration.gguf_tiny import tiny_llama, write_gguf
from tests.unit.helpers import VARIANTS, make_model


def assert_identical(original: wb.Decoder, loaded: wb.Decoder) -> None:
    assert loaded.cfg == original.cfg
    original_state, loaded_state = original.state_dict(), loaded.state_dict()
    assert original_state.keys() == loaded_state.keys()
    for name, tensor in original_state.items():
        assert loaded_state[name].dtype == tensor.dtype, name
        assert torch.equal(loaded_state[name], tensor), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_round_trips_exactly(tmp_path, variant):
    model = make_model(variant)
    loaded = wb.load_model(model.save(tmp_path / variant), attn_impl=model.cfg.attn_impl)
    assert_identical(model, loaded)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    if model.cfg.tie_embeddings:
        assert loaded.unembed.W_U.data_ptr() == loaded.embed.W_E.data_ptr()  # still one tied tensor


@pytest.mark.parametrize("variant", ["alibi_gelu_new", "moe_gqa", "attn_only_tied"])
def test_a_file_saved_before_the_transformer_lens_names_still_loads(tmp_path, variant):
    # Older files held the nn.Linear-layout storage under the public names (blocks.0.attn.W_Q [H*K, D], ...).
    from safetensors.torch import load_file, save_file
    model = make_model(variant)
    weights = model.save(tmp_path / variant) / "model.safetensors"
    legacy = {name.replace("._W_", ".W_").replace("._b_", ".b_").removesuffix("_lin"): tensor
              for name, tensor in load_file(str(weights)).items()}
    assert "blocks.0.attn.W_Q" in legacy and not any(name.endswith("_lin") for name in legacy)
    save_file(legacy, str(weights))
    assert_identical(model, wb.load_model(tmp_path / variant, attn_impl=model.cfg.attn_impl))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_round_trips_exactly(tmp_path, dtype):
    model = make_model("gqa_rotary_rms_swiglu").to(dtype)
    loaded = wb.load_model(model.save(tmp_path), dtype=dtype)
    assert_identical(model, loaded)


def test_tokenizer_and_bos_policy_survive(tmp_path):
    """A model loaded from a GGUF (tokenizer built from its vocabulary) saved and loaded again."""
    original = wb.load_model(write_gguf(tiny_llama(), tmp_path / "tiny.gguf"))
    loaded = wb.load_model(original.save(tmp_path / "saved"))
    assert_identical(original, loaded)
    assert loaded.tokenizer.specials == original.tokenizer.specials
    for text in ["the thin then", "héllo <|im_start|> x", "  in  "]:
        assert torch.equal(loaded.to_tokens(text), original.to_tokens(text))


def test_attn_impl_can_be_chosen_at_load_time(tmp_path):
    model = make_model("sliding_window_gqa")
    directory = model.save(tmp_path)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 20))
    for attn_impl in ("eager", "sdpa", "flash"):
        loaded = wb.load_model(directory, attn_impl=attn_impl)
        assert loaded.cfg.attn_impl == attn_impl
        with torch.no_grad():
            assert (loaded(tokens) - model(tokens)).abs().max() < 1e-5


def test_registered_toy_name_loads_its_zoo_directory(tmp_path, monkeypatch):
    """A toy is installed exactly when its zoo directory has config.json; then its name loads it."""
    from workbench.loading import registry

    monkeypatch.setattr(registry, "ZOO", tmp_path)
    table = wb.list_models().set_index("name")
    assert {"smollm2-135m", "toy-attn-2l", "toy-moe-2l"} <= set(table.index)
    assert table["description"].str.len().gt(20).all() and table["installed"].dtype == bool
    assert not table.loc["toy-attn-2l", "installed"]
    model = make_model("attn_only_tied")
    model.save(tmp_path / "toy-attn-2l")
    table = wb.list_models().set_index("name")
    assert table.loc["toy-attn-2l", "installed"] and table.loc["toy-attn-2l", "source"] == str(tmp_path / "toy-attn-2l")
    assert_identical(model, wb.load_model("toy-attn-2l"))
