"""Which corpus the Neurons and Features scans read: English prose (Debian's fortunes and debian-handbook,
``make setup-corpus``) or Python source (the standard library), by default the one the model was trained on (its
registry entry's ``corpus``), chosen on the pages by a "Corpus" select box that the link carries.
"""

from __future__ import annotations

import re

import pytest
import torch
from streamlit.testing.v1 import AppTest

import workbench as wb
from experiments import corpus_windows as engine
from experiments.datasets import english
from experiments.features import feature_corpus_stats
from experiments.neurons import CACHE_ENV, MLPUnit, corpus_maxima, neuron_corpus
from tests.unit.test_app_features import open_features, random_sae
from tests.unit.test_app_pages import APP, PAGES, SHORT_PROMPT, assert_clean, dense  # noqa: F401
from tests.unit.test_features import hand_features
from workbench.errors import InputError
from workbench.loading.registry import model_corpus

ENGLISH_INSTALLED = english.FORTUNES.is_dir() and english.HANDBOOK.is_dir()
needs_english = pytest.mark.skipif(not ENGLISH_INSTALLED, reason="the English corpus is not installed: make setup-corpus")
COMMON_WORDS = {"the", "and", "of", "to", "a", "is", "you", "in", "that", "it"}


@pytest.fixture(scope="module")
def toy():
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.fixture(scope="module")
def moe_toy():
    return wb.load_model("toy-moe-2l", progress=False).eval()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_zoo_toys_read_python_source_and_other_models_english(toy, moe_toy):
    table = wb.list_models().set_index("name")["corpus"]
    assert table["toy-attn-2l"] == table["toy-moe-2l"] == "code"
    assert table["smollm2-135m"] == table["gemma-3-270m"] == "english"
    assert engine.default_corpus(toy) == engine.default_corpus(moe_toy) == "code"
    unregistered = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=16, n_ctx=32))
    assert engine.default_corpus(unregistered) == "english"  # a path or Hub model: English
    assert model_corpus("EleutherAI/pythia-70m") == "english"
    # The default windows of a toy are the Python standard library's, exactly as an explicit "code" asks.
    assert torch.equal(neuron_corpus(toy, 8, 32), neuron_corpus(toy, 8, 32, corpus="code"))


def test_smollm2_reads_english_by_default():
    if not wb.list_models().set_index("name").loc["smollm2-135m", "installed"]:
        pytest.skip("smollm2-135m is not installed")
    smol = wb.load_model("smollm2-135m", progress=False)
    assert engine.default_corpus(smol) == "english"


@needs_english
def test_english_windows_are_english_prose(toy):
    windows_BP = neuron_corpus(toy, 32, 64, corpus="english")
    assert windows_BP.shape == (32, 64)
    text = "\n".join(toy.to_string(row) for row in windows_BP)
    words = re.findall(r"[a-z]+", text.lower())
    assert sum(word in COMMON_WORDS for word in words) > len(words) // 10  # prose: one word in ten is of these
    assert not re.search(r"^\s*(def|import|class) \w|self\.\w+\(", text, re.M)   # no Python statement
    code = "\n".join(toy.to_string(row) for row in neuron_corpus(toy, 32, 64, corpus="code"))
    assert "def " in code or "import " in code  # the other corpus is Python source


@needs_english
def test_english_windows_are_cut_from_evenly_spaced_training_documents(toy):
    documents = english.english_documents("train")
    windows_BP = neuron_corpus(toy, 256, 64, corpus="english")
    first_P = toy.to_tokens(documents[0][:engine.DOC_CHARS], prepend_bos=False)[0]
    n = min(63, len(first_P))
    assert torch.equal(windows_BP[0, 1:1 + n], first_P[:n])   # BOS, then the first training document
    text = "".join(toy.to_string(row) for row in windows_BP)
    assert "Debian" in text   # spaced out to the handbook's pages, which come after the fortunes
    assert torch.equal(windows_BP, neuron_corpus(toy, 256, 64, corpus="english"))   # the same windows every time


@needs_english
def test_the_cache_key_and_file_differ_per_corpus(toy):
    source = engine.UnitSource("demo", "demo", {"hook": "hook_embed"}, 128, None)
    reducer = type("Reducer", (), {"key": {"statistic": "demo"}})()
    code_BP, english_BP = (neuron_corpus(toy, 8, 32, corpus=name) for name in ("code", "english"))
    assert engine.cache_key(toy, source, reducer, code_BP) != engine.cache_key(toy, source, reducer, english_BP)
    assert engine.scan_path(toy, source, reducer, code_BP) != engine.scan_path(toy, source, reducer, english_BP)


@needs_english
def test_scans_read_the_chosen_corpus_and_cache_each_apart(moe_toy):
    unit = MLPUnit(1, expert=3)
    code = corpus_maxima(moe_toy, unit, n_windows=8, window=32)
    prose = corpus_maxima(moe_toy, unit, n_windows=8, window=32, corpus="english")
    assert torch.equal(prose.windows_BP, neuron_corpus(moe_toy, 8, 32, corpus="english"))
    assert not prose.from_disk and prose.path != code.path  # the English pass is not the cached code one
    assert corpus_maxima(moe_toy, unit, n_windows=8, window=32, corpus="english").from_disk
    sae = random_sae(moe_toy.cfg.d_model)
    stats = feature_corpus_stats(moe_toy, sae, n_windows=8, window=16, k=3, corpus="english", use_disk=False)
    assert torch.equal(stats.windows_BP, neuron_corpus(moe_toy, 8, 16, corpus="english"))


def test_a_missing_english_corpus_says_to_run_make_setup_corpus(toy, monkeypatch, tmp_path):
    monkeypatch.setattr(english, "FORTUNES", tmp_path / "missing" / "fortunes")
    monkeypatch.setattr(english, "HANDBOOK", tmp_path / "missing" / "handbook")
    with pytest.raises(InputError, match="make setup-corpus"):
        neuron_corpus(toy, 8, 32, corpus="english")
    with pytest.raises(InputError, match="make setup-corpus"):
        feature_corpus_stats(toy, random_sae(toy.cfg.d_model), n_windows=8, window=16, corpus="english")
    assert neuron_corpus(toy, 8, 32).shape == (8, 32)  # the toy's own corpus needs no package


def test_an_unknown_corpus_is_an_input_error(toy):
    with pytest.raises(InputError, match="corpus must be one of"):
        neuron_corpus(toy, 8, 32, corpus="klingon")


@needs_english
def test_the_neurons_page_corpus_box_is_in_the_link():
    at = AppTest.from_file(str(APP / PAGES["neurons"]), default_timeout=120)
    at.session_state["model_source"] = "toy-moe-2l"
    at.session_state["prompt"] = SHORT_PROMPT
    at.query_params["neurons_windows"] = "8"
    at.run()
    assert_clean(at)
    box = at.selectbox(key="neurons_corpus_text")
    assert box.label == "Corpus" and box.options == ["English", "Python source"] and box.value == "code"
    assert at.query_params["neurons_corpus_text"] == "code"
    assert any("Python standard library" in c.value for c in at.caption)
    box.set_value("english").run()
    assert_clean(at)
    assert at.query_params["neurons_corpus_text"] == "english"
    assert any("English documents" in c.value for c in at.caption)
    # A link that asks for English opens with it.
    linked = AppTest.from_file(str(APP / PAGES["neurons"]), default_timeout=120)
    linked.session_state["model_source"] = "toy-moe-2l"
    linked.session_state["prompt"] = SHORT_PROMPT
    linked.query_params.update({"neurons_windows": "8", "neurons_corpus_text": "english"})
    linked.run()
    assert_clean(linked)
    assert linked.selectbox(key="neurons_corpus_text").value == "english"


@needs_english
def test_the_features_page_corpus_box_is_in_the_link_and_decides_the_density(dense, tmp_path, monkeypatch):
    from experiments.features import sources

    monkeypatch.setattr(sources, "SHIPPED_ROOTS", ())   # the SAE comes from a path, as in test_app_features
    model = wb.load_model(dense, progress=False).eval()
    sae_dir = str(random_sae(model.cfg.d_model).save(tmp_path / "sae"))
    at = open_features(dense, features_sae_path=sae_dir, features_feature="5", features_corpus_text="english")
    assert at.selectbox(key="features_corpus_text").value == "english"
    assert at.query_params["features_corpus_text"] == "english"
    sae = wb.load_sae(sae_dir)
    windows_BP = neuron_corpus(model, 16, 32, corpus="english")
    corpus_acts = hand_features(model, sae, windows_BP)[:, 1:, 5]
    density = next(m.value for m in at.metric if m.label == "Density")
    assert density == f"{float((corpus_acts > 0).double().mean()):.3%}"
    assert any("English documents" in c.value for c in at.caption)
