"""``wb.load_model(..., fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)``
keeps the log-probabilities of `transformers` for every architecture the loaders read.

Reference: the same random model run by `transformers` (eager attention; for the GGUF, the model
`transformers`' own GGUF loader reads from the file, and for the MoE GGUF, which that loader
cannot read, the float32 Mixtral the file was written from). Each checkpoint is loaded twice by
us, as it is and processed; the processed log-probabilities must equal both the unprocessed
ones and transformers' within 1e-4 (fp32). ``center_writing_weights`` is asked for only where
TransformerLens would apply it (LayerNorm: GPT-2); elsewhere its refusal is checked.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.integration.hf_tiny import FACTORIES, VOCAB, build_and_save
from workbench.options import WEIGHT_PROCESSING_STEPS
from workbench.errors import ConfigError

TOL = 1e-4
SEQ_LEN = 24


def processing_options(model: wb.Decoder) -> dict[str, bool]:
    return dict(fold_ln=True, center_writing_weights=model.cfg.normalization == "LN", center_unembed=True,
                fold_value_biases=True)


def check(name: str, source, plain: wb.Decoder, reference: torch.Tensor, tokens: torch.Tensor) -> None:
    """Processes ``source`` on loading and compares its log-probabilities with ``plain``'s and ``reference``'s."""
    options = processing_options(plain)
    processed = wb.load_model(source, attn_impl="eager", **options)
    assert processed.cfg.weight_processing == tuple(s for s in WEIGHT_PROCESSING_STEPS if options.get(s))
    for block in processed.blocks:  # the norms really were folded
        assert torch.equal(block.ln1.w, torch.ones_like(block.ln1.w))
    with torch.no_grad():
        ours = processed(tokens).log_softmax(-1)
        unprocessed = plain(tokens).log_softmax(-1)
    reference = reference.log_softmax(-1)
    assert reference.min() < -6, "log-probabilities too flat to discriminate"
    assert (plain.blocks[0].ln1.w - 1).abs().max() > 0.01, "norm gains at 1: folding would be vacuous"
    diff_plain = (ours - unprocessed).abs().max().item()
    diff_reference = (ours - reference).abs().max().item()
    print(f"{name}: max |log-prob diff| vs unprocessed {diff_plain:.2e}, vs transformers {diff_reference:.2e}")
    assert diff_plain < TOL, name
    assert diff_reference < TOL, name


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("architecture", list(FACTORIES))
def test_processed_hf_checkpoint_keeps_transformers_log_probs(tmp_path, tokens, architecture):
    hf_model = build_and_save(architecture, tmp_path)
    with torch.no_grad():
        reference = hf_model(tokens).logits
    plain = wb.load_model(tmp_path, attn_impl="eager")
    assert plain.cfg.weight_processing == ()
    check(architecture, tmp_path, plain, reference, tokens)
    if plain.cfg.normalization != "LN":  # TransformerLens skips centring under RMSNorm, with a warning
        with pytest.warns(UserWarning, match="center_writing_weights skipped"):
            skipped = wb.load_model(tmp_path, fold_ln=True, center_writing_weights=True)
        assert skipped.cfg.weight_processing == ("fold_ln",)


def test_processed_gpt2_is_what_transformer_lens_produces(tmp_path, tokens):
    """GPT-2 (LayerNorm, tied, biased) ends as HookedTransformer.from_pretrained left it: norms identity,
    writing weights and W_U centred, b_V folded, W_E no longer shared with W_U."""
    build_and_save("gpt2", tmp_path)
    model = wb.load_model(tmp_path, fold_ln=True, center_writing_weights=True, center_unembed=True,
                          fold_value_biases=True)
    assert not model.cfg.tie_embeddings and model.cfg.unembed_bias
    assert model.ln_final.b.abs().max() == 0 and torch.equal(model.ln_final.w, torch.ones_like(model.ln_final.w))
    for matrix in (model.W_E, model.W_pos, model.W_O, model.W_out, model.b_O, model.b_out):
        assert matrix.mean(-1).abs().max() < 1e-5
    assert model.W_U.mean(-1).abs().max() < 1e-5 and model.W_U.mean(0).abs().max() < 1e-5
    assert model.b_V.abs().max() == 0


def test_processed_gguf_keeps_transformers_log_probs(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.integration.gguf_tiny import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")  # Q8_0, tied embeddings, RMSNorm, GQA
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    plain = wb.load_model(path, attn_impl="eager")
    tokens = torch.randint(0, plain.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = hf_model(tokens).logits
    check("gguf-llama", path, plain, reference, tokens)


def test_processed_moe_gguf_keeps_its_source_mixtral_log_probs(tmp_path):
    import gguf

    from tests.integration.gguf_tiny import tiny_llama, write_gguf

    source = tiny_llama(n_experts=4)
    path = write_gguf(source, tmp_path / "moe.gguf", quant=gguf.GGMLQuantizationType.F32)  # lossless
    plain = wb.load_model(path, attn_impl="eager")
    assert plain.cfg.num_experts == 4
    tokens = torch.randint(0, plain.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = source(tokens).logits
    check("gguf-mixtral", path, plain, reference, tokens)
