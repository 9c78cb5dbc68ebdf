"""``wb.load_model`` on HF directories written by `transformers` gives `transformers`' logits.

Reference: the same random model run by `transformers` 5.23 (eager attention). Each
architecture the loader supports is built by transformers' own config class, saved with
``save_pretrained``, loaded back by us under every attention kernel and compared on random
tokens (fp32, max abs difference < 1e-4).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

import workbench as wb
from tests.integration.hf_tiny import FACTORIES, SLIDING_WINDOW, VOCAB, build_and_save

from workbench import ATTN_IMPLS
SEQ_LEN = 24  # > SLIDING_WINDOW, so Mistral's window masks real keys


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=list(FACTORIES))
def saved(request, tmp_path_factory, tokens):
    """(architecture, HF model, directory, HF logits) per architecture, built once per module."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_and_save(request.param, directory)
    with torch.no_grad():
        reference = hf_model(tokens).logits
    return request.param, hf_model, directory, reference


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
def test_logits_match_transformers(saved, tokens, attn_impl):
    name, _, directory, reference = saved
    model = wb.load_model(directory, attn_impl=attn_impl)
    assert model.cfg.attn_impl == attn_impl
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == reference.shape
    assert reference.abs().max() > 1.0, "the reference logits are too flat to discriminate"
    assert (logits - reference).abs().max().item() < 1e-4, name


def test_config_mapping_reads_each_architecture(saved):
    name, hf_model, directory, _ = saved
    cfg = wb.load_model(directory).cfg
    hf = hf_model.config
    assert (cfg.n_layers, cfg.d_vocab) == (2, VOCAB)
    if name == "gpt2":
        assert (cfg.positional, cfg.normalization, cfg.act_fn, cfg.tie_embeddings) == ("learned", "LN", "gelu_new", True)
        return
    assert (cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (6, 2, 12 if name == "llama_biased" else 8)
    assert cfg.rotary_base == hf.rope_parameters["rope_theta"]
    assert cfg.sliding_window == (SLIDING_WINDOW if name == "mistral" else None)
    assert SEQ_LEN > SLIDING_WINDOW  # so the logits test masks real keys in Mistral's window
    assert cfg.attn_bias == (name in ("qwen2", "llama_biased")) and cfg.mlp_bias == (name == "llama_biased")
    assert cfg.tie_embeddings == (name == "qwen2")
    assert (cfg.num_experts, cfg.experts_per_token) == ((8, 2) if name == "mixtral" else (0, 0))


def test_mixtral_routes_like_transformers(tmp_path, tokens):
    """Our chosen experts per token equal transformers' router's top-2, and routing is not trivial."""
    hf_model = build_and_save("mixtral", tmp_path)
    hf_choices = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, out, layer=index: hf_choices.__setitem__(layer, out[2]))
        for index, layer in enumerate(hf_model.model.layers)]
    with torch.no_grad():
        hf_model(tokens)
    for hook in hooks:
        hook.remove()
    model = wb.load_model(tmp_path, attn_impl="eager")
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_expert_indices"))
    for layer in range(2):
        ours = cache[f"blocks.{layer}.mlp.hook_expert_indices"].reshape(-1, 2)
        assert torch.equal(ours.sort(-1).values, hf_choices[layer].sort(-1).values)
        assert ours.unique().numel() >= 6, "routing should spread tokens over most of the 8 experts"


def test_mixtral_fused_expert_layout_loads(tmp_path, tokens):
    """transformers 5 holds experts fused (experts.gate_up_proj); a file written that way loads too."""
    hf_model = build_and_save("mixtral", tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_model.state_dict()
    with torch.no_grad():
        reference = hf_model(tokens).logits
        assert (wb.load_model(fused)(tokens) - reference).abs().max() < 1e-4


def test_sharded_checkpoint_with_index(tmp_path, tokens):
    hf_model = build_and_save("llama", tmp_path)
    for file in tmp_path.glob("model*.safetensors"):
        file.unlink()
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    with torch.no_grad():
        assert (wb.load_model(tmp_path)(tokens) - hf_model(tokens).logits).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_transformers_in_the_same_dtype(tmp_path, tokens, dtype):
    hf_model = build_and_save("llama", tmp_path).to(dtype)
    model = wb.load_model(tmp_path, dtype=dtype, attn_impl="eager")
    assert {p.dtype for p in model.parameters()} == {dtype} and model.cfg.dtype == dtype
    with torch.no_grad():
        reference = hf_model(tokens).logits.float()
        logits = model(tokens).float()
    # Both round every op to 8 (bf16) or 11 (fp16) mantissa bits, in slightly different orders.
    tolerance = 0.06 if dtype == torch.bfloat16 else 0.01
    assert (logits - reference).abs().max() < tolerance * reference.abs().max()


def test_tokenizer_json_is_used_with_bos_as_transformers_adds_it(saved):
    name, _, directory, _ = saved
    # The fast-tokenizer class reads tokenizer.json as saved (AutoTokenizer would swap in e.g. Qwen2's own class).
    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    model = wb.load_model(directory)
    for text in ["t5 t7 t9", "t100 t3", "t42"]:  # the checkpoint's own BOS convention, as transformers follows it
        ids = model.to_tokens(text, prepend_bos=model.tokenizer.specials.prepend_bos)[0].tolist()
        assert ids == hf_tokenizer(text)["input_ids"], name


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1", "F16"])
def test_tiny_gguf_matches_transformers_gguf_loader(tmp_path, quant):
    """A llama GGUF written as llama.cpp writes one (Q/K permuted, quantised) loads as transformers loads it."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.integration.gguf_tiny import tiny_llama, write_gguf

    source = tiny_llama()
    path = write_gguf(source, tmp_path / f"tiny-{quant}.gguf", quant=gguf.GGMLQuantizationType[quant])
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    model = wb.load_model(path, attn_impl="eager")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf_model(tokens).logits).abs().max() < 1e-4
        if quant == "F16":  # near-lossless: the un-permuted weights are the source model's own
            assert (model(tokens) - source(tokens).logits).abs().max() < 0.05
    for text in ["the thin then", " in the  the", "héllo <|im_start|> x"]:
        ids = model.to_tokens(text, prepend_bos=model.tokenizer.specials.prepend_bos)[0].tolist()
        assert ids == hf_tokenizer(text)["input_ids"]


def test_tiny_moe_gguf_matches_its_source_mixtral(tmp_path):
    """Mixtral experts as llama.cpp stacks them (ffn_*_exps, ffn_gate_inp) load back into the same model.

    transformers 5.23 cannot read MoE tensors from a llama GGUF, so the reference is the
    transformers Mixtral the file was written from (F16: near-lossless).
    """
    import gguf

    from tests.integration.gguf_tiny import tiny_llama, write_gguf

    source = tiny_llama(n_experts=4)
    model = wb.load_model(write_gguf(source, tmp_path / "moe.gguf", quant=gguf.GGMLQuantizationType.F16),
                          attn_impl="eager")
    assert (model.cfg.num_experts, model.cfg.experts_per_token) == (4, 2)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = source(tokens).logits
        assert (model(tokens) - reference).abs().max() < 0.05 < reference.abs().max()


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    """tokenizer.ggml.model = "llama" (Llama 2 / Mistral 7B style): scores-implied merges, byte fallback, BOS."""
    from transformers import AutoTokenizer

    from tests.integration.gguf_tiny import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(kind="llama"), tmp_path / "sp.gguf", kind="llama")
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    model = wb.load_model(path)
    assert model.tokenizer.specials.prepend_bos
    for text in ["the and in", " the  an", "héllo x\nthe", "<s>the</s>", "x<unk>y", "\t\t", "ünïcödé 東京 🤖", "   "]:
        ids = hf_tokenizer(text)["input_ids"]
        assert model.to_tokens(text, prepend_bos=model.tokenizer.specials.prepend_bos)[0].tolist() == ids, text
        assert model.to_string(torch.tensor(ids)) == hf_tokenizer.decode(ids), text
