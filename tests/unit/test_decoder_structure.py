"""Shape invariance, causality and the hook-point table of DESIGN.md, for every variant."""

import pytest
import torch

from tests.unit.helpers import VARIANTS, make_model

B, P = 2, 11


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_block_maps_residual_to_itself(variant):
    model = make_model(variant)
    resid = torch.randn(B, P, model.cfg.d_model)
    positions = torch.arange(P)
    for block in model.blocks:
        assert block(resid, positions).shape == (B, P, model.cfg.d_model)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("attn_impl", ["eager", "sdpa", "flash"])
def test_causality_later_token_changes_no_earlier_logit(variant, attn_impl):
    model = make_model(variant, attn_impl=attn_impl)
    tokens = torch.randint(0, model.cfg.d_vocab, (B, P))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % model.cfg.d_vocab
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4  # and the change does reach later positions


def expected_hook_shapes(cfg, b, p):
    """DESIGN.md's hook table, written out independently of the model code."""
    D, H, G, K, M = cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_mlp
    shapes = {"hook_embed": (b, p, D)}
    if cfg.positional in ("learned", "sinusoidal"):
        shapes["hook_pos_embed"] = (b, p, D)
    for l in range(cfg.n_layers):
        pre = f"blocks.{l}."
        shapes.update({
            pre + "hook_resid_pre": (b, p, D), pre + "hook_resid_post": (b, p, D),
            pre + "ln1.hook_scale": (b, p, 1), pre + "ln1.hook_normalized": (b, p, D),
            pre + "attn.hook_q": (b, p, H, K), pre + "attn.hook_k": (b, p, G, K), pre + "attn.hook_v": (b, p, G, K),
            pre + "attn.hook_attn_scores": (b, H, p, p), pre + "attn.hook_pattern": (b, H, p, p),
            pre + "attn.hook_z": (b, p, H, K), pre + "attn.hook_result": (b, p, H, D),
            pre + "hook_attn_out": (b, p, D),
        })
        if cfg.positional == "rotary":
            shapes.update({pre + "attn.hook_rot_q": (b, p, H, K), pre + "attn.hook_rot_k": (b, p, G, K)})
        if not cfg.attn_only:
            shapes.update({pre + "hook_resid_mid": (b, p, D), pre + "hook_mlp_out": (b, p, D), pre + "hook_mlp_in": (b, p, D),
                           pre + "ln2.hook_scale": (b, p, 1), pre + "ln2.hook_normalized": (b, p, D)})
            if cfg.num_experts:
                E, k = cfg.num_experts, cfg.experts_per_token
                shapes.update({pre + "mlp.hook_router_logits": (b, p, E), pre + "mlp.hook_expert_weights": (b, p, k),
                               pre + "mlp.hook_expert_indices": (b, p, k)})
            else:
                shapes.update({pre + "mlp.hook_pre": (b, p, M), pre + "mlp.hook_post": (b, p, M)})
                if cfg.gated_mlp:
                    shapes[pre + "mlp.hook_pre_linear"] = (b, p, M)
    if cfg.norm_placement == "pre":
        shapes.update({"ln_final.hook_scale": (b, p, 1), "ln_final.hook_normalized": (b, p, D)})
    return shapes


@pytest.mark.parametrize("variant", VARIANTS)
def test_hook_points_have_design_names_and_shapes(variant):
    model = make_model(variant)
    _, cache = model.run_with_cache(torch.randint(0, model.cfg.d_vocab, (B, P)), names_filter=lambda name: True)
    got = {name: tuple(t.shape) for name, t in cache.items()}
    assert got == expected_hook_shapes(model.cfg, B, P)


def test_caching_every_hook_leaves_out_hook_result_unless_asked_as_transformer_lens_does():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, model.cfg.d_vocab, (B, P))
    every = set(expected_hook_shapes(model.cfg, B, P))
    result_hooks = {f"blocks.{l}.attn.hook_result" for l in range(model.cfg.n_layers)}
    mlp_in_hooks = {f"blocks.{l}.hook_mlp_in" for l in range(model.cfg.n_layers)}  # opt-in too, as in TransformerLens
    _, cache = model.run_with_cache(tokens)
    assert set(cache.keys()) == every - result_hooks - mlp_in_hooks
    _, cache = model.run_with_cache(tokens, names_filter=sorted(result_hooks))
    assert set(cache.keys()) == result_hooks
    model.set_use_attn_result(True)
    _, cache = model.run_with_cache(tokens)
    assert set(cache.keys()) == every - mlp_in_hooks


def test_residual_stream_decomposes_into_hooked_parts():
    model = make_model("gqa_rotary_rms_swiglu")
    _, cache = model.run_with_cache(torch.randint(0, model.cfg.d_vocab, (B, P)), names_filter=lambda name: True)
    for l in range(model.cfg.n_layers):
        torch.testing.assert_close(cache[f"blocks.{l}.hook_resid_mid"],
                                   cache[f"blocks.{l}.hook_resid_pre"] + cache[f"blocks.{l}.hook_attn_out"])
        torch.testing.assert_close(cache[f"blocks.{l}.hook_resid_post"],
                                   cache[f"blocks.{l}.hook_resid_mid"] + cache[f"blocks.{l}.hook_mlp_out"])
        # hook_result sums over heads (plus bias, absent here) to the attention output
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_result"].sum(2), cache[f"blocks.{l}.hook_attn_out"],
                                   atol=1e-5, rtol=1e-5)


def test_tied_embeddings_share_one_tensor():
    model = make_model("attn_only_tied")
    # one tensor under two names: W_U [d_model, d_vocab] is W_E [d_vocab, d_model] transposed, same storage
    assert model.unembed.W_U.data_ptr() == model.embed.W_E.data_ptr() and model.unembed.W_U.shape == (32, 61)
    assert len([p for p in model.parameters() if p.shape == (61, 32)]) == 1
    assert sum(1 for _ in model.parameters()) == len({id(p) for p in model.parameters()})
