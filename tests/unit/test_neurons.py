"""experiments.neurons and experiments.token_view against hand calculations.

Activations are recomputed from the weights and the MLP's input read from ``run_with_cache``; the
direct logit effect is a hand matmul; corpus maxima are checked against a direct forward on each
window; the token view's HTML values against ``hook_pattern`` rows and columns.
"""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import workbench as wb
from experiments import corpus_windows, neurons, token_view
from experiments.plots import token_view as token_view_plots
from experiments.neurons import MLPUnit
from experiments.plots.neurons import top_windows_html
from workbench.bpe import train_bpe

TOKENS = torch.tensor([[0, 5, 17, 42, 8, 99, 3, 250, 7, 61, 13, 200]])


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(["The cat sat on the mat. def f(x): return x + 1\n"] * 20, vocab_size=300)


def _randomise(model: wb.Decoder, seed: int = 0) -> wb.Decoder:
    """Biases and norm gains away from their 0 / 1 init, so the hand formulas must include them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("w", "b") or ".b_" in name or name.startswith("b_"):
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if name.endswith(".w") else 0.0))
            else:
                param.mul_(20.0)  # large enough that activations leave the linear region
    return model.eval()


def _dense(act_fn: str, gated: bool, tokenizer=None, normalization: str = "RMS") -> wb.Decoder:
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=24, d_vocab=300, n_ctx=64,
                         act_fn=act_fn, gated_mlp=gated, mlp_bias=True, normalization=normalization,
                         positional="rotary", model_name="tiny-dense")
    return _randomise(wb.Decoder(cfg, tokenizer=tokenizer))


def _moe(tokenizer=None, **extra) -> wb.Decoder:
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=16, d_vocab=300, n_ctx=64,
                         gated_mlp=True, act_fn="silu", num_experts=4, experts_per_token=2, normalization="RMS",
                         positional="rotary", model_name="tiny-moe", moe=wb.MoEConfig(**extra))
    return _randomise(wb.Decoder(cfg, tokenizer=tokenizer))


def _mlp_input(model, tokens, layer: int):
    _, cache = model.run_with_cache(tokens)
    return cache[f"blocks.{layer}.ln2.hook_normalized"][0], cache


# ---- activations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("act_fn, gated", [("relu", False), ("silu", True)])
def test_dense_neuron_activation_is_the_mlp_formula_by_hand(act_fn, gated):
    model = _dense(act_fn, gated)
    x_PD, _ = _mlp_input(model, TOKENS, layer=1)
    mlp = model.blocks[1].mlp
    neuron = 7
    pre_P = x_PD @ mlp.W_in[:, neuron] + mlp.b_in[neuron]
    if gated:  # SwiGLU: silu(gate) * linear
        expected = F.silu(x_PD @ mlp.W_gate[:, neuron] + mlp.b_gate[neuron]) * pre_P
    else:
        expected = torch.clamp(pre_P, min=0)
    table = neurons.neuron_activation(model, TOKENS, MLPUnit(1), neuron)
    assert list(table.columns) == ["position", "token", "activation", "routed"]
    assert table["routed"].all() and (expected > 0).any()
    torch.testing.assert_close(torch.tensor(table["activation"].values), expected.detach().float(), rtol=1e-5, atol=1e-5)


def _routed_positions(cache, layer: int, expert: int) -> torch.Tensor:
    return (cache[f"blocks.{layer}.mlp.hook_expert_indices"][0] == expert).any(-1)


def test_expert_neuron_activation_on_routed_tokens_is_what_the_expert_computes():
    model = _moe(expert_bias=True)
    layer, expert, neuron = 1, 2, 5
    x_PD, cache = _mlp_input(model, TOKENS, layer)
    mlp = model.blocks[layer].mlp
    routed_P = _routed_positions(cache, layer, expert)
    assert 0 < int(routed_P.sum()) < TOKENS.shape[1]  # some tokens go there, some do not
    gate_P = x_PD @ mlp.W_gate[expert][:, neuron] + mlp.b_gate[expert, neuron]
    up_P = x_PD @ mlp.W_in[expert][:, neuron] + mlp.b_in[expert, neuron]
    expected_P = F.silu(gate_P) * up_P
    table = neurons.neuron_activation(model, TOKENS, MLPUnit(layer, expert=expert), neuron)
    assert table["routed"].tolist() == routed_P.tolist()
    got_P = torch.tensor(table["activation"].values)
    assert got_P[~routed_P].isnan().all()  # the expert never ran there
    torch.testing.assert_close(got_P[routed_P], expected_P[routed_P].detach().float(), rtol=1e-5, atol=1e-5)

    # All neurons through the expert's W_out (+ b_out) give the model's own expert output on those tokens.
    acts_BPM, _ = neurons.unit_activations(model, TOKENS, MLPUnit(layer, expert=expert))
    rebuilt = acts_BPM[0, routed_P] @ mlp.W_out[expert] + mlp.b_out[expert]
    torch.testing.assert_close(rebuilt, mlp.expert_forward(expert, x_PD[routed_P]).detach(), rtol=1e-4, atol=1e-5)


def test_clamped_swiglu_expert_matches_the_model_expert():
    model = _moe(swiglu_limit=0.5, swiglu_alpha=1.702)
    layer, expert = 0, 1
    x_PD, cache = _mlp_input(model, TOKENS, layer)
    mlp = model.blocks[layer].mlp
    routed_P = _routed_positions(cache, layer, expert)
    gate_PM = x_PD[routed_P] @ mlp.W_gate[expert]
    assert (gate_PM > 0.5).any()  # the clamp is exercised
    g = gate_PM.clamp(max=0.5)
    expected = (((x_PD[routed_P] @ mlp.W_in[expert]).clamp(-0.5, 0.5) + 1) * g * torch.sigmoid(1.702 * g))
    acts_BPM, _ = neurons.unit_activations(model, TOKENS, MLPUnit(layer, expert=expert))
    torch.testing.assert_close(acts_BPM[0, routed_P], expected.detach(), rtol=1e-5, atol=1e-5)


def test_shared_expert_neuron_is_its_gated_mlp_by_hand():
    model = _moe(d_shared_expert=12, shared_expert_gate=True)
    x_PD, _ = _mlp_input(model, TOKENS, layer=1)
    shared = model.blocks[1].mlp.shared
    expected = F.silu(x_PD @ shared.W_gate[:, 3]) * (x_PD @ shared.W_in[:, 3])
    table = neurons.neuron_activation(model, TOKENS, MLPUnit(1, shared=True), 3)
    torch.testing.assert_close(torch.tensor(table["activation"].values), expected.detach(), rtol=1e-5, atol=1e-5)
    labels = [u.label for u in neurons.mlp_units(model)]
    assert labels == [f"L{l} expert {e}" for l in (0,) for e in range(4)] + ["L0 shared expert"] + \
                     [f"L1 expert {e}" for e in range(4)] + ["L1 shared expert"]


def test_attention_only_and_bad_choices_are_clear_errors():
    attn_only = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=50, n_ctx=16, attn_only=True))
    with pytest.raises(wb.InputError, match="attention-only"):
        neurons.mlp_units(attn_only)
    with pytest.raises(wb.InputError, match="attention-only"):
        neurons.neuron_activation(attn_only, TOKENS[:, :4] % 50, MLPUnit(0), 0)
    moe = _moe()
    with pytest.raises(wb.InputError, match="choose an expert"):
        neurons.neuron_activation(moe, TOKENS, MLPUnit(1), 0)
    with pytest.raises(wb.InputError, match="experts 0..3"):
        neurons.neuron_activation(moe, TOKENS, MLPUnit(1, expert=4), 0)
    with pytest.raises(wb.InputError, match="no shared expert"):
        neurons.neuron_activation(moe, TOKENS, MLPUnit(1, shared=True), 0)
    with pytest.raises(wb.InputError, match="neurons 0..23"):
        neurons.neuron_activation(_dense("relu", False), TOKENS, MLPUnit(0), 24)


# ---- direct logit effect ---------------------------------------------------------------------------
@pytest.mark.parametrize("normalization", ["RMS", "LN"])
def test_direct_logit_effect_is_w_out_through_the_gain_times_w_u(normalization):
    model = _dense("gelu", False, normalization=normalization)
    layer, neuron = 1, 11
    w_out = model.blocks[layer].mlp.W_out[neuron].detach()
    gain = model.ln_final.w.detach()
    centred = w_out - w_out.mean() if normalization == "LN" else w_out  # LayerNorm centres before its gain
    with_gain = (centred * gain) @ model.W_U.detach()
    plain = w_out @ model.W_U.detach()
    for through, expected_V in ((True, with_gain), (False, plain)):
        effect = neurons.direct_logit_effect(model, MLPUnit(layer), neuron, k=5, through_final_norm=through)
        promoted = effect[effect["direction"] == "promoted"]
        suppressed = effect[effect["direction"] == "suppressed"]
        assert promoted["token_id"].tolist() == expected_V.topk(5).indices.tolist()
        assert suppressed["token_id"].tolist() == (-expected_V).topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor(promoted["effect"].values, dtype=torch.float32),
                                   expected_V.topk(5).values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(suppressed["effect"].values, dtype=torch.float32),
                                   -(-expected_V).topk(5).values, rtol=1e-5, atol=1e-5)


def test_direct_logit_effect_of_an_expert_neuron_reads_that_expert():
    model = _moe()
    expected_V = (model.blocks[0].mlp.W_out[3][2].detach() * model.ln_final.w.detach()) @ model.W_U.detach()
    effect = neurons.direct_logit_effect(model, MLPUnit(0, expert=3), 2, k=3)
    assert effect.query("direction == 'promoted'")["token_id"].tolist() == expected_V.topk(3).indices.tolist()


# ---- corpus maxima and the disk cache ------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(neurons.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_corpus_maxima_equal_a_direct_forward_on_each_window(tokenizer, cache_dir):
    model = _dense("relu", False, tokenizer=tokenizer)
    maxima = neurons.corpus_maxima(model, MLPUnit(1), n_windows=6, window=32)
    assert maxima.windows_BP.shape == (6, 32) and maxima.max_BM.shape == (6, 24)
    assert (maxima.windows_BP[:, 0] == tokenizer.bos_token_id).all()
    _, cache = model.run_with_cache(maxima.windows_BP, names_filter="blocks.1.mlp.hook_post")
    post_BPM = cache["blocks.1.mlp.hook_post"][:, 1:]  # BOS left out
    torch.testing.assert_close(maxima.max_BM, post_BPM.max(dim=1).values, rtol=1e-5, atol=1e-6)
    # Where the max is: the activation there is the max.
    at_argmax = cache["blocks.1.mlp.hook_post"].gather(1, maxima.argmax_BM[:, None, :]).squeeze(1)
    torch.testing.assert_close(at_argmax, maxima.max_BM, rtol=1e-5, atol=1e-6)

    neuron = 4
    top = neurons.top_windows(model, maxima, neuron, k=3)
    assert top["max_activation"].tolist() == sorted(top["max_activation"].tolist(), reverse=True)
    for row in top.itertuples():  # each reported max is a fresh forward on that window alone
        _, alone = model.run_with_cache(maxima.windows_BP[row.window][None], names_filter="blocks.1.mlp.hook_post")
        acts_P = alone["blocks.1.mlp.hook_post"][0, :, neuron]
        assert row.max_activation == pytest.approx(float(acts_P[1:].max()), rel=1e-5, abs=1e-6)
        assert row.position == 1 + int(acts_P[1:].argmax())
        assert row.token == model.to_str_tokens(maxima.windows_BP[row.window])[row.position]
    html = top_windows_html(model, maxima, top)
    assert html.count('class="wb-token-view"') == 3 and html.count("outline: 2px") == 3


def test_expert_corpus_maxima_count_only_routed_tokens(tokenizer, cache_dir):
    model = _moe(tokenizer=tokenizer)
    layer, expert = 1, 0
    maxima = neurons.corpus_maxima(model, MLPUnit(layer, expert=expert), n_windows=4, window=32)
    _, cache = model.run_with_cache(maxima.windows_BP)
    x_BPD = cache[f"blocks.{layer}.ln2.hook_normalized"]
    routed_BP = (cache[f"blocks.{layer}.mlp.hook_expert_indices"] == expert).any(-1)
    mlp = model.blocks[layer].mlp
    acts_BPM = F.silu(x_BPD @ mlp.W_gate[expert]) * (x_BPD @ mlp.W_in[expert])
    acts_BPM = acts_BPM.masked_fill(~routed_BP[..., None], -math.inf)[:, 1:]
    torch.testing.assert_close(maxima.max_BM, acts_BPM.max(dim=1).values.detach(), rtol=1e-4, atol=1e-5)


def test_the_disk_cache_is_reused_without_a_forward_pass_and_keyed_by_the_weights(tokenizer, cache_dir):
    model = _dense("relu", False, tokenizer=tokenizer)
    first = neurons.corpus_maxima(model, MLPUnit(0), n_windows=4, window=32)
    assert not first.from_disk and first.path.is_file() and first.path.parent == cache_dir / "neurons"
    forwards = []
    model.hook_embed.add_hook(lambda x, hook: forwards.append(1), is_permanent=True)
    try:
        again = neurons.corpus_maxima(model, MLPUnit(0), n_windows=4, window=32)
        assert again.from_disk and forwards == []
        torch.testing.assert_close(again.max_BM, first.max_BM)
        assert torch.equal(again.argmax_BM, first.argmax_BM)
        with torch.no_grad():  # other weights: another cache entry, computed afresh
            model.blocks[0].mlp.W_in.mul_(2.0)
        changed = neurons.corpus_maxima(model, MLPUnit(0), n_windows=4, window=32)
        assert not changed.from_disk and changed.path != first.path and len(forwards) == 1
    finally:
        model.hook_embed.remove_hooks(including_permanent=True)
    assert sorted(p.name for p in (cache_dir / "neurons").iterdir()) == sorted([first.path.name, changed.path.name])


def test_an_interrupted_write_or_computation_leaves_no_file(tokenizer, cache_dir, monkeypatch):
    model = _dense("relu", False, tokenizer=tokenizer)

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"\x00" * 100)  # a partial file, then the interruption
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus_windows, "save_file", half_written)  # the corpus-window engine writes the cache
    with pytest.raises(KeyboardInterrupt):
        neurons.corpus_maxima(model, MLPUnit(1), n_windows=4, window=32)
    assert list((cache_dir / "neurons").iterdir()) == []

    monkeypatch.undo()
    monkeypatch.setenv(neurons.CACHE_ENV, str(cache_dir))

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        neurons.corpus_maxima(model, MLPUnit(1), n_windows=32, window=32, batch_size=4, progress=stop)
    assert not (cache_dir / "neurons").exists() or list((cache_dir / "neurons").iterdir()) == []


def test_a_cache_file_is_trusted_only_under_its_own_key_and_never_through_a_link(tokenizer, cache_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = _dense("relu", False, tokenizer=tokenizer)
    first = neurons.corpus_maxima(model, MLPUnit(0), n_windows=4, window=32)
    with safe_open(str(first.path), framework="pt") as file:
        key = json.loads(file.metadata()["key"])
    assert key["engine"] == corpus_windows.ENGINE and key["model"] == neurons.weights_digest(model)
    assert key["source"] == {"unit": [0, None, False]} and key["corpus"]["shape"] == [4, 32]
    tensors = load_file(str(first.path))
    # The right tensors with maxima doubled, under another engine's key and without a key: both recomputed.
    tampered = {**tensors, "max_BM": tensors["max_BM"] * 2}
    for metadata in ({"key": json.dumps({**key, "engine": "workbench-corpus-windows-0"}, sort_keys=True)}, None):
        save_file(tampered, str(first.path), metadata=metadata)
        again = neurons.corpus_maxima(model, MLPUnit(0), n_windows=4, window=32)
        assert not again.from_disk and torch.equal(again.max_BM, first.max_BM)
    # A cache entry that is a link to a file outside the cache is neither read nor written through.
    outside = tmp_path / "outside.safetensors"
    save_file(tensors, str(outside), metadata={"key": json.dumps(key, sort_keys=True)})
    first.path.unlink()
    first.path.symlink_to(outside)
    linked = neurons.corpus_maxima(model, MLPUnit(0), n_windows=4, window=32)
    assert not linked.from_disk and linked.path is None and torch.equal(linked.max_BM, first.max_BM)
    assert torch.equal(load_file(str(outside))["max_BM"], tensors["max_BM"])


# ---- token view --------------------------------------------------------------------------------------
def _data_values(fragment: str) -> list[float]:
    return [float(v) for v in re.findall(r'data-value="([^"]+)"', fragment)]


def _alphas(fragment: str) -> list[float]:
    return [float(a) for a in re.findall(r"background-color: rgba\(\d+, \d+, \d+, ([0-9.]+)\)", fragment)]


@pytest.mark.parametrize("direction", ["from_selected", "to_selected"])
def test_token_view_values_are_the_pattern_row_or_column(direction):
    model = _dense("relu", False)
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_pattern"))
    patterns_LHPS = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"][0] for l in range(2)])
    layer, head, token = 1, 2, 5
    pattern_PS = cache[f"blocks.{layer}.attn.hook_pattern"][0, head]
    expected = pattern_PS[token, :] if direction == "from_selected" else pattern_PS[:, token]
    values_P = token_view.selected_attention(patterns_LHPS, layer, head, token, direction)
    fragment = token_view_plots.token_html([f"t{i}" for i in range(TOKENS.shape[1])], values_P, selected=token)
    shown = torch.tensor(_data_values(fragment))
    torch.testing.assert_close(shown, expected.float(), rtol=1e-5, atol=1e-6)
    # Opacity: value / the largest value, to 3 decimals.
    assert _alphas(fragment) == pytest.approx([round(float(v / expected.max()), 3) for v in expected], abs=1e-9)
    if direction == "from_selected":
        assert (shown[token + 1:] == 0).all()  # the causal mask: a token attends to no later one
    else:
        assert (shown[:token] == 0).all()
    mean = token_view.selected_attention(patterns_LHPS, layer, None, token, direction)
    mean_PS = cache[f"blocks.{layer}.attn.hook_pattern"][0].mean(0)
    torch.testing.assert_close(mean, (mean_PS[token] if direction == "from_selected" else mean_PS[:, token]).float())


def test_token_html_escapes_text_and_shows_whitespace():
    tokens = ["<b>", " & ", '"x"', " ", "\n", "<script>alert(1)</script>"]
    fragment = token_view_plots.token_html(tokens, [1.0, -0.5, float("nan"), 0.0, 0.25, 0.5], value_name="act<i>")
    assert "<b>" not in fragment and "<script>" not in fragment and "<i>" not in fragment
    assert "&lt;b&gt;" in fragment and "&lt;script&gt;alert(1)&lt;/script&gt;" in fragment and " &amp; " in fragment
    assert "&quot;x&quot;" in fragment or "&#x27;" in fragment
    assert ">␣</span>" in fragment and ">↵</span><br>" in fragment
    assert "rgba(214, 39, 40, 1.0)" in fragment and "rgba(31, 119, 180, 0.5)" in fragment  # red +, blue -
    assert 'data-value="nan"' in fragment and "color: #999" in fragment
    document = token_view_plots.html_document(fragment, "<Token view>")
    assert "<title>&lt;Token view&gt;</title>" in document
    with pytest.raises(wb.InputError, match="2 tokens but 1 values"):
        token_view_plots.token_html(["a", "b"], [1.0])


def test_per_position_places_the_loss_change_of_each_predicted_token():
    per_token = pd.DataFrame({"position": [1, 2, 3], "token": ["b", "c", "d"], "delta": [0.5, -0.25, 2.0]})
    values = token_view.per_position(per_token, "delta", 4)
    assert math.isnan(values[0]) and values[1:] == [0.5, -0.25, 2.0]
    table = token_view.token_values(["a", "b", "c", "d"], values, "loss change")
    assert table["loss change"].tolist()[1:] == [0.5, -0.25, 2.0]
