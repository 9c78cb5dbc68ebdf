"""Steering vectors: what a vector adds and where, that multiplier 0 is the clean model exactly, that CAA and PCA
recover a direction planted in a toy model, composition with SAE-feature steering, and the files round-trip."""

import math

import pytest
import torch

import workbench as wb
from experiments.features import steering_hook
from experiments.steering import (SteeringVector, coefficient_sweep, direction_score, logit_difference,
                                  token_probability, train_steering_vector)
from experiments.plots.steering import sweep_figure
from tests.unit.helpers import make_model

PAIRS = [("The cat sat on the mat", "The dog sat on the mat"), ("A cat", "A dog"), ("cats and more", "dogs and")]


@pytest.fixture(scope="module")
def toy():
    return wb.load_model("toy-attn-2l", progress=False).eval()


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


@pytest.fixture(scope="module")
def planted():
    """A model whose block 0 writes nothing (attention and MLP outputs zeroed), so block 0's output is the token
    and position embedding: pair k's positive token embeds as its negative's plus c_k x d plus small noise."""
    model = make_model("mha_learned_ln", seed=3)
    generator = torch.Generator().manual_seed(0)
    d = torch.randn(model.cfg.d_model, generator=generator)
    d = d / d.norm()
    with torch.no_grad():
        params = dict(model.named_parameters())
        params["blocks.0.attn._W_O_lin"].zero_()
        params["blocks.0.mlp._W_out_lin"].zero_()
        pairs = []
        for k in range(8):
            positive, negative = 10 + 2 * k, 11 + 2 * k
            strength = 1.0 + 0.5 * k   # varying, so the centred differences keep the axis PCA finds
            noise = 0.02 * torch.randn(model.cfg.d_model, generator=generator)
            params["embed.W_E"][positive] = params["embed.W_E"][negative] + strength * d + noise
            pairs.append(([3, 5, positive], [3, 5, negative]))
    return model, d, pairs


def test_multiplier_zero_is_the_clean_forward_and_generation_exactly(toy):
    tokens = toy.to_tokens("The cat sat on the mat. The cat")
    vector = train_steering_vector(toy, PAIRS)
    clean = toy(tokens)
    with vector.apply(toy, multiplier=0.0):
        steered = toy(tokens)
        steered_text = toy.generate("The cat", max_new_tokens=6)
    with vector.apply(toy, multiplier=0.0, token_indices=[0, -1]):
        positioned = toy(tokens)
    assert torch.equal(steered, clean) and torch.equal(positioned, clean)
    assert steered_text == toy.generate("The cat", max_new_tokens=6)
    assert toy.attached_hooks() == {}


def test_the_vector_adds_multiplier_times_its_direction_at_the_chosen_layer_and_positions(toy):
    tokens = toy.to_tokens("The cat sat on the mat. The cat")
    direction = torch.randn(toy.cfg.d_model)
    vector = SteeringVector({1: direction})
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    _, clean = toy.run_with_cache(tokens, names_filter=names)
    with vector.apply(toy, multiplier=2.5, token_indices=[1, 3]):
        _, steered = toy.run_with_cache(tokens, names_filter=names)
    change = steered["blocks.1.hook_resid_post"] - clean["blocks.1.hook_resid_post"]
    assert torch.allclose(change[0, [1, 3]], 2.5 * direction.expand(2, -1), atol=1e-5)
    untouched = [p for p in range(tokens.shape[1]) if p not in (1, 3)]
    assert torch.equal(change[0, untouched], torch.zeros_like(change[0, untouched]))
    assert torch.equal(steered["blocks.0.hook_resid_post"], clean["blocks.0.hook_resid_post"])
    with vector.apply(toy, multiplier=1.0, min_token_index=4):
        _, late = toy.run_with_cache(tokens, names_filter=names)
    late_change = late["blocks.1.hook_resid_post"] - clean["blocks.1.hook_resid_post"]
    assert float(late_change[0, :4].abs().max()) == 0.0
    assert torch.allclose(late_change[0, 4:], direction.expand(tokens.shape[1] - 4, -1), atol=1e-5)


def test_caa_is_the_mean_difference_and_actadd_the_one_pair_difference(toy):
    def read(text, layer):
        _, cache = toy.run_with_cache(toy.to_tokens(text), names_filter=[f"blocks.{layer}.hook_resid_post"])
        return cache[f"blocks.{layer}.hook_resid_post"][0, -1]
    caa = train_steering_vector(toy, PAIRS, layers=[0, 1])
    for layer in (0, 1):
        expected = torch.stack([read(p, layer) - read(n, layer) for p, n in PAIRS]).mean(0)
        assert torch.allclose(caa.layer_activations[layer], expected, atol=1e-5)
    actadd = train_steering_vector(toy, PAIRS[:1], layers=[1], method="actadd")
    assert torch.allclose(actadd.layer_activations[1], read(PAIRS[0][0], 1) - read(PAIRS[0][1], 1), atol=1e-5)
    second_last = train_steering_vector(toy, PAIRS[:1], layers=[1], read_token_index=1)
    _, cache = toy.run_with_cache(toy.to_tokens(list(PAIRS[0]), padding_side="right"),
                                  names_filter=["blocks.1.hook_resid_post"])
    acts = cache["blocks.1.hook_resid_post"]
    assert torch.allclose(second_last.layer_activations[1], acts[0, 1] - acts[1, 1], atol=1e-5)


@pytest.mark.parametrize("method", ["caa", "pca"])
def test_a_planted_direction_is_recovered(planted, method):
    model, d, pairs = planted
    vector = train_steering_vector(model, pairs, layers=[0], method=method)
    assert _cos(vector.layer_activations[0], d) >= 0.95   # PCA's sign too: positives project above negatives
    if method == "pca":
        assert math.isclose(float(vector.layer_activations[0].norm()), 1.0, rel_tol=1e-5)


def test_vectors_compose_with_each_other_and_with_sae_feature_steering(toy):
    tokens = toy.to_tokens("The cat sat on the mat. The cat")
    name = "blocks.0.hook_resid_post"
    a, b = torch.randn(toy.cfg.d_model), torch.randn(toy.cfg.d_model)
    sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": name}),
                              {"W_enc": torch.zeros(128, 4), "W_dec": torch.randn(4, 128), "b_enc": torch.zeros(4),
                               "b_dec": torch.zeros(128)})
    _, clean = toy.run_with_cache(tokens, names_filter=[name])
    first, second = SteeringVector({0: a}), SteeringVector({0: b})
    with first.apply(toy, 2.0), second.apply(toy, -1.0):
        _, nested = toy.run_with_cache(tokens, names_filter=[name])
    hooks = first.hooks(toy, 2.0) + [steering_hook(sae, 1, 3.0)]
    with toy.hooks(fwd_hooks=hooks):
        _, with_feature = toy.run_with_cache(tokens, names_filter=[name])
    assert torch.allclose(nested[name] - clean[name], (2.0 * a - b).expand_as(clean[name]), atol=1e-5)
    expected = (2.0 * a + 3.0 * sae.W_dec[1].detach()).expand_as(clean[name])
    assert torch.allclose(with_feature[name] - clean[name], expected, atol=1e-5)
    assert toy.attached_hooks() == {}


def test_steered_generation_changes_the_continuation_and_leaves_nothing_attached(toy):
    vector = train_steering_vector(toy, PAIRS)
    clean = toy.generate("The cat", max_new_tokens=8)
    with vector.apply(toy, multiplier=8.0):
        steered = toy.generate("The cat", max_new_tokens=8)
        steered_without_cache = toy.generate("The cat", max_new_tokens=8, use_kv_cache=False)
    assert steered != clean and steered == steered_without_cache   # every position steered: the cache is exact
    assert toy.attached_hooks() == {}


def test_sweep_scores_move_by_the_hand_computed_projection(toy):
    tokens = toy.to_tokens("The cat sat on the mat. The cat")
    direction = torch.randn(toy.cfg.d_model)
    vector = SteeringVector({1: direction})
    score = direction_score(direction, "blocks.1.hook_resid_post")
    table = coefficient_sweep(toy, vector, ["The cat sat on the mat. The cat"], score, [-2.0, 0.0, 3.0])
    base = float(score(toy, tokens)[0])
    expected = [base + c * float(direction @ direction) for c in (-2.0, 0.0, 3.0)]
    assert table.score.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-3)
    for measure in (logit_difference(" on", " the"), token_probability([" on", " the"])):
        swept = coefficient_sweep(toy, vector, ["The cat sat", "A dog"], measure, [0.0, 1.0])
        assert swept.loc[(swept.coefficient == 0.0) & (swept.prompt == 0), "score"].item() == float(
            measure(toy, toy.to_tokens("The cat sat"))[0])
    figure = sweep_figure(table, score.label)
    assert figure.data[-1].name == "mean" and list(figure.data[-1].y) == pytest.approx(expected, rel=1e-4, abs=1e-3)


def test_save_load_and_control_vector_gguf_round_trip(tmp_path, toy):
    vector = train_steering_vector(toy, PAIRS, method="caa")
    loaded = SteeringVector.load(vector.save(tmp_path / "vec"))
    assert loaded.meta == vector.meta
    assert all(torch.equal(loaded.layer_activations[l], vector.layer_activations[l]) for l in vector.layer_activations)
    path = vector.export_gguf(tmp_path / "vec.gguf", model_hint="llama")
    imported = SteeringVector.import_gguf(path)
    assert imported.meta["model_hint"] == "llama" and sorted(imported.layer_activations) == [0, 1]
    assert all(torch.equal(imported.layer_activations[l], vector.layer_activations[l]) for l in (0, 1))
