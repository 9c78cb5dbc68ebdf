"""The Neurons and Token view pages under Streamlit's AppTest, on a tiny dense-MLP model, the toy
attention-only and MoE models and a model with a dense layer and shared experts.

Every number the pages show is checked against a hand calculation from ``run_with_cache`` and the
weights; the error paths (no MLP, empty prompt) show a message, never a traceback.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from streamlit.testing.v1 import AppTest

import workbench as wb
from experiments.neurons import CACHE_ENV
from tests.unit.test_app_pages import (APP, PAGES, SHORT_PROMPT, assert_clean, dense, metric, moe,  # noqa: F401
                                       moe_dense_shared)
from workbench.bpe import train_bpe


@pytest.fixture(scope="module")
def dense_mlp(tmp_path_factory) -> str:
    """A random 2-layer model with a ReLU MLP (biases on) and a small BPE, saved like a zoo model."""
    torch.manual_seed(0)
    tok = train_bpe(["The cat sat on the mat. When Mary and John went to the store, John gave a drink to Mary."] * 20,
                    vocab_size=300)
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=48, d_vocab=tok.vocab_size, n_ctx=64,
                         positional="rotary", normalization="RMS", act_fn="relu", mlp_bias=True)
    model = wb.Decoder(cfg, tokenizer=tok)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.3 if name.endswith((".w", "b_in")) else 0.1))
    directory = tmp_path_factory.mktemp("dense-mlp")
    model.save(directory)
    return str(directory)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the page's disk cache goes to the test's tmp dir
    return tmp_path / "cache"


def open_page(page: str, source: str, prompt: str = SHORT_PROMPT, **state) -> AppTest:
    at = AppTest.from_file(str(APP / PAGES[page]), default_timeout=120)
    at.session_state["model_source"] = source
    at.session_state["prompt"] = prompt
    for key, value in state.items():
        at.session_state[key] = value
    at.run()
    assert_clean(at)
    return at


def text_metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def html_values(at: AppTest, index: int = 0) -> list[float]:
    return [float(v) for v in re.findall(r'data-value="([^"]+)"', at.get("html")[index].value)]


def _cache(source: str, prompt: str = SHORT_PROMPT):
    model = wb.load_model(source).requires_grad_(False)
    tokens = model.to_tokens(prompt)
    return model, tokens, model.run_with_cache(tokens)[1]


# ---- Neurons ----------------------------------------------------------------------------------------
def test_neurons_page_shows_the_activation_the_effect_and_the_top_windows(dense_mlp):
    model, tokens, cache = _cache(dense_mlp)
    at = open_page("neurons", dense_mlp, neurons_windows=16, neurons_window_len=32)
    for layer, neuron in ((0, 0), (0, 5), (1, 17)):
        at.selectbox(key="neurons_layer").set_value(layer)
        at.number_input(key="neurons_neuron").set_value(neuron).run()
        assert_clean(at)
        acts_P = cache[f"blocks.{layer}.mlp.hook_post"][0, :, neuron]
        assert metric(at, "Max activation") == pytest.approx(float(acts_P.max()), abs=1e-4)
        peak = int(acts_P.argmax())
        assert text_metric(at, "At token") == f"{peak}: {model.to_str_tokens(tokens[0])[peak]!r}"
        assert metric(at, "Mean activation") == pytest.approx(float(acts_P.mean()), abs=1e-4)
        assert html_values(at, 0) == pytest.approx(acts_P.tolist(), abs=1e-5)  # the prompt coloured by it
        # Direct effect: W_out[neuron] times the final RMSNorm's gain, times W_U (a hand matmul).
        effect_V = (model.blocks[layer].mlp.W_out[neuron] * model.ln_final.w) @ model.W_U
        top_id = int(effect_V.argmax())
        assert text_metric(at, "Top promoted token") == repr(model.to_str_tokens(torch.tensor([top_id]))[0])
        assert text_metric(at, "Top suppressed token") == repr(model.to_str_tokens(torch.tensor([int(effect_V.argmin())]))[0])

    at.toggle(key="neurons_norm_gain").set_value(False).run()
    plain_V = model.blocks[1].mlp.W_out[17] @ model.W_U
    assert text_metric(at, "Top promoted token") == repr(model.to_str_tokens(torch.tensor([int(plain_V.argmax())]))[0])

    windows = at.get("html")[1].value
    assert "#1 · window" in windows and windows.count('class="wb-token-view"') == 10
    top = next(df.value for df in at.dataframe if "max_activation" in df.value.columns)
    assert len(top) == 10 and top["max_activation"].is_monotonic_decreasing
    assert any("16 windows of 32 tokens" in c.value for c in at.caption)


def test_neurons_page_on_experts_counts_routed_tokens_only(moe):
    model, tokens, cache = _cache(moe)
    at = open_page("neurons", moe, neurons_windows=8)
    assert at.selectbox(key="neurons_expert").options == ["expert 0", "expert 1", "expert 2", "expert 3"]
    layer, neuron = 1, 9
    at.selectbox(key="neurons_layer").set_value(layer)
    at.number_input(key="neurons_neuron").set_value(neuron)
    mlp = model.blocks[layer].mlp
    x_PD = cache[f"blocks.{layer}.ln2.hook_normalized"][0]
    for expert in range(4):
        at.selectbox(key="neurons_expert").set_value(expert).run()
        assert_clean(at)
        routed_P = (cache[f"blocks.{layer}.mlp.hook_expert_indices"][0] == expert).any(-1)
        if not routed_P.any():
            assert any("never ran here" in i.value for i in at.info)
            continue
        assert text_metric(at, "Tokens routed to this expert") == f"{int(routed_P.sum())} of {tokens.shape[1]}"
        acts_P = F.silu(x_PD @ mlp.W_gate[expert][:, neuron]) * (x_PD @ mlp.W_in[expert][:, neuron])
        assert metric(at, "Max activation") == pytest.approx(float(acts_P[routed_P].max()), abs=1e-4)
        assert at.get("html")[0].value.count('data-value="nan"') == int((~routed_P).sum())


def test_neurons_page_on_a_dense_layer_and_a_shared_expert(moe_dense_shared):
    model, tokens, cache = _cache(moe_dense_shared)
    at = open_page("neurons", moe_dense_shared, neurons_windows=8)
    assert [s.key for s in at.selectbox if s.key == "neurons_expert"] == []  # layer 0 is dense: no expert to pick
    at.number_input(key="neurons_neuron").set_value(30).run()  # layer 0 has 40 neurons
    assert metric(at, "Max activation") == pytest.approx(float(cache["blocks.0.mlp.hook_post"][0, :, 30].max()), abs=1e-4)
    at.selectbox(key="neurons_layer").set_value(2).run()
    expert_box = at.selectbox(key="neurons_expert")
    assert expert_box.options == [f"expert {e}" for e in range(6)] + ["shared expert"]
    assert at.number_input(key="neurons_neuron").value == 15  # an expert has 16 neurons: 30 became the last one
    expert_box.set_value("shared").run()
    assert at.number_input(key="neurons_neuron").value == 15
    at.number_input(key="neurons_neuron").set_value(23).run()  # the shared expert has 24
    assert_clean(at)
    assert at.number_input(key="neurons_neuron").value == 23
    shared = model.blocks[2].mlp.shared
    x_PD = cache["blocks.2.ln2.hook_normalized"][0]
    acts_P = F.silu(x_PD @ shared.W_gate[:, 23]) * (x_PD @ shared.W_in[:, 23])
    assert metric(at, "Max activation") == pytest.approx(float(acts_P.max()), abs=1e-4)


def test_neurons_page_errors_are_messages(dense, dense_mlp):
    at = open_page("neurons", dense)  # toy-attn-2l: no MLP
    assert any("attention-only" in e.value for e in at.error) and not at.get("html")
    at = open_page("neurons", dense_mlp, prompt="   ")
    assert any("empty" in w.value for w in at.warning) and not at.get("html") and not at.metric


# ---- Token view ------------------------------------------------------------------------------------
def test_token_view_colours_by_a_heads_row_or_column_and_the_layer_mean(dense):
    model, tokens, cache = _cache(dense)
    at = open_page("token_view", dense)
    assert at.selectbox(key="token_view_token").value == tokens.shape[1] - 1  # the last token by default
    token, layer, head = 5, 1, 2
    at.selectbox(key="token_view_token").set_value(token)
    at.selectbox(key="token_view_layer").set_value(layer)
    at.selectbox(key="token_view_head").set_value(head).run()
    assert_clean(at)
    pattern_PS = cache[f"blocks.{layer}.attn.hook_pattern"][0, head]
    assert html_values(at) == pytest.approx(pattern_PS[token].tolist(), abs=1e-5)
    assert metric(at, "Attention at the selected token") == pytest.approx(float(pattern_PS[token, token]), abs=1e-4)
    at.radio(key="token_view_direction").set_value("to_selected").run()
    assert html_values(at) == pytest.approx(pattern_PS[:, token].tolist(), abs=1e-5)
    at.selectbox(key="token_view_head").set_value("mean").run()
    mean_PS = cache[f"blocks.{layer}.attn.hook_pattern"][0].mean(0)
    assert html_values(at) == pytest.approx(mean_PS[:, token].tolist(), abs=1e-5)
    table = next(df.value for df in at.dataframe if "attention" in df.value.columns)
    assert table["attention"].tolist() == pytest.approx(mean_PS[:, token].tolist(), abs=1e-5)


def test_token_view_loss_change_under_the_ablation_pages_choice(dense):
    model, tokens, _ = _cache(dense)
    at = open_page("token_view", dense)
    at.radio(key="token_view_mode").set_value("ablation").run()
    assert_clean(at)
    assert at.multiselect(key="ablation_heads").value == [(1, 0)]  # the Ablation page's default: L1H0

    def zero_head(z, hook):
        z[:, :, 0] = 0.0
        return z

    clean = F.cross_entropy(model(tokens)[0, :-1], tokens[0, 1:], reduction="none")
    ablated_logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", zero_head)])
    ablated = F.cross_entropy(ablated_logits[0, :-1], tokens[0, 1:], reduction="none")
    values = at.get("html")[0].value
    assert 'data-pos="0" data-value="nan"' in values  # nothing predicts the first token
    assert html_values(at)[1:] == pytest.approx((ablated - clean).tolist(), abs=1e-4)


def test_token_view_by_a_neuron_and_without_mlps(dense, moe):
    at = open_page("token_view", dense)
    at.radio(key="token_view_mode").set_value("neuron").run()
    assert any("attention-only" in e.value for e in at.error) and not at.exception

    model, tokens, cache = _cache(moe)
    at = open_page("token_view", moe)
    at.radio(key="token_view_mode").set_value("neuron").run()
    at.selectbox(key="neurons_layer").set_value(0)
    at.selectbox(key="neurons_expert").set_value(1)
    at.number_input(key="neurons_neuron").set_value(4).run()
    assert_clean(at)
    mlp, x_PD = model.blocks[0].mlp, cache["blocks.0.ln2.hook_normalized"][0]
    routed_P = (cache["blocks.0.mlp.hook_expert_indices"][0] == 1).any(-1)
    acts_P = F.silu(x_PD @ mlp.W_gate[1][:, 4]) * (x_PD @ mlp.W_in[1][:, 4])
    shown = html_values(at)
    assert [v == v for v in shown] == routed_P.tolist()  # NaN (grey) where the expert did not run
    assert [v for v in shown if v == v] == pytest.approx(acts_P[routed_P].tolist(), abs=1e-5)


def test_token_view_empty_prompt_is_a_warning(dense):
    at = open_page("token_view", dense, prompt="")
    assert any("empty" in w.value for w in at.warning) and not at.get("html")
