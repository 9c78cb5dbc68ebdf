"""experiments.features on the zoo's toy-attn-2l with SAEs built from random tensors: every number is checked
against a hand calculation from ``run_with_cache`` and the SAE's weights (a standard SAE's encode is
``relu((x - b_dec) @ W_enc + b_enc)``), a brute-force scan or numpy's histogram."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import workbench as wb
from experiments import features
from experiments.neurons import CACHE_ENV, neuron_corpus
from workbench.errors import InputError

HOOK = "blocks.0.hook_resid_post"
D, F = 128, 48


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


def standard_sae(seed: int = 0, hook: str = HOOK, d_in: int = D, d_sae: int = F) -> wb.SAE:
    generator = torch.Generator().manual_seed(seed)
    cfg = wb.SAEConfig("standard", d_in=d_in, d_sae=d_sae, metadata={"hook_name": hook})
    return wb.SAE.from_tensors(cfg, {"W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5,
                                     "W_dec": torch.randn(d_sae, d_in, generator=generator) / d_in ** 0.5,
                                     "b_enc": torch.randn(d_sae, generator=generator) * 0.3 - 0.3,
                                     "b_dec": torch.randn(d_in, generator=generator) * 0.1})


def hand_features(model, sae: wb.SAE, tokens) -> torch.Tensor:
    """A standard SAE's features of the model's activation at its hook, by hand."""
    _, cache = model.run_with_cache(tokens, names_filter=[sae.cfg.hook_name])
    x = cache[sae.cfg.hook_name].float()
    return torch.relu((x - sae.b_dec.detach()) @ sae.W_enc.detach() + sae.b_enc.detach())


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_feature_activations_equal_the_hand_encode_and_leave_the_model_as_it_was(model):
    sae = standard_sae()
    tokens = model.to_tokens("The cat sat on the mat. The cat")
    expected = hand_features(model, sae, tokens)
    torch.testing.assert_close(features.feature_activations(model, sae, tokens), expected, atol=1e-5, rtol=1e-5)
    assert model.attached_hooks() == {} and model.acts_to_saes == {}
    table = features.active_features(model, sae, tokens, k=3)
    for position, rows in table.groupby("position"):
        values, ids = expected[0, position].topk(3)
        keep = values > 0
        assert rows["feature"].tolist() == ids[keep].tolist()
        np.testing.assert_allclose(rows["activation"], values[keep].numpy(), atol=1e-5)
    one = features.feature_on_prompt(model, sae, tokens, 5)
    np.testing.assert_allclose(one["activation"], expected[0, :, 5].numpy(), atol=1e-5)


def test_top_windows_and_density_equal_a_brute_force_scan(model):
    sae = standard_sae()
    n_windows, window, k = 21, 16, 4
    stats = features.feature_corpus_stats(model, sae, n_windows=n_windows, window=window, k=k, batch_size=5,
                                          use_disk=False)  # batches of 5, 5, 5, 5, 1
    windows_BP = neuron_corpus(model, n_windows, window)
    assert torch.equal(stats.windows_BP, windows_BP.cpu())
    acts_BPX = hand_features(model, sae, windows_BP)[:, 1:]  # BOS left out
    max_BX, where_BX = acts_BPX.max(dim=1)
    top_WX, top_windows_WX = max_BX.topk(k, dim=0)
    torch.testing.assert_close(stats.top_values_WX, top_WX, atol=1e-5, rtol=1e-5)
    fired = top_WX > 1e-4  # zeros tie: their windows are any
    assert fired.any()
    assert torch.equal(stats.top_windows_WX[fired], top_windows_WX[fired])
    assert torch.equal(stats.top_positions_WX[fired], (where_BX.gather(0, top_windows_WX) + 1)[fired])
    # The density histogram: numpy's histogram of log10 of each feature's positive activations, ends clamped.
    edges = features.bin_edges().numpy()
    acts_NX = acts_BPX.reshape(-1, F).double().numpy()
    assert stats.n_tokens == acts_NX.shape[0] == n_windows * (window - 1)
    for f in range(F):
        positive = acts_NX[:, f][acts_NX[:, f] > 0]
        logs = np.clip(np.log10(positive), edges[0], edges[-1] - 1e-9)
        counts, _ = np.histogram(logs, bins=edges)
        assert stats.histogram_XZ[f].tolist() == counts.tolist(), f
    assert stats.histogram_XZ.sum() > 0
    density = features.feature_density(stats, 3)
    assert density["count"].sum() == int((acts_NX[:, 3] > 0).sum())
    assert density["fraction"].sum() == pytest.approx((acts_NX[:, 3] > 0).mean())
    table = features.feature_top_windows(model, stats, 3, k=k)
    assert table["max_activation"].tolist() == pytest.approx([v for v in top_WX[:, 3].tolist() if v > 0], abs=1e-5)


def test_stats_are_cached_on_disk_and_distrusted_when_wrong(model, cache_dir):
    sae = standard_sae()
    first = features.feature_corpus_stats(model, sae, n_windows=8, window=16, k=3)
    assert not first.from_disk and first.path is not None and first.path.parent == cache_dir / "features"
    again = features.feature_corpus_stats(model, sae, n_windows=8, window=16, k=3)
    assert again.from_disk and torch.equal(again.top_values_WX, first.top_values_WX)
    assert torch.equal(again.histogram_XZ, first.histogram_XZ) and again.n_tokens == first.n_tokens
    # Another SAE (other weights) or another k is another file.
    assert features.stats_path(model, standard_sae(seed=1), first.windows_BP, 3) != first.path
    assert features.stats_path(model, sae, first.windows_BP, 4) != first.path
    good = load_file(str(first.path))
    with safe_open(str(first.path), framework="pt") as file:
        key = file.metadata()  # the tampered files keep the cache key: their tensors are what is distrusted
    bad_files = {
        "position past the window": {**good, "top_positions_WX": torch.full_like(good["top_positions_WX"], 16)},
        "window past the corpus": {**good, "top_windows_WX": torch.full_like(good["top_windows_WX"], -1)},
        "NaN value": {**good, "top_values_WX": torch.full_like(good["top_values_WX"], float("nan"))},
        "values not descending": {**good, "top_values_WX": good["top_values_WX"].flip(0) - 1},
        "more firings than tokens": {**good, "n_tokens": torch.tensor([0])},
        "negative count": {**good, "histogram_XZ": good["histogram_XZ"] - 1},
        "a tensor missing": {name: t for name, t in good.items() if name != "histogram_XZ"},
        "float positions": {**good, "top_positions_WX": good["top_positions_WX"].float()},
    }
    for what, tensors in bad_files.items():
        save_file(tensors, str(first.path), metadata=key)
        recomputed = features.feature_corpus_stats(model, sae, n_windows=8, window=16, k=3)
        assert not recomputed.from_disk, what
        assert torch.equal(recomputed.top_values_WX, first.top_values_WX), what
        assert torch.equal(load_file(str(first.path))["histogram_XZ"], first.histogram_XZ), what  # replaced
    save_file(good, str(first.path))  # the right tensors without the key, or under another key: not trusted
    assert not features.feature_corpus_stats(model, sae, n_windows=8, window=16, k=3).from_disk
    save_file(good, str(first.path), metadata={"key": key["key"].replace('"k": 3', '"k": 4')})
    assert not features.feature_corpus_stats(model, sae, n_windows=8, window=16, k=3).from_disk
    first.path.write_bytes(b"not a safetensors file")
    assert not features.feature_corpus_stats(model, sae, n_windows=8, window=16, k=3).from_disk


def test_logit_effect_is_the_decoder_row_through_the_final_norm_and_unembedding(model):
    sae = standard_sae(hook="blocks.1.hook_resid_post")
    row = sae.W_dec[7].detach().double()
    by_hand = ((row - row.mean()) * model.ln_final.w.detach().double()) @ model.W_U.detach().double()  # LayerNorm
    effect = features.feature_logit_effect(model, sae, 7, k=5)
    promoted, suppressed = effect[effect.direction == "promoted"], effect[effect.direction == "suppressed"]
    assert promoted["token_id"].tolist() == by_hand.topk(5).indices.tolist()
    assert suppressed["token_id"].tolist() == by_hand.topk(5, largest=False).indices.tolist()
    np.testing.assert_allclose(promoted["effect"], by_hand.topk(5).values.numpy(), rtol=1e-4, atol=1e-5)
    raw = features.feature_logit_effect(model, sae, 7, k=5, through_final_norm=False)
    plain = row @ model.W_U.detach().double()
    assert raw[raw.direction == "promoted"]["token_id"].tolist() == plain.topk(5).indices.tolist()


def test_logit_effect_of_a_one_head_sae_goes_through_that_heads_W_O(model):
    generator = torch.Generator().manual_seed(3)
    cfg = wb.SAEConfig("standard", d_in=32, d_sae=8, metadata={"hook_name": "blocks.1.attn.hook_z",
                                                               "hook_head_index": 2})
    sae = wb.SAE.from_tensors(cfg, {"W_enc": torch.randn(32, 8, generator=generator),
                                    "W_dec": torch.randn(8, 32, generator=generator),
                                    "b_enc": torch.zeros(8), "b_dec": torch.zeros(32)})
    expected = sae.W_dec[4].detach() @ model.blocks[1].attn.W_O.detach()[2]
    torch.testing.assert_close(features.residual_direction(model, sae, 4), expected, atol=1e-5, rtol=1e-5)


def test_steering_adds_exactly_alpha_times_the_decoder_row(model):
    sae = standard_sae()
    tokens = model.to_tokens("The cat sat on the mat.")
    name, steer = features.steering_hook(sae, 11, alpha=-2.5)
    assert name == HOOK
    _, clean = model.run_with_cache(tokens, names_filter=[HOOK])
    with model.hooks(fwd_hooks=[(name, steer)]):
        _, steered = model.run_with_cache(tokens, names_filter=[HOOK])
    torch.testing.assert_close(steered[HOOK] - clean[HOOK], (-2.5 * sae.W_dec[11].detach()).expand_as(clean[HOOK]),
                               atol=1e-5, rtol=0)
    assert model.attached_hooks() == {}


def test_clamping_sets_the_feature_and_moves_the_output_by_its_decoded_change(model):
    sae = standard_sae()
    tokens = model.to_tokens("The cat sat on the mat.")
    before = hand_features(model, sae, tokens)
    acts = features.acts_hook_name(sae)
    for hook_fn, value in ((features.clamp_hook(sae, 9, 3.0), 3.0), (features.ablation_hook(sae, 9), 0.0)):
        name, clamp = hook_fn
        assert name == acts
        with model.saes(saes=[sae], use_error_term=True), model.hooks(fwd_hooks=[(name, clamp)]):
            _, edited = model.run_with_cache(tokens, names_filter=[acts, HOOK])
        assert bool((edited[acts][..., 9] == value).all())
        torch.testing.assert_close(edited[acts][..., :9], before[..., :9], atol=1e-5, rtol=1e-5)
        _, clean = model.run_with_cache(tokens, names_filter=[HOOK])
        change = (value - before[..., 9])[..., None] * sae.W_dec[9].detach()  # the decode is linear in the features
        torch.testing.assert_close(edited[HOOK] - clean[HOOK], change, atol=1e-4, rtol=1e-4)
    assert model.attached_hooks() == {} and model.acts_to_saes == {}


def greedy_by_hand(model, prompt, hooks, steps: int) -> list[int]:
    tokens = prompt
    for _ in range(steps):
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, prompt.shape[1]:].tolist()


def test_a_steered_generation_equals_greedy_decoding_under_the_hook_by_hand(model):
    sae = standard_sae()
    prompt = model.to_tokens("The cat sat on the mat. The cat")
    clean = greedy_by_hand(model, prompt, [], 5)
    for edit in (features.FeatureEdit(2, "add", 30.0), features.FeatureEdit(2, "clamp", 20.0)):
        result = features.continue_with_feature(model, sae, prompt, edit, max_new_tokens=5)
        with model.saes(saes=[sae] if edit.mode == "clamp" else [], use_error_term=True):
            edited = greedy_by_hand(model, prompt, [edit.hook(sae)], 5)
        assert list(result.ablated_tokens) == edited and list(result.clean_tokens) == clean, edit
        assert result.first_divergence is not None, edit  # the edit is strong enough to change the text
        assert result.targets == (edit.label,) and result.method == edit.mode
    assert model.attached_hooks() == {}


def test_bad_input_is_a_clear_error_that_leaves_nothing_attached(model):
    sae = standard_sae()
    with pytest.raises(InputError, match=rf"feature {F} is out of range: this SAE has features 0..{F - 1}"):
        features.feature_on_prompt(model, sae, "The cat", F)
    for call in (lambda: features.steering_hook(sae, -1, 1.0), lambda: features.clamp_hook(sae, F, 1.0),
                 lambda: features.feature_logit_effect(model, sae, 10**6)):
        with pytest.raises(InputError, match="out of range"):
            call()
    wrong_width = standard_sae(d_in=64)
    with pytest.raises(InputError, match=r"d_in=64.*'blocks.0.hook_resid_post' carries \(128,\)"):
        features.feature_activations(model, wrong_width, "The cat")
    with pytest.raises(InputError, match="d_in=64"):
        features.feature_corpus_stats(model, wrong_width, n_windows=4, window=8, use_disk=False)
    with pytest.raises(InputError, match="d_in=64"):
        features.continue_with_feature(model, wrong_width, "The cat", features.FeatureEdit(0, "add", 1.0))
    with pytest.raises(InputError, match="does not have"):
        features.feature_activations(model, standard_sae(hook="blocks.7.hook_resid_post"), "The cat")
    with pytest.raises(InputError, match="alpha must be finite"):
        features.steering_hook(sae, 0, float("nan"))
    with pytest.raises(InputError, match="mode must be one of"):
        features.FeatureEdit(0, "multiply", 2.0)
    with pytest.raises(InputError, match="d_in=64"):
        features.check_fits(model, wrong_width)
    assert model.attached_hooks() == {} and model.acts_to_saes == {}
