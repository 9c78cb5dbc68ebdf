"""Router experiments on a mixture-of-experts model.

References: top-k of the softmax of the router logits recomputed here from the MLP input
(ln2's output) and ``W_router``, and a model copy whose expert was removed by zeroing its
output weights.
"""

import pytest
import torch

import workbench as wb
from experiments.router import (expert_ablation_effect, expert_load, expert_load_figure, router_entropy,
                                token_expert_choices)
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
