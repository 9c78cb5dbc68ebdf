"""Router experiments on mixture-of-experts models: a Mixtral-style one, and one of each family's shape
(DeepSeek-V2/V3 with dense first layers, latent attention and shared experts, Qwen2-MoE with a gated
shared expert, Qwen3-MoE, gpt-oss).

References: top-k of the softmax of the router logits recomputed here from the MLP input
(ln2's output) and ``W_router``, a model copy whose expert was removed by zeroing its output
weights, and for the families counts, entropies and norms worked out by hand from the hooks of a
separate run (the routed part also from each chosen expert's own forward).
"""

import json

import pandas as pd
import pytest
import torch

import workbench as wb
from experiments.ablation import AblationTarget, run_ablated
from experiments.cli.router import main as router_main
from experiments.plots.router import expert_load_figure, shared_vs_routed_figure
from experiments.router import (expert_ablation_effect, expert_load, router_entropy, routing, shared_expert_layers,
                                shared_vs_routed, token_expert_choices, top_expert_predictability)
from tests.unit.helpers import make_model, same_weights


@pytest.fixture(scope="module")
def model():
    return make_model("moe_gqa")  # 4 experts, 2 per token


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def router_probs(model, tokens):
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("ln2.hook_normalized"))
    return [(cache[f"blocks.{l}.ln2.hook_normalized"] @ model.blocks[l].mlp.W_router).softmax(-1).detach()
            for l in range(2)]


def test_expert_load_counts_the_top_k_choices(model, tokens, router_probs):
    df = expert_load(model, tokens)
    assert list(df.columns) == ["layer", "expert", "count", "fraction", "token_fraction"]
    for layer in range(2):
        chosen = router_probs[layer].topk(2, dim=-1).indices
        expected = torch.bincount(chosen.flatten(), minlength=4)
        rows = df[df.layer == layer]
        assert rows["count"].tolist() == expected.tolist()
        assert rows.fraction.sum() == pytest.approx(1.0)
        # token_fraction: share of tokens that have the expert among their two, so it sums to k = 2
        chose_expert_NE = torch.stack([(chosen == e).any(-1).flatten() for e in range(4)], dim=-1)
        assert rows.token_fraction.tolist() == pytest.approx(chose_expert_NE.float().mean(0).tolist())
        assert rows.token_fraction.sum() == pytest.approx(2.0)
    assert expert_load_figure(df).data


def test_router_entropy(model, tokens, router_probs):
    df = router_entropy(model, tokens)
    p = router_probs[1]
    expected = -(p * p.log()).sum(-1).mean(0)
    torch.testing.assert_close(torch.tensor(df[df.layer == 1].entropy.values).float(), expected, rtol=1e-5, atol=1e-6)


def test_token_expert_choices(model, tokens, router_probs):
    df = token_expert_choices(model, tokens)
    assert list(df.columns) == ["position", "token", "layer", "experts", "weights"]
    assert len(df) == 2 * tokens.shape[1]
    top = router_probs[0][0, 3].topk(2)
    row = df[(df.layer == 0) & (df.position == 3)].iloc[0]
    assert row.experts == top.indices.tolist()
    assert row.weights == pytest.approx((top.values / top.values.sum()).tolist(), abs=1e-5)


def test_expert_ablation_effect(model, tokens):
    edited = same_weights(model)
    with torch.no_grad():
        edited.blocks[0].mlp.W_out[1].zero_()
    effect = expert_ablation_effect(model, tokens, layer=0, expert=1)
    assert effect["clean_loss"] == pytest.approx(model(tokens, return_type="loss").item(), abs=1e-5)
    assert effect["ablated_loss"] == pytest.approx(edited(tokens, return_type="loss").item(), abs=1e-5)
    assert effect["delta"] == pytest.approx(effect["ablated_loss"] - effect["clean_loss"])


def test_dense_models_are_refused_with_a_clear_error(tokens):
    dense = make_model("mha_learned_ln")
    for fn in (expert_load, router_entropy, token_expert_choices):
        with pytest.raises(wb.InputError, match="not a mixture-of-experts model"):
            fn(dense, tokens)
    with pytest.raises(wb.InputError, match="not a mixture-of-experts model"):
        expert_ablation_effect(dense, tokens, 0, 0)


# ---- the mixture-of-experts families: DeepSeek-V2/V3, Qwen2/3-MoE, gpt-oss --------------------------------
# Expected values are worked out from the hooks of a separate run (run_with_cache / run_with_hooks) and the
# experts' own forward, never from the functions under test.
BASE_MOE = dict(d_model=32, n_heads=4, d_vocab=50, n_ctx=64, normalization="RMS", positional="rotary", act_fn="silu",
                gated_mlp=True, d_mlp=24)
LATENT = dict(d_head=12, rotary_dim=4, d_head_v=10, kv_lora_rank=16, q_lora_rank=20)
DENSE_FIRST = ({"num_experts": 0, "experts_per_token": 0, "d_mlp": 40}, {}, {})
FAMILIES = {
    "deepseek_v3": dict(n_layers=3, **LATENT, num_experts=8, experts_per_token=2, router_scoring="sigmoid",
                        router_score_correction=True, router_groups=4, router_topk_groups=2,
                        router_group_score="top2_sum", routed_scaling_factor=2.5, d_shared_expert=20,
                        layer_overrides=DENSE_FIRST),
    "deepseek_v2": dict(n_layers=3, **LATENT, num_experts=8, experts_per_token=2, router_renormalize=False,
                        router_groups=4, router_topk_groups=2, router_group_score="max", d_shared_expert=20,
                        layer_overrides=DENSE_FIRST),
    "qwen2_moe": dict(n_layers=2, n_key_value_heads=2, d_head=8, num_experts=6, experts_per_token=2,
                      router_renormalize=False, d_shared_expert=20, shared_expert_gate=True, attn_bias=True),
    # Qwen3-MoE shape, with a different expert count in each layer
    "qwen3_moe": dict(n_layers=2, n_key_value_heads=2, d_head=8, num_experts=4, experts_per_token=2,
                      layer_overrides=({}, {"num_experts": 6})),
    "gpt_oss": dict(n_layers=2, n_key_value_heads=2, d_head=8, num_experts=4, experts_per_token=2,
                    router_scoring="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=7.0,
                    swiglu_alpha=1.702, attn_sinks=True, attn_bias=True),
}
SHARED = ["deepseek_v3", "deepseek_v2", "qwen2_moe"]
WITH_DENSE_LAYERS = ["deepseek_v3", "deepseek_v2"]


def family_model(name: str) -> wb.Decoder:
    """A random model of the family's shape, with weights large enough that routing differs token to token."""
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig.from_dict({**BASE_MOE, **FAMILIES[name]}))  # flat names, as saved
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.normal_(1.0 if param_name.endswith(".w") else 0.0, 0.1 if param_name.endswith(".w") else 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def families():
    return {name: family_model(name) for name in FAMILIES}


@pytest.fixture(scope="module")
def family_tokens():
    return torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))


def moe_hooks(model, tokens, *hooks):
    """The named MLP hooks of every MoE layer in a plain run_with_cache: {(layer, hook): tensor}."""
    names = {f"blocks.{l}.{hook}": (l, hook) for l in model.cfg.moe_layers for hook in hooks}
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return {key: cache[name] for name, key in names.items()}


def test_families_have_the_layers_the_tests_rely_on(families):
    assert families["deepseek_v3"].cfg.moe_layers == [1, 2] == families["deepseek_v2"].cfg.moe_layers
    assert families["qwen3_moe"].cfg.layer_values("num_experts") == [4, 6]
    assert {n for n, m in families.items() if any("hook_shared_out" in h for h in m.hook_dict)} == set(SHARED)


@pytest.mark.parametrize("name", FAMILIES)
def test_expert_load_is_a_hand_count_of_hook_expert_indices(families, family_tokens, name):
    model = families[name]
    indices = moe_hooks(model, family_tokens, "mlp.hook_expert_indices")
    df = expert_load(model, family_tokens)
    assert sorted(set(df.layer)) == model.cfg.moe_layers
    for layer in model.cfg.moe_layers:
        chosen_BPk = indices[layer, "mlp.hook_expert_indices"]
        n_experts = model.cfg.layer_values("num_experts")[layer]
        counts = [int((chosen_BPk == e).sum()) for e in range(n_experts)]
        rows = df[df.layer == layer]
        assert rows.expert.tolist() == list(range(n_experts))  # the layer's own expert count
        assert rows["count"].tolist() == counts
        assert rows.fraction.tolist() == pytest.approx([c / chosen_BPk.numel() for c in counts])
        assert rows.token_fraction.sum() == pytest.approx(2.0)
    assert expert_load_figure(df).data[0].z.shape == (len(model.cfg.moe_layers), df.expert.max() + 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_router_entropy_is_the_entropy_of_each_scoring(families, family_tokens, name):
    model = families[name]
    logits = moe_hooks(model, family_tokens, "mlp.hook_router_logits")
    df = router_entropy(model, family_tokens)
    assert sorted(set(df.layer)) == model.cfg.moe_layers
    for layer in model.cfg.moe_layers:
        logits_BPE = logits[layer, "mlp.hook_router_logits"].double()
        if model.cfg.moe.router_scoring == "sigmoid":  # DeepSeek-V3: sigmoid scores normalised to sum to one
            scores = 1 / (1 + torch.exp(-logits_BPE))
            p = scores / scores.sum(-1, keepdim=True)
        else:  # softmax and gpt-oss's topk_softmax: the softmax over all experts' logits (router bias included)
            p = torch.exp(logits_BPE) / torch.exp(logits_BPE).sum(-1, keepdim=True)
        expected_P = -(p * p.log()).sum(-1).mean(0)
        got_P = torch.tensor(df[df.layer == layer].sort_values("position").entropy.values, dtype=torch.float64)
        torch.testing.assert_close(got_P, expected_P, rtol=1e-5, atol=1e-6)


def test_sigmoid_router_entropy_differs_from_the_softmax_of_its_logits(families, family_tokens):
    model = families["deepseek_v3"]
    logits_BPE = moe_hooks(model, family_tokens, "mlp.hook_router_logits")[1, "mlp.hook_router_logits"]
    softmax_entropy = float(-(logits_BPE.softmax(-1) * logits_BPE.log_softmax(-1)).sum(-1).mean())
    got = router_entropy(model, family_tokens).query("layer == 1").entropy.mean()
    assert abs(got - softmax_entropy) > 1e-3


@pytest.mark.parametrize("name", SHARED)
def test_shared_vs_routed_norms_equal_hand_norms(families, family_tokens, name):
    model = families[name]
    hooks = moe_hooks(model, family_tokens, "hook_mlp_out", "mlp.hook_shared_out", "ln2.hook_normalized",
                      "mlp.hook_expert_indices", "mlp.hook_expert_weights")
    df = shared_vs_routed(model, family_tokens)
    assert list(df.columns) == ["layer", "position", "routed_norm", "shared_norm", "shared_fraction"]
    assert sorted(set(df.layer)) == model.cfg.moe_layers
    for layer in model.cfg.moe_layers:
        shared_PD = hooks[layer, "mlp.hook_shared_out"][0]
        routed_PD = hooks[layer, "hook_mlp_out"][0] - shared_PD
        # the routed part is the chosen experts' weighted sum, run expert by expert
        x_PD, mlp = hooks[layer, "ln2.hook_normalized"][0], model.blocks[layer].mlp
        chosen_Pk, weights_Pk = hooks[layer, "mlp.hook_expert_indices"][0], hooks[layer, "mlp.hook_expert_weights"][0]
        by_expert_PD = torch.stack([sum(weights_Pk[p, s] * mlp.expert_forward(int(chosen_Pk[p, s]), x_PD[p:p + 1])[0]
                                        for s in range(chosen_Pk.shape[1])) for p in range(x_PD.shape[0])]).detach()
        torch.testing.assert_close(routed_PD, by_expert_PD, rtol=1e-4, atol=1e-5)
        rows = df[df.layer == layer].sort_values("position")
        assert rows.position.tolist() == list(range(family_tokens.shape[1]))  # batch row 0's positions
        routed, shared = routed_PD.norm(dim=-1), shared_PD.norm(dim=-1)
        assert rows.routed_norm.tolist() == pytest.approx(routed.tolist(), rel=1e-4)
        assert rows.shared_norm.tolist() == pytest.approx(shared.tolist(), rel=1e-4)
        assert rows.shared_fraction.tolist() == pytest.approx((shared / (routed + shared)).tolist(), rel=1e-4)
        assert 0 < rows.shared_fraction.min() and rows.shared_fraction.max() < 1
    fig = shared_vs_routed_figure(df, [f"t{p}" for p in range(family_tokens.shape[1])])
    assert fig.data[0].z.shape == (len(model.cfg.moe_layers), family_tokens.shape[1])
    assert list(fig.data[0].y) == [str(l) for l in model.cfg.moe_layers]


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_shared_vs_routed_needs_a_shared_expert(families, family_tokens, name):
    assert shared_expert_layers(families[name]) == []
    with pytest.raises(wb.InputError, match="no shared expert"):
        shared_vs_routed(families[name], family_tokens)


@pytest.mark.parametrize("name", WITH_DENSE_LAYERS)
def test_dense_layers_are_absent_from_every_table(families, family_tokens, name):
    model = families[name]
    moe_layers = [1, 2]  # layer 0 is dense
    assert sorted(routing(model, family_tokens)["logits"]) == moe_layers
    assert shared_expert_layers(model) == moe_layers
    for table in (expert_load(model, family_tokens), router_entropy(model, family_tokens),
                  token_expert_choices(model, family_tokens), shared_vs_routed(model, family_tokens)):
        assert sorted(set(table.layer)) == moe_layers
    assert top_expert_predictability(model, family_tokens)["layer"] == moe_layers


@pytest.mark.parametrize("name", WITH_DENSE_LAYERS)
def test_ablating_an_expert_of_a_dense_layer_names_the_layer(families, family_tokens, name):
    with pytest.raises(wb.InputError, match=r"layer 0 is a dense MLP layer.*\[1, 2\]"):
        expert_ablation_effect(families[name], family_tokens, layer=0, expert=0)
    with pytest.raises(wb.InputError, match="layer 0 is a dense MLP layer"):
        run_ablated(families[name], family_tokens, [AblationTarget("expert", 0, 0)], "zero")


def test_expert_index_is_checked_against_the_layers_own_count(families, family_tokens):
    model = families["qwen3_moe"]  # 4 experts in layer 0, 6 in layer 1
    with pytest.raises(wb.InputError, match=r"index must be in 0\.\.3"):
        expert_ablation_effect(model, family_tokens, layer=0, expert=5)
    effect = expert_ablation_effect(model, family_tokens, layer=1, expert=5)  # layer 1 has an expert 5
    assert effect["delta"] == pytest.approx(effect["ablated_loss"] - effect["clean_loss"])


@pytest.mark.parametrize("name", FAMILIES)
def test_ablated_loss_equals_zeroing_the_experts_weight_by_hand(families, family_tokens, name):
    model = families[name]
    layer = model.cfg.moe_layers[-1]
    # routing in `layer` depends only on its input, which ablating there leaves alone: the clean choices hold
    chosen_BPk = moe_hooks(model, family_tokens, "mlp.hook_expert_indices")[layer, "mlp.hook_expert_indices"]
    expert = int(torch.bincount(chosen_BPk.flatten()).argmax())  # the busiest, so the loss moves

    def zero_expert(weights_BPk, hook):
        return weights_BPk.masked_fill(chosen_BPk == expert, 0.0)

    with torch.no_grad():
        by_hand = model.run_with_hooks(family_tokens, return_type="loss",
                                       fwd_hooks=[(f"blocks.{layer}.mlp.hook_expert_weights", zero_expert)]).item()
        clean = model(family_tokens, return_type="loss").item()
    effect = expert_ablation_effect(model, family_tokens, layer=layer, expert=expert)
    assert effect["clean_loss"] == pytest.approx(clean, abs=1e-5)
    assert effect["ablated_loss"] == pytest.approx(by_hand, abs=1e-5)
    assert abs(effect["delta"]) > 1e-4


def test_router_command_on_a_model_with_dense_layers_and_shared_experts(families, tmp_path):
    families["deepseek_v3"].save(tmp_path / "model")
    router_main(["--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--no-progress"])
    load = pd.read_csv(tmp_path / "out" / "router.csv")
    assert sorted(set(load.layer)) == [1, 2] and len(load) == 2 * 8
    summary = json.loads((tmp_path / "out" / "router.json").read_text())
    assert summary["moe_layers"] == [1, 2] and set(summary["mean_router_entropy_by_layer"]) == {"1", "2"}
    shared = pd.read_csv(tmp_path / "out" / "router_shared.csv")
    assert sorted(set(shared.layer)) == [1, 2]
    assert (tmp_path / "out" / "router_shared.html").exists()
