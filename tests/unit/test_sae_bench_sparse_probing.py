"""SAEBench's sparse probing (``experiments.sae.bench.sparse_probing``): its latent-selection rule, its
one-against-rest sets and accuracies on hand-worked inputs, the spread over seeds on the toy model, and bad input."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.datasets.labelled import LabelledTexts, labelled_texts
from experiments.sae.bench import run_bench
from experiments.probes import top_k_mean_diff
from experiments.sae.bench.sparse_probing import one_against_rest, probing_pass, sparse_probing_metrics
from workbench.errors import InputError

HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))


def _signed(model):
    """ReLU(x) and ReLU(-x): every direction of the residual is a pair of latents."""
    eye = torch.eye(model.cfg.d_model)
    d_sae = 2 * model.cfg.d_model
    return wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=model.cfg.d_model, d_sae=d_sae,
                                            metadata={"hook_name": HOOK}),
                               {"W_enc": torch.cat([eye, -eye], 1), "W_dec": torch.cat([eye, -eye]),
                                "b_enc": torch.zeros(d_sae), "b_dec": torch.zeros(model.cfg.d_model)})


def test_top_k_keeps_the_largest_absolute_mean_difference():
    # class 1 rows minus class 0 rows: column means (3, 1, 0, 2) - (0, 1, 4, 0) = 3, 0, -4, 2 -> |.| 3, 0, 4, 2
    x = torch.tensor([[0.0, 1.0, 4.0, 0.0], [0.0, 1.0, 4.0, 0.0], [3.0, 1.0, 0.0, 2.0], [3.0, 1.0, 0.0, 2.0]])
    labels = torch.tensor([0, 0, 1, 1])
    assert top_k_mean_diff(x, labels, 1).tolist() == [2]
    assert top_k_mean_diff(x, labels, 3).tolist() == [2, 0, 3]


def test_one_against_rest_balances_the_others_evenly():
    labels = torch.tensor([0] * 4 + [1] * 6 + [2] * 6)
    rows, binary = one_against_rest(labels, torch.arange(16), 0, torch.Generator().manual_seed(3))
    # 4 positives; ceil(4 / 2) = 2 drawn from each other class, then 4 of those 4
    assert int(binary.sum()) == 4 and len(rows) == 8
    assert sorted(rows[binary == 1].tolist()) == [0, 1, 2, 3]
    assert torch.bincount(labels[rows[binary == 0]], minlength=3).tolist() == [0, 2, 2]


def test_accuracy_of_a_hand_worked_pass():
    # Latent 0 is twice the label, latent 1 is constant: top-1 keeps latent 0 and is exact (accuracy 1).
    # The raw "activation" is one constant column: its probe predicts one class for every held-out row, which is
    # right on half of the balanced held-out rows (2 of 4): accuracy 1/2.
    labels = torch.tensor([0, 1] * 10)
    latents = torch.stack([labels.float() * 2.0, torch.ones(20)], 1)
    constant = torch.ones(20, 1)
    result = probing_pass(constant, latents, labels, seed=0, k_values=(1,))
    assert result["sae_top_1_test_accuracy"] == 1.0 and result["sae_test_accuracy"] == 1.0
    assert result["llm_top_1_test_accuracy"] == 0.5 and result["llm_test_accuracy"] == 0.5


def test_toy_model_on_code_against_prose_has_a_spread(model):
    data = labelled_texts("code_vs_prose", per_class=16)
    table = sparse_probing_metrics(model, _signed(model), [data], seeds=(0, 1, 2), k_values=(1, 2, 5),
                                   progress=False)
    assert {"value", "std", "seed_0", "seed_1", "seed_2", "task"} <= set(table.columns)
    assert table.loc["llm_test_accuracy", "value"] > 0.75  # code and prose are far apart even at layer 0
    for name in ("sae_top_1_test_accuracy", "llm_top_5_test_accuracy"):
        assert 0.5 <= table.loc[name, "value"] <= 1.0
        assert table.loc[name, "value"] == pytest.approx(table.loc[name, ["seed_0", "seed_1", "seed_2"]].mean())
    assert (table["std"] >= 0).all() and table.loc["code_vs_prose/llm_test_accuracy", "task"] == "code_vs_prose"
    again = sparse_probing_metrics(model, _signed(model), [data], seeds=(0, 1, 2), k_values=(1, 2, 5),
                                   progress=False)  # from the disk cache
    assert again.equals(table)
    bench = run_bench(model, {"signed": _signed(model)}, None, measures=("sparse_probing",), seeds=(0, 1),
                      tasks=[data], k_values=(1,), progress=False)
    assert set(bench["eval"]) == {"sparse_probing"} and "sae_top_1_test_accuracy" in set(bench["measure"])


def test_bad_input_is_refused(model):
    one_class = LabelledTexts("one", ("a b c", "d e f", "g h i"), (0, 0, 0), ("only",))
    with pytest.raises(InputError, match="one class"):
        sparse_probing_metrics(model, _signed(model), [one_class], progress=False)
    two = LabelledTexts("two", ("a b c", "d e f", "x y z", "u v w"), (0, 0, 1, 1), ("a", "b"))
    with pytest.raises(InputError, match="larger than d_sae"):
        sparse_probing_metrics(model, _signed(model), [two], k_values=(1000,), progress=False)
    elsewhere = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=model.cfg.d_model, d_sae=4,
                                                 metadata={"hook_name": "blocks.9.hook_resid_post"}),
                                    {"W_enc": torch.zeros(model.cfg.d_model, 4), "W_dec": torch.zeros(4, model.cfg.d_model),
                                     "b_enc": torch.zeros(4), "b_dec": torch.zeros(model.cfg.d_model)})
    with pytest.raises(InputError, match="blocks.9.hook_resid_post"):
        sparse_probing_metrics(model, elsewhere, [two], progress=False)
    with pytest.raises(InputError, match="task must be one of"):
        labelled_texts("klingon")
