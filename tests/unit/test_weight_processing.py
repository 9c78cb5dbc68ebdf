"""TransformerLens's weight processing (``Decoder.process_weights_``, ``workbench.processing``).

References, never the code under test: the unprocessed model's own logits (each step must leave
them, or with ``center_unembed`` the log-probabilities, equal within 1e-4 in fp32); hand formulas
(means over d_model / the vocabulary, ``b_O + sum_h b_V[h] @ W_O[h]``, the logit difference read
off the residual stream); and TransformerLens's own ``ProcessWeights.process_weights`` run on the
same weights in TransformerLens's state-dict layout (that comparison is in
test_weight_processing_matches_transformer_lens.py).

Every unit-test variant of tests/unit/helpers.py is processed with each step alone and with all
of them; a step the variant rightly refuses (fold_ln on a post-norm model, centring the writing
weights without LayerNorm) is tested for its message and for leaving the model untouched.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.unit.helpers import BASE, VARIANTS, make_model
from tests.unit.processing_variants import EXTRA, build
from workbench.options import WEIGHT_PROCESSING_STEPS
from workbench.errors import ConfigError

TOL = 1e-4
TOKENS = torch.randint(0, BASE["d_vocab"], (2, 12), generator=torch.Generator().manual_seed(0))
ALL_VARIANTS = sorted(VARIANTS) + sorted(EXTRA)
OFF = dict.fromkeys(WEIGHT_PROCESSING_STEPS, False)


def expected_refusal(cfg: wb.ModelConfig, steps: list[str]):
    """The message a step must be refused with on this config (hand knowledge), or None."""
    if "fold_ln" in steps and cfg.norm_placement == "post":
        return r"fold_ln: this is a post-norm model .*sits after the residual sum"
    if "center_writing_weights" in steps and cfg.normalization == "LN" and cfg.norm_placement == "post":
        return r"center_writing_weights: this is a post-norm model .*reads the embeddings before any norm"
    if "refactor_factored_attn_matrices" in steps and cfg.positional == "rotary":
        return r"refactor_factored_attn_matrices: this model uses rotary positions"
    if "refactor_factored_attn_matrices" in steps and cfg.n_key_value_heads != cfg.n_heads:
        return r"refactor_factored_attn_matrices: grouped-query attention"
    return None


def skipped(cfg: wb.ModelConfig, step: str) -> bool:
    """A step TransformerLens skips with a warning on this config: centring under RMSNorm."""
    return step == "center_writing_weights" and cfg.normalization != "LN"


def allowed_steps(cfg: wb.ModelConfig) -> list[str]:
    return [s for s in WEIGHT_PROCESSING_STEPS if expected_refusal(cfg, [s]) is None and not skipped(cfg, s)]


# The steps process_weights_() applies when called without arguments (TransformerLens's defaults).
DEFAULT_STEPS = [s for s in WEIGHT_PROCESSING_STEPS if s != "refactor_factored_attn_matrices"]


def snapshot(model: wb.Decoder) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_untouched(model: wb.Decoder, before: dict, cfg: wb.ModelConfig) -> None:
    assert model.cfg == cfg
    after = model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[name], before[name]) for name in before)


def run(model: wb.Decoder) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def norms(model: wb.Decoder) -> list:
    found = [block.ln1 for block in model.blocks] + [block.ln2 for block in model.blocks if block.has_mlp]
    return found + ([model.ln_final] if model.ln_final is not None else [])


def stored(module, name: str):
    """The bias a part holds, or None (an absent dense bias reads as zeros, as in TransformerLens)."""
    return module.stored_bias(name) if hasattr(module, "stored_bias") else getattr(module, name, None)


def writing_weights(model: wb.Decoder) -> dict[str, torch.Tensor]:
    """Everything that writes to the residual stream, each with d_model last."""
    out = {"W_E": model.W_E}
    if model.cfg.positional == "learned":
        out["W_pos"] = model.W_pos
    for layer, block in enumerate(model.blocks):
        out[f"{layer}.W_O"] = block.attn.W_O
        if stored(block.attn, "b_O") is not None:
            out[f"{layer}.b_O"] = block.attn.b_O
        if block.has_mlp:
            out[f"{layer}.W_out"] = block.mlp.W_out  # dense [M, D]; experts [E, M, D]
            if stored(block.mlp, "b_out") is not None:
                out[f"{layer}.b_out"] = block.mlp.b_out
    return out


# ---- each step alone, then all of them ------------------------------------------------------------------
@pytest.mark.parametrize("step", WEIGHT_PROCESSING_STEPS)
@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_each_step_alone_keeps_the_model(name, step):
    model = build(name)
    before, cfg = snapshot(model), model.cfg
    reference = run(model)
    assert reference.log_softmax(-1).min() < -5, "log-probabilities too flat to discriminate"
    refusal = expected_refusal(cfg, [step])
    if refusal is not None:
        with pytest.raises(ConfigError, match=refusal):
            model.process_weights_(**{**OFF, step: True})
        assert_untouched(model, before, cfg)
        return
    if skipped(cfg, step):
        with pytest.warns(UserWarning, match=r"center_writing_weights skipped: .*'RMS'.*TransformerLens skips it"):
            model.process_weights_(**{**OFF, step: True})
        assert_untouched(model, before, cfg)
        return

    old_writers = {k: v.detach().clone() for k, v in writing_weights(model).items()}
    old_b_V = [None if b.attn._b_V_lin is None else b.attn.b_V.detach().clone() for b in model.blocks]
    old_W_O = [b.attn.W_O.detach().clone() for b in model.blocks]
    old_b_O = [None if stored(b.attn, "b_O") is None else b.attn.b_O.detach().clone() for b in model.blocks]
    assert model.process_weights_(**{**OFF, step: True}) is model
    assert model.cfg.weight_processing == (step,)
    logits = run(model)
    if step == "center_unembed":
        assert (logits.log_softmax(-1) - reference.log_softmax(-1)).abs().max().item() < TOL
        # a per-position constant: the logits of one position all moved by the same amount
        shift = logits - reference
        assert (shift - shift[..., :1]).abs().max().item() < TOL
        W_U = model.W_U
        assert W_U.mean(-1).abs().max().item() < 1e-6
        if stored(model.unembed, "b_U") is not None:
            assert abs(model.unembed.b_U.mean().item()) < 1e-6
    else:
        assert (logits - reference).abs().max().item() < TOL

    if step == "fold_ln":
        for norm in norms(model):
            assert torch.equal(norm.w, torch.ones_like(norm.w))
            if hasattr(norm, "b"):
                assert torch.equal(norm.b, torch.zeros_like(norm.b))
        if cfg.normalization == "LN":  # reading weights centred over d_model, as TransformerLens does
            assert model.W_Q.mean(-2).abs().max().item() < 1e-5
            assert model.W_U.mean(0).abs().max().item() < 1e-5
    elif step == "center_writing_weights":
        for key, tensor in writing_weights(model).items():
            assert tensor.mean(-1).abs().max().item() < 1e-5, key
            assert old_writers[key].mean(-1).abs().max().item() > 1e-3, f"{key} was centred already: vacuous"
    elif step == "refactor_factored_attn_matrices":  # W_O a rotation per head; Q and K columns of equal norms
        K = model.cfg.d_head
        for block in model.blocks:
            W_O = block.attn.W_O
            torch.testing.assert_close(W_O @ W_O.transpose(-1, -2), torch.eye(K).expand(model.cfg.n_heads, K, K),
                                       atol=1e-5, rtol=0)
            Q_eff, K_eff = (torch.cat([W, b[:, None]], dim=1) for W, b in ((block.attn.W_Q, block.attn.b_Q),
                                                                            (block.attn.W_K, block.attn.b_K)))
            torch.testing.assert_close(Q_eff.norm(dim=-2), K_eff.norm(dim=-2), atol=1e-4, rtol=1e-4)
    elif step == "fold_value_biases":
        for layer, block in enumerate(model.blocks):
            if old_b_V[layer] is None:
                assert block.attn._b_V_lin is None and stored(block.attn, "b_O") is None
                continue
            assert old_b_V[layer].abs().max() > 0.1, "no value bias to fold: vacuous"
            assert torch.equal(block.attn.b_V, torch.zeros_like(block.attn.b_V))
            by_hand = old_b_O[layer].clone()
            for head in range(model.cfg.n_heads):  # b_V per query head (a GQA head repeated over its group)
                by_hand += old_b_V[layer][head] @ old_W_O[layer][head]
            assert (block.attn.b_O - by_hand).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_all_steps_together(name):
    model = build(name)
    before, cfg = snapshot(model), model.cfg
    reference = run(model).log_softmax(-1)
    refusal = expected_refusal(cfg, DEFAULT_STEPS)
    if refusal is not None:
        # One refused step refuses the call before any step runs: nothing half-processed.
        with pytest.raises(ConfigError, match=refusal):
            model.process_weights_()
        assert_untouched(model, before, cfg)
    steps = allowed_steps(cfg)
    model.process_weights_(**{s: s in steps for s in WEIGHT_PROCESSING_STEPS})
    assert model.cfg.weight_processing == tuple(steps)
    assert (run(model).log_softmax(-1) - reference).abs().max().item() < TOL


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_processed_model_saves_and_reloads(name, tmp_path):
    model = build(name)
    steps = allowed_steps(model.cfg)
    model.process_weights_(**{s: s in steps for s in WEIGHT_PROCESSING_STEPS})
    model.save(tmp_path)
    reloaded = wb.load_model(tmp_path)
    assert reloaded.cfg == model.cfg
    assert reloaded.cfg.weight_processing == tuple(steps)
    assert (run(reloaded) - run(model)).abs().max().item() < 1e-6
    # Loading a processed model with the options again changes nothing (each step is recorded).
    again = wb.load_model(tmp_path, **{s: True for s in steps})
    assert again.cfg == model.cfg and (run(again) - run(model)).abs().max().item() < 1e-6


# ---- the recipe that motivated it -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mha_learned_ln", "alibi_gelu_new", "attn_only_tied", "mqa_ln_biased"])
def test_decompose_resid_gives_the_logit_difference_after_fold_ln(name):
    """sum over components of cache.decompose_resid(apply_ln=True) . (W_U[:, a] - W_U[:, b]) + b_U diff
    equals the true logit difference only once the final LayerNorm's gain and bias are folded."""
    a, b = 3, 7

    def read_off(model):
        logits, cache = model.run_with_cache(TOKENS)
        stack = cache.decompose_resid(apply_ln=True, pos_slice=-1)  # [components, batch, d_model]
        assert stack.shape[0] >= 3
        direction = model.W_U[:, a] - model.W_U[:, b]
        estimate = stack.sum(0) @ direction + (model.b_U[a] - model.b_U[b])
        true = logits[:, -1, a] - logits[:, -1, b]
        assert true.abs().max() > 0.3, "a near-zero logit difference would not discriminate"
        return (estimate - true).abs().max().item()

    raw = build(name)
    assert read_off(raw) > 1e-2  # unprocessed, ln_final's w and b are missing from the reading
    folded = build(name).process_weights_(**{**OFF, "fold_ln": True})
    assert read_off(folded) < TOL
    everything = build(name).process_weights_()
    assert read_off(everything) < TOL


# ---- what fold_ln must do to the model's structure -----------------------------------------------------------
def test_fold_ln_creates_the_biases_a_layernorm_bias_needs():
    model = build("mha_learned_ln")
    assert not (model.cfg.attn_bias or model.cfg.mlp_bias or model.cfg.unembed_bias)
    ln1_b, W_Q = model.blocks[0].ln1.b.detach().clone(), model.blocks[0].attn.W_Q.detach().clone()
    ln_final_b, W_U = model.ln_final.b.detach().clone(), model.W_U.detach().clone()
    model.process_weights_(**{**OFF, "fold_ln": True})
    assert model.cfg.attn_bias and model.cfg.mlp_bias and model.cfg.unembed_bias
    # b_Q[h] = ln1.b @ W_Q[h] (the bias was zero), b_U = ln_final.b @ W_U: by hand
    assert (model.blocks[0].attn.b_Q - torch.einsum("d,hdk->hk", ln1_b, W_Q)).abs().max() < 1e-5
    assert (model.unembed.b_U - ln_final_b @ W_U).abs().max() < 1e-5
    assert model.blocks[1].mlp.b_in.abs().max() > 0 and model.blocks[1].attn.b_O.abs().max() == 0


def test_rms_fold_ln_adds_no_biases_and_only_scales():
    model = build("gqa_rotary_rms_swiglu")
    w, W_K = model.blocks[1].ln1.w.detach().clone(), model.blocks[1].attn._W_K.detach().clone()
    model.process_weights_(**{**OFF, "fold_ln": True})
    assert not (model.cfg.attn_bias or model.cfg.mlp_bias or model.cfg.unembed_bias)
    assert torch.allclose(model.blocks[1].attn._W_K, W_K * w[None, :, None])  # [G, D, K], no centring


def test_tied_embeddings_are_untied_and_W_E_kept():
    model = build("attn_only_tied")
    W_E = model.W_E.detach().clone()
    assert model.unembed._W_U_lin is model.embed.W_E
    model.process_weights_(**{**OFF, "fold_ln": True})
    assert not model.cfg.tie_embeddings
    assert model.unembed._W_U_lin is not model.embed.W_E
    assert torch.equal(model.W_E, W_E)
    assert not torch.allclose(model.W_U, W_E.T)
    assert model.n_params == sum(p.numel() for p in model.parameters())


def test_layernorm_mixture_of_experts_with_a_bias_is_refused_untouched():
    model = make_model("moe_gqa", normalization="LN")  # make_model draws ln2.b ~ N(0, 0.1)
    before, cfg = snapshot(model), model.cfg
    with pytest.raises(ConfigError, match=r"mixture of experts has no router or expert biases.*ln2\.b "
                                          r"\(nonzero in layer\(s\) \[0, 1\]\)"):
        model.process_weights_()
    assert_untouched(model, before, cfg)
    model.process_weights_(**{**OFF, "center_unembed": True})  # the other steps still apply
    assert model.cfg.weight_processing == ("center_unembed",)


def test_layernorm_mixture_of_experts_folds_its_router():
    model = build("moe_ln")  # ln2.b zero
    w, router = model.blocks[0].ln2.w.detach().clone(), model.blocks[0].mlp.W_router.detach().clone()
    model.process_weights_(**{**OFF, "fold_ln": True})
    by_hand = router * w[:, None]
    assert torch.allclose(model.blocks[0].mlp.W_router, by_hand - by_hand.mean(0, keepdim=True), atol=1e-6)


# ---- repetition, order, loading ----------------------------------------------------------------------------
def test_applying_steps_twice_is_harmless():
    model = build("alibi_gelu_new").process_weights_()
    once = snapshot(model)
    model.process_weights_()
    model.process_weights_(**{**OFF, "fold_value_biases": True})
    assert model.cfg.weight_processing == tuple(DEFAULT_STEPS)
    assert all(torch.equal(model.state_dict()[k], once[k]) for k in once)


def test_fold_ln_after_fold_value_biases_is_refused():
    model = build("alibi_gelu_new").process_weights_(**{**OFF, "fold_value_biases": True})
    before, cfg = snapshot(model), model.cfg
    with pytest.raises(ConfigError, match=r"fold_ln after fold_value_biases would put ln1's bias .* back into b_V"):
        model.process_weights_(**{**OFF, "fold_ln": True})
    assert_untouched(model, before, cfg)


def test_steps_in_separate_calls_match_one_call():
    together = build("mha_learned_ln").process_weights_(refactor_factored_attn_matrices=True)
    apart = build("mha_learned_ln")
    for step in WEIGHT_PROCESSING_STEPS:
        apart.process_weights_(**{**OFF, step: True})
    assert apart.cfg == together.cfg
    assert all(torch.allclose(apart.state_dict()[k], v, atol=1e-6) for k, v in together.state_dict().items())


def test_load_model_applies_what_was_asked(tmp_path):
    build("mha_learned_ln").save(tmp_path)
    plain = wb.load_model(tmp_path)
    assert plain.cfg.weight_processing == ()
    assert plain.blocks[0].ln1.w.sub(1).abs().max() > 0.01  # default: the checkpoint as it is
    processed = wb.load_model(tmp_path, fold_ln=True, center_writing_weights=True, center_unembed=True,
                              fold_value_biases=True)
    assert processed.cfg.weight_processing == tuple(DEFAULT_STEPS)
    assert (run(processed).log_softmax(-1) - run(plain).log_softmax(-1)).abs().max().item() < TOL
    partial = wb.load_model(tmp_path, center_unembed=True)
    assert partial.cfg.weight_processing == ("center_unembed",)


def test_load_model_refuses_what_the_model_cannot_take(tmp_path):
    build("gqa_rotary_rms_swiglu").save(tmp_path)
    with pytest.raises(ConfigError, match=r"refactor_factored_attn_matrices: this model uses rotary positions"):
        wb.load_model(tmp_path, fold_ln=True, refactor_factored_attn_matrices=True)
    # Centring under RMSNorm is skipped with a warning (TransformerLens's behaviour), the rest applied.
    with pytest.warns(UserWarning, match=r"center_writing_weights skipped"):
        model = wb.load_model(tmp_path, fold_ln=True, center_writing_weights=True)
    assert model.cfg.weight_processing == ("fold_ln",)


def test_low_precision_is_processed_in_float32():
    model16 = build("mha_learned_ln").to(torch.bfloat16)
    model32 = build("mha_learned_ln").to(torch.bfloat16).to(torch.float32)  # the same bf16 values, in fp32
    model32.process_weights_()
    model16.process_weights_()
    for name, tensor in model16.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        # one rounding of the float32 result, not an accumulation of bf16 roundings
        assert torch.equal(tensor, model32.state_dict()[name].to(torch.bfloat16)), name
