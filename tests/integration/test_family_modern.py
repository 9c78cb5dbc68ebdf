"""Modern Llama-like families load at parity with transformers (``family_parity``): Granite (its four
multipliers), Helium (RoPE on adjacent pairs), Ministral (windows per layer), Ministral 3 (yarn and
position-scaled queries), Seed-OSS (q/k/v and o biases switched apart), OLMo 3 (windows), EXAONE 4
(norms after the sublayers, QK norm, NoPE on full layers), HunYuan dense (QK norm after RoPE, NTK
alpha), ERNIE 4.5, GLM and GLM-4 (fused gate_up, partial rotary on adjacent pairs; GLM-4's sandwich
norms) and InternLM3, whose remote-code config.json (``qkv_bias`` / ``bias``) is written over a
transformers Llama or Qwen2 checkpoint with the same computation. Values these architectures cannot
honour are refused by field before any weight is read.

Tiny configs as ``test_family_llama``'s: d_model 48 over 6 heads (2 KV heads), vocab 101, 2-3 layers,
windows of 5 tokens and original contexts of 8 positions, shorter than the 24-token prompt.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (ApertusConfig, ArceeConfig, Cohere2Config, CohereConfig, Ernie4_5Config, Exaone4Config,
                          Glm4Config, GlmConfig, GraniteConfig, HeliumConfig, HunYuanDenseV1Config, LlamaConfig,
                          Ministral3Config, MinistralConfig, NemotronConfig, Olmo3Config, PersimmonConfig, Qwen2Config,
                          SeedOssConfig, VaultGemmaConfig)

import workbench as wb
import workbench.loading.hf.loader as hf_loading
from tests.integration.family_parity import (KERNELS, TOLERANCE, Case, family_parity_tests, max_diff,
                                             saved_on_demand)
from tests.integration.test_family_llama import _copy  # a saved checkpoint copied, its config.json edited
from tests.integration.test_padding_parity import padded_batch

TINY = dict(vocab_size=101, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=80, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
THREE = {**TINY, "num_hidden_layers": 3}
SLIDING_FULL_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def as_internlm3(qkv_bias: bool, bias: bool):
    """The config.json InternLM3's remote code reads, over a transformers checkpoint that computes the
    same: its biases are ``qkv_bias`` (q, k, v) and ``bias`` (o_proj and the MLP)."""

    def edit(config: dict) -> dict:
        for key in ("attention_bias", "mlp_bias", "layer_types", "use_sliding_window", "max_window_layers"):
            config.pop(key, None)
        return {**config, "architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3",
                "qkv_bias": qkv_bias, "bias": bias}

    return edit


MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}

APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}

CASES = {
    "granite_multipliers_bias": Case(lambda: GraniteConfig(
        **TINY, embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.6, logits_scaling=2.5,
        attention_bias=True, mlp_bias=True)),
    "granite_tied": Case(lambda: GraniteConfig(**TINY, embedding_multiplier=2.0, attention_multiplier=0.2,
                                               residual_multiplier=0.4, logits_scaling=0.5, tie_word_embeddings=True)),
    "helium_adjacent_rope_bias": Case(lambda: HeliumConfig(**TINY, head_dim=8, attention_bias=True, mlp_bias=True)),
    "ministral_sliding_layers": Case(lambda: MinistralConfig(**THREE, head_dim=8, sliding_window=5,
                                                             layer_types=SLIDING_FULL_SLIDING)),
    "ministral3_query_scale_yarn": Case(lambda: Ministral3Config(**TINY, head_dim=8, sliding_window=5,
                                                                 rope_parameters=MINISTRAL3_ROPE)),
    "seed_oss_qkv_bias": Case(lambda: SeedOssConfig(**TINY, head_dim=8, attention_bias=True, mlp_bias=True)),
    "seed_oss_out_bias_only": Case(lambda: SeedOssConfig(**TINY, head_dim=8, attention_bias=False,
                                                         attention_out_bias=True)),
    "olmo3_sliding_layers": Case(lambda: Olmo3Config(**THREE, sliding_window=5, layer_types=SLIDING_FULL_SLIDING)),
    "exaone4_sliding_nope_full": Case(lambda: Exaone4Config(**THREE, sliding_window=5, sliding_window_pattern=2)),
    "hunyuan_dense_ntk_alpha_bias": Case(lambda: HunYuanDenseV1Config(
        **TINY, head_dim=8, attention_bias=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 4.0})),
    "ernie4_5_bias_tied": Case(lambda: Ernie4_5Config(**TINY, head_dim=8, use_bias=True, tie_word_embeddings=True)),
    "glm_partial_rotary": Case(lambda: GlmConfig(**TINY, head_dim=8)),
    "glm4_sandwich": Case(lambda: Glm4Config(**TINY, head_dim=8)),
    "cohere_qk_norm_bias": Case(lambda: CohereConfig(**TINY, use_qk_norm=True, attention_bias=True, logit_scale=0.3)),
    "cohere_untied": Case(lambda: CohereConfig(**TINY, tie_word_embeddings=False, logit_scale=2.0)),
    "cohere2_sliding_rope_layers": Case(lambda: Cohere2Config(**THREE, sliding_window=5, logit_scale=0.5,
                                                              layer_types=SLIDING_FULL_SLIDING)),
    "arcee_relu2_bias": Case(lambda: ArceeConfig(**TINY, mlp_bias=True, attention_bias=True)),
    "nemotron_layernorm1p_partial_rotary": Case(lambda: NemotronConfig(**TINY, attention_bias=True, mlp_bias=True)),
    "apertus_xielu_llama3_rope": Case(lambda: ApertusConfig(**TINY, rope_parameters=APERTUS_ROPE)),
    "vaultgemma_caps_windows": Case(lambda: VaultGemmaConfig(
        **THREE, head_dim=8, sliding_window=5, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh")),
    "persimmon_qk_layernorm": Case(lambda: PersimmonConfig(**{k: v for k, v in TINY.items()
                                                              if k != "num_key_value_heads"})),
    "internlm3_all_biases": Case(lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
                                 edit_config=as_internlm3(qkv_bias=True, bias=True)),
    "internlm3_qkv_bias": Case(lambda: Qwen2Config(**TINY), edit_config=as_internlm3(qkv_bias=True, bias=False)),
}

globals().update(family_parity_tests(CASES))


saved = saved_on_demand(CASES)


# ---- each new config value is really exercised: without it the logits move far past the tolerance ----

def _drop_alpha(config: dict) -> None:
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}


FEATURES = {
    "granite_embedding_multiplier": ("granite_multipliers_bias", lambda c: c.update(embedding_multiplier=1.0)),
    "granite_attention_multiplier": ("granite_multipliers_bias", lambda c: c.update(attention_multiplier=1 / 8 ** 0.5)),
    "granite_residual_multiplier": ("granite_multipliers_bias", lambda c: c.update(residual_multiplier=1.0)),
    "granite_logits_scaling": ("granite_tied", lambda c: c.update(logits_scaling=1.0)),
    "ministral3_query_scale": ("ministral3_query_scale_yarn",
                               lambda c: c["rope_parameters"].update(llama_4_scaling_beta=0.0)),
    "hunyuan_ntk_alpha": ("hunyuan_dense_ntk_alpha_bias", _drop_alpha),
    "cohere_logit_scale": ("cohere_untied", lambda c: c.update(logit_scale=1.0)),
    "exaone4_nope_full_layers": ("exaone4_sliding_nope_full", lambda c: c.update(sliding_window=None)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_new_config_value_changes_the_logits(saved, feature, tmp_path):
    """The parity above is not parity of models without the feature: the same weights with the value
    neutralised give logits far from transformers' (and ours follow the edited value)."""
    case_name, edit = FEATURES[feature]
    case = saved(case_name)
    with torch.no_grad():
        changed = wb.load_model(_copy(case.directory, tmp_path, edit))(case.tokens)
    assert max_diff(changed, case.logits) > 100 * TOLERANCE


def test_config_values_map_as_written(saved):
    case = saved("granite_multipliers_bias")
    granite = wb.load_model(case.directory)
    assert granite.cfg.embed_scale == 3.0
    assert granite.cfg.attn_scale == pytest.approx(1 / 0.3) and granite.cfg.logits_scale == pytest.approx(1 / 2.5)
    # residual_multiplier 0.6 folded into each sublayer's output weights and biases
    hf_layer = case.hf_model.model.layers[1]
    for ours, theirs in ((granite.blocks[1].attn._W_O_lin, hf_layer.self_attn.o_proj.weight),
                         (granite.blocks[1].attn.b_O, hf_layer.self_attn.o_proj.bias),
                         (granite.blocks[1].mlp._W_out_lin, hf_layer.mlp.down_proj.weight),
                         (granite.blocks[1].mlp.b_out, hf_layer.mlp.down_proj.bias)):
        assert torch.allclose(ours, 0.6 * theirs)
    with torch.no_grad():  # so the heads' results add up to what joins the residual stream
        _, cache = granite.run_with_cache(case.tokens[:1], names_filter=lambda n: n.startswith("blocks.0.") and
                                          n.endswith(("attn.hook_result", "hook_attn_out")))
    heads_sum = cache["blocks.0.attn.hook_result"].sum(2) + granite.blocks[0].attn.b_O
    assert max_diff(heads_sum, cache["blocks.0.hook_attn_out"]) < TOLERANCE
    ministral3 = wb.load_model(saved("ministral3_query_scale_yarn").directory).cfg
    assert (ministral3.query_scale_beta, ministral3.query_scale_length) == (0.5, 8)
    exaone4 = wb.load_model(saved("exaone4_sliding_nope_full").directory).cfg
    assert exaone4.layer_values("positional") == ["rotary", "none", "rotary"]
    assert exaone4.layer_values("sliding_window") == [5, None, 5]
    cohere2 = wb.load_model(saved("cohere2_sliding_rope_layers").directory).cfg
    assert cohere2.parallel_attn_mlp and cohere2.layer_values("positional") == ["rotary", "none", "rotary"]
    glm = wb.load_model(saved("glm_partial_rotary").directory).cfg
    assert (glm.rotary_dim, glm.rotary_adjacent_pairs) == (4, True)
    hunyuan = wb.load_model(saved("hunyuan_dense_ntk_alpha_bias").directory).cfg
    assert hunyuan.rotary_base == pytest.approx(10000.0 * 4.0 ** (8 / 6)) and hunyuan.qk_norm_after_rotary


# ---- padded batches: the position-dependent values (query scaling, NoPE layers, windows) per row ----

PADDED = ["ministral3_query_scale_yarn", "cohere2_sliding_rope_layers", "exaone4_sliding_nope_full",
          "granite_multipliers_bias", "hunyuan_dense_ntk_alpha_bias", "glm4_sandwich"]


@pytest.mark.parametrize("name", PADDED)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_equal_transformers_at_every_real_position(saved, name, side):
    case = saved(name)
    tokens, mask = padded_batch(side)
    ours = wb.load_model(case.directory)
    with torch.no_grad():
        expected = case.hf_model(tokens, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        real = mask.bool()
        for kernel in KERNELS:
            logits = ours.set_attn_impl(kernel)(tokens, attention_mask=mask)
            assert max_diff(logits[real], expected[real]) < TOLERANCE, (name, side, kernel)


# ---- values we cannot honour: an error naming the field (or the architecture) before any weight is read ----

REFUSALS = {
    "ministral3_without_query_scale_beta": (
        "ministral3_query_scale_yarn", lambda c: c["rope_parameters"].pop("llama_4_scaling_beta"),
        "rope_parameters[.]llama_4_scaling_beta"),
    "granite_partial_rotary": ("granite_tied", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
                               "rope_parameters[.]partial_rotary_factor"),
    "granite_sliding_window": ("granite_tied", lambda c: c.update(sliding_window=5), "sliding_window"),
    "granite_residual_multiplier": ("granite_tied", lambda c: c.update(residual_multiplier="0.5"),
                                    "residual_multiplier"),
    "apertus_activation": ("apertus_xielu_llama3_rope", lambda c: c.update(hidden_act="mish"), "hidden_act"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_unhonourable_config_value_is_refused_by_field_before_reading_weights(saved, refusal, tmp_path, monkeypatch):
    case, edit, field = REFUSALS[refusal]
    directory = _copy(saved(case).directory, tmp_path, edit)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were opened before the config was checked")

    monkeypatch.setattr(hf_loading, "SafetensorsCheckpoint", no_weights)
    with pytest.raises(wb.ConfigError, match=rf"config\.json: .*'{field}'"):
        wb.load_model(directory)


def test_gemma4_is_refused_naming_the_components_it_needs(saved, tmp_path):
    """transformers 5.24's Gemma4ForCausalLM (per-layer inputs, shared KV layers ...): refused by name, not as unknown."""
    directory = _copy(saved("vaultgemma_caps_windows").directory, tmp_path,
                      lambda c: c.update(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text"))
    with pytest.raises(wb.CheckpointError, match="'Gemma4ForCausalLM' is not supported: .*per-layer input embeddings"):
        wb.load_model(directory)


@pytest.mark.parametrize("architecture, model_type, reason", [
    ("BitNetForCausalLM", "bitnet", "ternary BitLinear weights"),
])
def test_components_we_lack_are_refused_by_architecture(saved, tmp_path, architecture, model_type, reason):
    """BitNet: refused by name with the component they need, not as unknown."""
    directory = _copy(saved("granite_tied").directory, tmp_path,
                      lambda c: c.update(architectures=[architecture], model_type=model_type))
    with pytest.raises(wb.CheckpointError, match=f"'{architecture}' is not supported: .*{reason}"):
        wb.load_model(directory)


def test_cohere_one_norm_loads_as_two_editable_copies(saved):
    """Cohere's input_layernorm feeds attention and MLP: ln1 and ln2 hold its values in storage of their own."""
    model = wb.load_model(saved("cohere_qk_norm_bias").directory)
    ln1, ln2 = model.blocks[0].ln1.w, model.blocks[0].ln2.w
    assert torch.equal(ln1, ln2) and ln1.data_ptr() != ln2.data_ptr()
    assert torch.equal(model.blocks[0].attn.q_norm.b, torch.zeros_like(model.blocks[0].attn.q_norm.b))


def test_logit_scale_is_in_the_token_directions_and_the_loss(saved):
    """Cohere's logit_scale: a final normed residual's dot with a token's direction is that token's logit, and
    the tiled loss from the residual stream equals the loss of the logits."""
    case = saved("cohere_untied")
    model = wb.load_model(case.directory)
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    with torch.no_grad():
        logits, cache = model.run_with_cache(case.tokens, names_filter=lambda n: n in ("ln_final.hook_normalized", last))
        directions = model.tokens_to_residual_directions(torch.arange(7))
        assert max_diff(cache["ln_final.hook_normalized"] @ directions.T, logits[..., :7]) < TOLERANCE
        losses = model.loss_from_resid(cache[last][:, :-1], case.tokens[:, 1:])
        assert max_diff(losses, model.loss_fn(logits, case.tokens, per_token=True)) < TOLERANCE
