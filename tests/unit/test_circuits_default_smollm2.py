"""The Circuits page's defaults find a faithful circuit on the dashboard's default model: on SmolLM2-135M the typed
IOI pair, EAP-IG's strongest ``DEFAULT_TOP_N`` edges, every other edge carrying the corrupted run's values, recover at
least half of the clean - corrupt logit difference (``experiments.circuits`` called directly, as the page's results
layer calls it)."""

from __future__ import annotations

import pytest

from app.results.circuits import (DEFAULT_ABLATION, DEFAULT_IG_STEPS, DEFAULT_METHOD, DEFAULT_TASK, DEFAULT_TOP_N,
                                  CircuitTask, task_pairs)
from app.widgets import DEFAULT_CLEAN, DEFAULT_CORRUPT
from experiments.circuits import discover_circuit, faithfulness

pytestmark = pytest.mark.slow


def test_the_page_defaults_recover_at_least_half_the_gap_on_smollm2(smollm2):
    model = smollm2
    assert DEFAULT_TASK == "pair"      # the page's pair widget starts at DEFAULT_CLEAN / DEFAULT_CORRUPT
    task = CircuitTask("pair", n=1, clean=DEFAULT_CLEAN, corrupt=DEFAULT_CORRUPT,
                       answer=model.to_single_token(" Mary"), wrong=model.to_single_token(" John"))
    pairs = task_pairs(model, task)
    circuit = discover_circuit(model, pairs, method=DEFAULT_METHOD, ig_steps=DEFAULT_IG_STEPS, top_n=DEFAULT_TOP_N)
    kept = faithfulness(model, pairs, circuit, DEFAULT_ABLATION)
    assert kept.clean_metric > 0 > kept.corrupt_metric         # the clean prompt prefers " Mary", the corrupted " John"
    assert circuit.n_edges == DEFAULT_TOP_N
    assert kept.recovered >= 0.5
