"""Direct logit attribution and information flow on sandwich-norm (Gemma 2/3: x + ln_post(f(ln(x)))) and
sublayer_output (OLMo 2: x + ln_post(f(x))) blocks, and their refusal of post-norm ones (ln(x + f(x))).

Expected values come from transformers (a tiny random Gemma 3 written by transformers, with attention biases so
b_O is a component too) or from hand identities: with the norm's divisor frozen at its value on this input,
RMSNorm is x / rms * gain, so head h's share of ln1_post(attention output) is (head h's output) / rms * gain.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

import workbench as wb
from experiments import flow
from experiments.lens import direct_logit_attribution
from tests.integration.family_parity import build_and_save

TOLERANCE = 1e-4
SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3 = dict(vocab_size=101, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=3, intermediate_size=80, max_position_embeddings=64, sliding_window=5,
              layer_types=[SLIDING, FULL, SLIDING], query_pre_attn_scalar=8, attention_bias=True)
TARGETS, BASELINES = [5, 17], [40, 3]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float().pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Our model loaded from a transformers-written tiny Gemma 3, and what transformers computed on two prompts:
    its logits, hidden states and, per layer, o_proj's input and output, v_proj's output and the post norms'
    outputs (hooks on transformers' modules), plus the final norm's input."""
    directory = tmp_path_factory.mktemp("gemma3-sandwich")
    hf = build_and_save(Gemma3TextConfig(**GEMMA3), directory)
    assert hf.config.final_logit_softcapping is None  # Gemma 3: logits linear in the final residual
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    seen: dict[str, torch.Tensor] = {}

    def keep(name, which="output"):
        def hook(module, inputs, output):
            seen[name] = (inputs[0] if which == "input" else output).detach()
        return hook

    handles = [hf.model.norm.register_forward_hook(keep("final_resid", "input"))]
    for l, layer in enumerate(hf.model.layers):
        handles += [layer.self_attn.o_proj.register_forward_hook(keep(f"{l}.o_in", "input")),
                    layer.self_attn.o_proj.register_forward_hook(keep(f"{l}.o_out")),
                    layer.self_attn.v_proj.register_forward_hook(keep(f"{l}.v")),
                    layer.post_attention_layernorm.register_forward_hook(keep(f"{l}.attn_normed")),
                    layer.post_feedforward_layernorm.register_forward_hook(keep(f"{l}.mlp_normed"))]
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True, output_attentions=True)
    for handle in handles:
        handle.remove()
    model = wb.load_model(directory, attn_impl="eager")
    assert model.cfg.norm_placement == "sandwich"
    return model, hf, tokens, out, seen


def _hand_final(hf, seen, vectors: torch.Tensor) -> torch.Tensor:
    """Vectors [B, ..., D] through transformers' final Gemma RMSNorm with its divisor frozen at each prompt's last
    position, dotted with W_U[target] - W_U[baseline]: each prompt's direct share [B, ...]."""
    final_B1 = _rms(seen["final_resid"][:, -1], hf.config.rms_norm_eps)
    gain_D = 1 + hf.model.norm.weight.float()  # Gemma's RMSNorm multiplies by 1 + w
    W_U = hf.lm_head.weight.float()
    direction_BD = W_U[TARGETS] - W_U[BASELINES]
    shape = (-1,) + (1,) * (vectors.dim() - 2) + (1,)
    normed = vectors.float() / final_B1.reshape(shape) * gain_D
    return torch.einsum("b...d,bd->b...", normed, direction_BD)


def _hand_attention_heads(hf, seen, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each head's output [B, H, D], b_O [B, D]) at the last position through transformers' post-attention norm,
    its divisor frozen at the whole attention output's rms there: they sum to that norm's output."""
    cfg, attn = hf.config, hf.model.layers[layer].self_attn
    H, K = cfg.num_attention_heads, cfg.head_dim
    post_B1 = _rms(seen[f"{layer}.o_out"][:, -1], cfg.rms_norm_eps)
    gain_D = 1 + hf.model.layers[layer].post_attention_layernorm.weight.float()
    z_BHK = seen[f"{layer}.o_in"][:, -1].float().reshape(-1, H, K)
    W_O_DHK = attn.o_proj.weight.float().reshape(-1, H, K)
    heads_BHD = torch.einsum("bhk,dhk->bhd", z_BHK, W_O_DHK) / post_B1[:, None] * gain_D
    bias_BD = attn.o_proj.bias.float() / post_B1 * gain_D
    return heads_BHD, bias_BD


def test_dla_on_gemma3_sums_to_transformers_logit_difference_and_each_part_is_its_hand_share(gemma):
    model, hf, tokens, out, seen = gemma
    dla = direct_logit_attribution(model, tokens, TARGETS, BASELINES, per_prompt=True)
    logits_BV = out.logits[:, -1].float()
    expected_B = logits_BV[[0, 1], TARGETS] - logits_BV[[0, 1], BASELINES]
    by_prompt = dla.groupby("prompt").attribution.sum().to_numpy()
    assert torch.allclose(torch.tensor(by_prompt), expected_B, atol=TOLERANCE), (by_prompt, expected_B)
    assert set(dla.component) == {"embed", "head", "attn_bias", "mlp"}  # RMSNorm: no norm biases

    def rows(component: str, layer: int) -> torch.Tensor:  # [B, n] in head order
        picked = dla[(dla.component == component) & (dla.layer == layer)].sort_values(["head", "prompt"])
        return torch.tensor(picked.attribution.to_numpy()).reshape(-1, 2).T.float()

    embedded_BD = out.hidden_states[0][:, -1]  # transformers' scaled embedding
    assert torch.allclose(rows("embed", -1)[:, 0], _hand_final(hf, seen, embedded_BD), atol=TOLERANCE)
    for l in range(hf.config.num_hidden_layers):
        heads_BHD, bias_BD = _hand_attention_heads(hf, seen, l)
        assert torch.allclose(rows("head", l), _hand_final(hf, seen, heads_BHD), atol=TOLERANCE)
        assert torch.allclose(rows("attn_bias", l)[:, 0], _hand_final(hf, seen, bias_BD), atol=TOLERANCE)
        # per sublayer: the shares add up to the post-normed output read through the frozen final norm
        attention_B = rows("head", l).sum(1) + rows("attn_bias", l)[:, 0]
        assert torch.allclose(attention_B, _hand_final(hf, seen, seen[f"{l}.attn_normed"][:, -1]), atol=TOLERANCE)
        assert torch.allclose(rows("mlp", l)[:, 0], _hand_final(hf, seen, seen[f"{l}.mlp_normed"][:, -1]),
                              atol=TOLERANCE)


def test_flow_parts_on_gemma3_are_transformers_terms_and_sum_to_each_residual_update(gemma):
    model, hf, tokens, out, seen = gemma
    cfg = hf.config
    H, G, K = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cache = flow.run_flow_cache(model, tokens[:1])
    for l in range(cfg.num_hidden_layers):
        # by hand from transformers: c_ijh = A[h, i, j] * v[j, kv(h)] @ W_O[h] / rms_i * (1 + w), rms of o_proj's output
        attn, post = hf.model.layers[l].self_attn, hf.model.layers[l].post_attention_layernorm
        v_SHK = seen[f"{l}.v"][0].float().reshape(-1, G, K).repeat_interleave(H // G, dim=1)
        W_O_DHK = attn.o_proj.weight.float().reshape(-1, H, K)
        vo_SHD = torch.einsum("shk,dhk->shd", v_SHK, W_O_DHK)
        post_P1 = _rms(seen[f"{l}.o_out"][0], cfg.rms_norm_eps)
        gain_D = 1 + post.weight.float()
        A_PSH = out.attentions[l][0].float().permute(1, 2, 0)
        expected_PSHD = A_PSH[..., None] * vo_SHD[None] / post_P1[:, :, None, None] * gain_D
        parts_PSHD = flow.attention_by_source(model, cache, l)
        assert torch.allclose(parts_PSHD, expected_PSHD, atol=TOLERANCE)
        # the parts, plus b_O through the frozen norm, are transformers' residual update after attention
        bias_PD = attn.o_proj.bias.float() / post_P1 * gain_D
        assert torch.allclose(parts_PSHD.sum((1, 2)) + bias_PD, seen[f"{l}.attn_normed"][0].float(), atol=TOLERANCE)
        # and the MLP's part (hook_mlp_out) is transformers' update after the MLP
        assert torch.allclose(cache[f"blocks.{l}.hook_mlp_out"][0], seen[f"{l}.mlp_normed"][0], atol=TOLERANCE)
        resid_mid = cache[f"blocks.{l}.hook_resid_pre"][0] + seen[f"{l}.attn_normed"][0]
        assert torch.allclose(cache[f"blocks.{l}.hook_resid_mid"][0], resid_mid, atol=TOLERANCE)
    c = flow.flow_contributions(model, tokens[:1])
    attention_sums = c.attn_LPSH.sum((2, 3)) + c.attn_resid_LP + c.attn_bias_LP
    assert torch.allclose(attention_sums, torch.ones_like(attention_sums), atol=1e-5)
    assert torch.allclose(c.mlp_LP + c.mlp_resid_LP, torch.ones_like(c.mlp_LP), atol=1e-5)
    assert bool((c.attn_bias_LP > flow.EPS).any())  # b_O, normed, is a part of its own
    nodes, edges = flow.flow_graph(c, position=-1, threshold=0.01)
    assert len(edges) > 0 and nodes.node[0] == f"L{cfg.num_hidden_layers - 1}.post:11"


def _random(norm_placement: str, normalization: str) -> wb.Decoder:
    torch.manual_seed(0)
    cfg = wb.ModelConfig(n_layers=2, d_model=16, n_heads=4, d_head=4, d_mlp=32, d_vocab=30, n_ctx=16,
                         positional="rotary", normalization=normalization, norm_placement=norm_placement,
                         attn_bias=True)
    model = wb.Decoder(cfg).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # gains away from 1, biases away from 0
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def _divisor(x: torch.Tensor, normalization: str, eps: float) -> torch.Tensor:
    """A norm's divisor by hand: sqrt(mean(x^2) + eps) for RMSNorm, of the centred x for LayerNorm."""
    return (_centred(x, normalization).pow(2).mean(-1, keepdim=True) + eps).sqrt()


def _centred(x: torch.Tensor, normalization: str) -> torch.Tensor:
    x = x.float()
    return x - x.mean(-1, keepdim=True) if normalization == "LN" else x


def _attention_before_its_norm(model: wb.Decoder, cache, layer: int) -> torch.Tensor:
    """Attention's output before ln1_post, by hand from hook_z, W_O and b_O: [B, P, D]."""
    return torch.einsum("bphk,hkd->bpd", cache[f"blocks.{layer}.attn.hook_z"].float(),
                        model.layer_W_O(layer).float()) + model.layer_b_O(layer).float()


@pytest.mark.parametrize("norm_placement, normalization",
                         [("sandwich", "LN"), ("sublayer_output", "RMS"), ("sublayer_output", "LN")])
def test_dla_shares_sum_per_sublayer_and_overall_on_random_output_normed_models(norm_placement, normalization):
    model = _random(norm_placement, normalization)
    tokens = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(1))
    dla = direct_logit_attribution(model, tokens, [3, 4], [5, 6], per_prompt=True)
    logits, cache = model.run_with_cache(tokens)
    expected_B = logits[[0, 1], -1, [3, 4]] - logits[[0, 1], -1, [5, 6]]
    total_B = torch.tensor(dla.groupby("prompt").attribution.sum().to_numpy())
    assert torch.allclose(total_B, expected_B.float(), atol=TOLERANCE)
    eps = model.cfg.norm_eps
    final_B1 = _divisor(cache["blocks.1.hook_resid_post"][:, -1], normalization, eps)
    W_U = model.W_U.float()
    direction_BD = (W_U[:, [3, 4]] - W_U[:, [5, 6]]).T
    for l in range(2):
        # the attention rows of a layer sum to its post-normed output through the frozen final norm (without the
        # final norm's bias, a row of its own)
        normed_BD = _centred(cache[f"blocks.{l}.hook_attn_out"][:, -1], normalization) / final_B1
        expected_B = (normed_BD * model.ln_final.w.float() * direction_BD).sum(-1)
        picked = dla[(dla.layer == l) & dla.component.isin(["head", "attn_bias", "attn_norm_bias"])]
        got_B = torch.tensor(picked.groupby("prompt").attribution.sum().to_numpy())
        assert torch.allclose(got_B, expected_B, atol=TOLERANCE), (norm_placement, normalization, l)
        # and each head's share is its output through ln1_post with the divisor frozen, by hand
        post_B1 = _divisor(_attention_before_its_norm(model, cache, l)[:, -1], normalization, eps)
        head_BHD = torch.einsum("bhk,hkd->bhd", cache[f"blocks.{l}.attn.hook_z"][:, -1].float(),
                                model.layer_W_O(l).float())
        head_BHD = _centred(head_BHD, normalization) / post_B1[:, None] * model.blocks[l].ln1_post.w.float()
        head_BHD = _centred(head_BHD, normalization) / final_B1[:, None] * model.ln_final.w.float()
        expected_BH = torch.einsum("bhd,bd->bh", head_BHD, direction_BD)
        heads = dla[(dla.layer == l) & (dla.component == "head")].sort_values(["prompt", "head"])
        assert torch.allclose(torch.tensor(heads.attribution.to_numpy()).reshape(2, -1), expected_BH, atol=TOLERANCE)
    assert ("attn_norm_bias" in set(dla.component)) == (normalization == "LN")


@pytest.mark.parametrize("norm_placement", ["sandwich", "sublayer_output"])
def test_flow_parts_sum_to_each_attention_update_on_random_output_normed_models(norm_placement):
    model = _random(norm_placement, "RMS")
    tokens = torch.randint(0, 30, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = flow.run_flow_cache(model, tokens)
    _, full = model.run_with_cache(tokens)
    for l in range(2):
        # b_O through ln1_post by hand, its divisor frozen per position at the rms of attention's output there
        post_P1 = _divisor(_attention_before_its_norm(model, full, l)[0], "RMS", model.cfg.norm_eps)
        bias_PD = model.layer_b_O(l).float() / post_P1 * model.blocks[l].ln1_post.w.float()
        update = flow.attention_by_source(model, cache, l).sum((1, 2)) + bias_PD
        resid_pre, resid_mid = cache[f"blocks.{l}.hook_resid_pre"][0], cache[f"blocks.{l}.hook_resid_mid"][0]
        assert torch.allclose(resid_pre + update, resid_mid, atol=TOLERANCE)  # the parts sum to the update
    c = flow.flow_contributions(model, tokens)
    sums = c.attn_LPSH.sum((2, 3)) + c.attn_resid_LP + c.attn_bias_LP
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)


def test_post_norm_models_are_still_refused_with_a_clear_error():
    torch.manual_seed(0)
    post = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=4, d_vocab=30, n_ctx=16, d_mlp=32,
                                     norm_placement="post")).eval()
    tokens = torch.randint(0, 30, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(wb.InputError, match=r"post-norm, ln\(x \+ f\(x\)\)"):
        direct_logit_attribution(post, tokens, 3, 4)
    with pytest.raises(wb.InputError, match=r"information flow .* post-norm, ln\(x \+ f\(x\)\)"):
        flow.flow_contributions(post, tokens)
    with pytest.raises(wb.InputError, match="post-norm"):
        flow.vocab_projection(post, tokens, layer=0, position=-1)
    with pytest.raises(wb.InputError, match=r"post-norm block norms the residual sum"):
        post.apply_output_norm(0, "attn", torch.zeros(16))
