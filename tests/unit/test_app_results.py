"""The results layer is the pages' one way to reach experiments: every computation a page shows is a named
function of ``app.results`` (cached there), no page defines a computation or hands one in, and the
kernel names come from the model's package.

The page checks read the pages' source (they are scripts: running one is starting the dashboard).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import uuid
from pathlib import Path

import pandas as pd
import torch
import pytest

import workbench as wb
from app import results, state
from app.results.long_runs import LongRun
from app.state import LoadedModel
from experiments import attention, heads
from tests.unit.test_app_pages import SHORT_PROMPT, assert_clean, chart, dense, run_page  # noqa: F401  (fixture)

APP = Path(__file__).resolve().parents[2] / "app"
PAGES = sorted((APP / "pages").glob("*.py"))
# Pure views of a result the results layer returned (a sort, a threshold, a slice, a correlation of two tables):
# no model and no activations go in, so a page may call them on what it got back.
RESULT_VIEWS = {"top_heads", "attribution_agreement", "flow_graph", "edge_heads", "selected_attention",
                "per_position", "token_values"}
DRAWING_SUFFIXES = ("_figure", "_html", "heatmap", "_bars")  # figure and HTML builders


def _is_module(package: str, name: str) -> bool:
    try:
        importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError:
        return False
    return True


def _experiment_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names a page binds to experiments modules, and to functions or classes imported from them."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname for alias in node.names if alias.name.startswith("experiments") and alias.asname}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "experiments":
            for alias in node.names:
                (modules if _is_module(node.module, alias.name) else functions).add(alias.asname or alias.name)
    return modules, functions


def _experiment_calls(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """Every call a page makes to an experiments function, with the function's name."""
    modules, functions = _experiment_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in functions:
                found.append((func.id, node))
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
                found.append((func.attr, node))
    return found


def _is_the_model(node: ast.expr) -> bool:
    """``model`` or ``<anything>.model``: the loaded Decoder itself (``model.to_str_tokens(...)`` is a call, not it)."""
    return (isinstance(node, ast.Name) and node.id == "model") or (isinstance(node, ast.Attribute) and node.attr == "model")


def _arguments(call: ast.Call) -> list[ast.expr]:
    return [*call.args, *(keyword.value for keyword in call.keywords)]


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.stem)
def test_no_page_hands_a_function_to_the_results_layer(page: Path):
    tree = ast.parse(page.read_text())
    defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    modules, functions = _experiment_names(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "results"):
            continue
        assert hasattr(results, node.func.attr), f"{page.name}:{node.lineno}: results.{node.func.attr} does not exist"
        for argument in _arguments(node):
            handed_in = (isinstance(argument, ast.Lambda) or (isinstance(argument, ast.Name)
                         and argument.id in defined | functions) or (isinstance(argument, ast.Attribute)
                         and isinstance(argument.value, ast.Name) and argument.value.id in modules))
            assert not handed_in, f"{page.name}:{node.lineno}: a function handed to results.{node.func.attr}"


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.stem)
def test_pages_call_experiments_only_to_draw_or_view_a_result(page: Path):
    """No page computes: what runs the model or reads activations is a results function, so a page's own
    functions call experiments only to draw, or to view (sort, slice) what the results layer returned."""
    calls = _experiment_calls(ast.parse(page.read_text()))
    for name, call in calls:
        assert name.endswith(DRAWING_SUFFIXES) or name in RESULT_VIEWS, \
            f"{page.name}:{call.lineno}: {name} computes on the page; make it a named function of app.results"
        assert not any(_is_the_model(argument) for argument in _arguments(call)), \
            f"{page.name}:{call.lineno}: the model handed to {name}; only app.results runs the model"


def test_the_page_scan_sees_computations_and_handed_in_functions():
    """The two checks above on a planted page that does what the pages used to."""
    planted = ast.parse(
        "from app import results\nfrom experiments import attention, heads\nfrom experiments.ablation import head_sweep\n"
        "def _table(model, ids, progress):\n    return heads.head_scores_table(model, ids, progress=progress)\n"
        "table = results.with_progress(loaded, 'Scoring heads', _table, ids, bar=bar)\n"
        "sweep = head_sweep(loaded.model, tokens)\n"
        "summary = attention.head_summary(patterns, tokens)\n")
    assert sorted(name for name, _ in _experiment_calls(planted)) == ["head_scores_table", "head_summary", "head_sweep"]
    handed = [call for call in ast.walk(planted) if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
              and call.func.attr == "with_progress"]
    assert [arg.id for arg in handed[0].args if isinstance(arg, ast.Name)] == ["loaded", "_table", "ids"]
    assert _is_the_model(ast.parse("loaded.model", mode="eval").body)
    assert not _is_the_model(ast.parse("model.to_str_tokens(t)", mode="eval").body)
    assert not hasattr(results, "with_progress") and not hasattr(results, "has_result")


def test_every_long_run_has_its_own_text():
    """A long run's results are stored under its text: two runs sharing one would read each other's results."""
    runs = []
    for info in pkgutil.iter_modules(results.__path__, prefix="app.results."):
        for value in vars(importlib.import_module(info.name)).values():
            candidates = value.values() if isinstance(value, dict) else [value]  # exact patching keeps one per kind
            runs += [run for run in candidates if isinstance(run, LongRun)]
    texts = [run.text for run in runs]
    assert len(texts) >= 8 and len(set(texts)) == len(texts), texts


def _fresh(model) -> LoadedModel:
    """A loaded model under a key no other test has cached results on."""
    return LoadedModel(model, f"toy-attn-2l|{uuid.uuid4().hex}")


@pytest.fixture(scope="module")
def toy():
    return wb.load_model("toy-attn-2l", progress=False).eval()


def test_head_summary_is_cached_on_the_model_key_and_the_ids(toy, monkeypatch):
    computed = []
    summarise = attention.head_summary

    def counting(*args, **kwargs):
        computed.append(1)
        return summarise(*args, **kwargs)

    monkeypatch.setattr(attention, "head_summary", counting)
    loaded, ids = _fresh(toy), tuple(toy.to_tokens("The cat sat on the mat. The cat")[0].tolist())
    first = results.head_summary(loaded, ids)
    second = results.head_summary(loaded, ids)
    assert len(computed) == 1  # the second call is a cache hit
    pd.testing.assert_frame_equal(first, second)
    patterns_LHPS = attention.attention_patterns(toy, toy.to_tokens("The cat sat on the mat. The cat"))
    pd.testing.assert_frame_equal(first, summarise(patterns_LHPS, toy.to_tokens("The cat sat on the mat. The cat")[0]))
    results.head_summary(loaded, ids[:-1])  # other token ids: computed again
    results.head_summary(_fresh(toy), ids)  # another model key: computed again
    assert len(computed) == 3


def test_a_long_run_computes_and_draws_once(toy, monkeypatch):
    computed, drawn = [], []
    score = heads.head_scores_table

    def counting(*args, **kwargs):
        computed.append(1)
        return score(*args, **kwargs)

    def bar(text):
        drawn.append(text)
        return (lambda done, total: None), (lambda: None)

    monkeypatch.setattr(heads, "head_scores_table", counting)
    loaded, ids = _fresh(toy), tuple(toy.to_tokens("The cat sat on the mat. The cat")[0].tolist())
    first = results.head_scores(loaded, ids, False, bar=bar)
    second = results.head_scores(loaded, ids, False, bar=bar)
    assert second is first and computed == [1] and drawn == ["Scoring heads"]
    results.head_scores(loaded, ids, True, bar=bar)  # another argument: another run
    assert computed == [1, 1] and drawn == ["Scoring heads", "Scoring heads"]


def test_kernel_names_come_from_the_model_package():
    assert sorted(state.ATTN_IMPLS) == sorted(wb.ATTN_IMPLS) and state.ATTN_IMPLS[0] == "sdpa"
    listed = {node.value for node in ast.walk(ast.parse((APP / "state.py").read_text()))
              if isinstance(node, ast.Constant) and node.value in wb.ATTN_IMPLS}
    assert listed == {"sdpa"}  # the default is named; the list is not


def test_the_head_sweep_stays_drawn_once_run(dense):
    """The Ablation page draws the sweep again on a later run (``has_head_sweep``) without the button."""
    from app.results.long_runs import _store

    _store().clear()  # the store is process-wide: another file on this worker may have run this very sweep
    at = run_page("ablation", dense, SHORT_PROMPT)
    assert not any(c.proto.id.endswith("-head_sweep_chart") for c in at.get("plotly_chart"))
    at.button(key="ablation_sweep").click().run()
    swept = chart(at, "head_sweep")
    at.run()  # a rerun with the button not pressed: read from the long-run store
    assert_clean(at)
    assert chart(at, "head_sweep") == swept


def test_the_lens_run_is_made_once_shared_read_only_and_left_as_it_was(toy, monkeypatch):
    """The Logit lens page's one run per prompt: made by the lens itself (which reads each layer as the pass reaches
    it), then held once per process (not pickled per reader) and read by every attribution, a new top-k and a
    tuned lens without another forward; its readers must leave it bit-equal, and the mapping refuses writes."""
    from app.results import lens as lens_results
    from experiments.lenses import TunedLens
    from app.results.artifacts import LoadedArtifact

    forwards = []
    monkeypatch.setattr(type(toy), "forward", _counting(type(toy).forward, forwards))
    loaded, text = _fresh(toy), "The cat sat on the mat. The cat"
    ids = tuple(toy.to_tokens(text)[0].tolist())
    table = results.logit_lens(loaded, ids, 3, None, 2)
    run = lens_results._held_run(loaded, ids)
    assert run is not None and len(forwards) == 1
    before = {name: tensor.clone() for name, tensor in run.items()}
    with pytest.raises(TypeError):
        run["blocks.0.hook_resid_pre"] = None  # type: ignore[index]
    for position in (-1, 3):
        results.direct_logit_attribution(loaded, ids, ids[-1], ids[2], position)
    results.logit_lens(loaded, ids, 4, (2, 5), 1)
    held = LoadedArtifact("lens", "/demo", TunedLens.for_model(toy), "identity-lens-" + loaded.key)
    assert results.tuned_lens_table(loaded, ids, 3, held, None, 2).equals(table)  # identity translators
    assert len(forwards) == 1 and lens_results._run_of(loaded, ids) is run  # no other forward, nothing copied
    assert all(torch.equal(run[name], before[name]) for name in before)  # no reader wrote into it
    with torch.no_grad():  # it is the model's own run (grad off, as the page runs it)
        _, reference = toy.run_with_cache(toy.to_tokens(text), stop_at_layer=toy.cfg.n_layers,
                                          names_filter=list(before))
    assert all(torch.equal(before[name], reference[name]) for name in before)


def _counting(forward, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)
    return counted
