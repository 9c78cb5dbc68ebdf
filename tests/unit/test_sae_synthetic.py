"""Synthetic ground truth (``experiments.sae.synthetic``) against SAELens 6.54.12's ``sae_lens.synthetic``.

Fixtures: ``tests/fixtures/synthetic/make_fixtures.py`` (run in the reference environment) saved a SyntheticModel in
SAELens's layout, its samples from fixed seeds and their statistics, three SAEs in SAELens's format and SAELens's
``eval_sae_on_synthetic_data`` results on recorded samples.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from experiments.sae.synthetic import (ActivationGenerator, FeatureDictionary, eval_sae_on_synthetic_data,
                                       mean_correlation_coefficient, perfect_sae, zipfian_firing_probabilities)
from experiments.sae.synthetic.hierarchy import HierarchyNode, hierarchy_modifier
from experiments.sae.synthetic.synthetic_model import SyntheticModel, SyntheticModelConfig
from experiments.sae.synthetic.training import train_sae_on_synthetic_data
from workbench.errors import CheckpointError, InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "synthetic"
METRICS = json.loads((FIXTURES / "metrics.json").read_text())
SAE_NAMES = sorted(METRICS["saes"])


@pytest.fixture(scope="module")
def model() -> SyntheticModel:
    return SyntheticModel.load_from_disk(FIXTURES / "model")


class Replay:
    """A generator that hands out the samples SAELens's evaluation drew, in order."""

    def __init__(self, samples: torch.Tensor):
        self.samples, self.at, self.num_features = samples, 0, samples.shape[1]

    def sample(self, batch_size: int) -> torch.Tensor:
        out = self.samples[self.at:self.at + batch_size]
        self.at += batch_size
        return out


def eval_samples() -> torch.Tensor:
    saved = load_file(FIXTURES / "eval_samples.safetensors")
    samples = torch.zeros(*saved["shape"].tolist())
    samples[saved["rows"], saved["cols"]] = saved["values"]
    return samples


def test_saelens_saved_model_loads_with_its_tensors_and_hierarchy(model):
    weights = load_file(FIXTURES / "model" / "synthetic_model.safetensors")
    assert torch.equal(model.feature_dict.feature_vectors, weights["feature_vectors"])
    assert torch.equal(model.feature_dict.bias, weights["bias"])
    assert torch.equal(model.activation_generator.firing_probabilities, weights["firing_probabilities"])
    assert torch.equal(model.correlation_matrix.correlation_factor, weights["correlation_factor"])
    hierarchy = json.loads((FIXTURES / "model" / "hierarchy.json").read_text())
    assert model.hierarchy.to_dict() == hierarchy
    assert (model.cfg.num_features, model.cfg.hidden_dim, len(model.hierarchy.roots)) == (64, 16, 4)


def test_samples_equal_saelens_from_the_same_seed(model):
    expected = load_file(FIXTURES / "samples.safetensors")
    torch.manual_seed(1)
    hidden, features = model.sample_with_features(256)
    assert torch.equal(features, expected["features"])
    torch.testing.assert_close(hidden, expected["hidden"], atol=1e-6, rtol=0)


def test_generator_statistics_match_saelens_on_other_seeds(model):
    expected = load_file(FIXTURES / "samples.safetensors")
    count = 20000
    torch.manual_seed(123)  # not SAELens's seed: the statistics, not the samples, are compared
    samples = model.activation_generator.sample(count)
    fires = (samples > 0).float()
    rate = fires.mean(0)
    # two independent estimates of a binomial rate differ by sqrt(2 p (1 - p) / n) in standard deviation
    spread = (2 * expected["firing_rate"] * (1 - expected["firing_rate"]) / count).sqrt()
    assert ((rate - expected["firing_rate"]).abs() <= 5 * spread + 1e-6).all()
    magnitude = samples.sum(0) / fires.sum(0).clamp(min=1)
    assert (magnitude - expected["mean_magnitude"]).abs().max() < 0.05
    correlation = torch.corrcoef(fires.T).nan_to_num(0.0)
    assert (correlation - expected["firing_correlation"]).abs().max() < 0.06
    # the hierarchy's mutual exclusion holds in every sample
    for root in model.hierarchy.roots:
        for node in [root, *root.children]:
            if node.mutually_exclusive_children:
                kids = [c.feature_index for c in node.children]
                assert (fires[:, kids].sum(1) <= 1).all()


def test_model_built_from_saelens_config_matches_its_saved_one(model):
    cfg = SyntheticModelConfig.from_dict(json.loads((FIXTURES / "model" / "synthetic_model_config.json").read_text()))
    built = SyntheticModel(cfg)
    torch.testing.assert_close(built.feature_dict.feature_vectors, model.feature_dict.feature_vectors,
                               atol=1e-5, rtol=0)
    assert torch.equal(built.activation_generator.firing_probabilities, model.activation_generator.firing_probabilities)
    assert built.hierarchy.to_dict() == model.hierarchy.to_dict()
    assert torch.equal(built.correlation_matrix.correlation_factor, model.correlation_matrix.correlation_factor)


@pytest.mark.parametrize("name", SAE_NAMES)
def test_metrics_equal_saelens_on_the_same_samples_and_sae(model, name):
    expected = METRICS["saes"][name]
    sae = wb.load_sae(FIXTURES / f"sae_{name}")
    result = eval_sae_on_synthetic_data(sae, model.feature_dict, Replay(eval_samples()),
                                        num_samples=METRICS["num_samples"], batch_size=METRICS["batch_size"])
    got = result.to_dict()
    assert got["dead_latents"] == expected["dead_latents"]
    for field in ("true_l0", "sae_l0", "shrinkage", "explained_variance", "mcc", "uniqueness"):
        assert got[field] == pytest.approx(expected[field], abs=1e-5), field
    for field, value in expected["classification"].items():
        assert got["classification"][field] == pytest.approx(value, abs=1e-5), field
    tp, fp, fn = (torch.tensor(expected["counts"][k]) for k in ("tp", "fp", "fn"))
    precision = torch.where(tp + fp > 0, tp / (tp + fp), torch.zeros_like(tp))
    recall = torch.where(tp + fn > 0, tp / (tp + fn), torch.zeros_like(tp))
    torch.testing.assert_close(result.per_latent["precision"], precision)
    torch.testing.assert_close(result.per_latent["recall"], recall)


def test_mcc_equals_scipy_hungarian_matching_on_rectangular_pairs():
    pairs = load_file(FIXTURES / "mcc_pairs.safetensors")
    for shape, expected in METRICS["mcc_pairs"].items():
        assert mean_correlation_coefficient(pairs[f"{shape}_0"], pairs[f"{shape}_1"]) == pytest.approx(expected,
                                                                                                        abs=1e-6)


def test_perfect_sae_scores_full_marks_without_superposition():
    fd = FeatureDictionary(8, 8, seed=0)
    torch.manual_seed(0)
    result = eval_sae_on_synthetic_data(perfect_sae(fd), fd, ActivationGenerator(8, 0.3), num_samples=512)
    assert result.mcc == pytest.approx(1.0, abs=1e-6) and result.uniqueness == 1.0
    assert result.explained_variance == pytest.approx(1.0, abs=1e-5)
    assert result.shrinkage == pytest.approx(1.0, abs=1e-4)


def test_topk_training_recovers_planted_features():
    fd = FeatureDictionary(32, 16, seed=0)  # 32 features in 16 dimensions: superposition
    gen = ActivationGenerator(32, zipfian_firing_probabilities(32, exponent=0.5, max_prob=0.2, min_prob=0.05),
                              std_firing_magnitudes=0.1)
    sae = train_sae_on_synthetic_data(fd, gen, "topk", k=3, training_samples=100_000, batch_size=512, lr=1e-2)
    torch.manual_seed(0)
    result = eval_sae_on_synthetic_data(sae, fd, gen, num_samples=4096)
    # SAELens's random top-k SAE in the fixtures scores MCC 0.60; trained, the features are found
    assert result.mcc > 0.85
    assert result.explained_variance > 0.7 and result.sae_l0 == 3.0


def test_bad_input_is_a_clear_error(model, tmp_path):
    fd = FeatureDictionary(8, 4, initializer=None, seed=0)
    with pytest.raises(InputError, match="k must be a number of features from 1 to d_sae=8"):
        train_sae_on_synthetic_data(fd, ActivationGenerator(8, 0.2), "topk", k=9, training_samples=1024)
    with pytest.raises(InputError, match="decodes to 16 dimensions; the feature dictionary's hidden dimension is 4"):
        eval_sae_on_synthetic_data(wb.load_sae(FIXTURES / "sae_perfect"), fd, ActivationGenerator(8, 0.2), 16)
    with pytest.raises(InputError, match="generator has 6 features; the dictionary has 8"):
        eval_sae_on_synthetic_data(perfect_sae(fd), fd, ActivationGenerator(6, 0.2), 16)
    with pytest.raises(InputError, match="firing_probabilities must be a float or a tensor of shape"):
        ActivationGenerator(4, torch.ones(3))
    with pytest.raises(InputError, match="more than one parent"):
        child = HierarchyNode(1)
        hierarchy_modifier([HierarchyNode(0, [child]), HierarchyNode(2, [child])])
    broken = tmp_path / "model"
    shutil.copytree(FIXTURES / "model", broken)
    config = json.loads((broken / "synthetic_model_config.json").read_text())
    (broken / "synthetic_model_config.json").write_text(json.dumps({**config, "hidden_dim": 8}))
    with pytest.raises(CheckpointError, match="feature_vectors has shape \\(64, 16\\); the config says \\(64, 8\\)"):
        SyntheticModel.load_from_disk(broken)
    (broken / "synthetic_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        SyntheticModel.load_from_disk(broken)


def test_hierarchy_scales_children_by_parent_over_its_mean_by_hand():
    modifier = hierarchy_modifier(HierarchyNode(0, [HierarchyNode(1)], scale_children_by_parent=True))
    generator = ActivationGenerator(2, 1.0, mean_firing_magnitudes=torch.tensor([2.0, 1.0]),
                                    modify_activations=modifier)
    # parent 3 over its mean 2 scales the child 4 to 6; an inactive parent silences the child
    assert modifier(torch.tensor([[3.0, 4.0], [0.0, 4.0]]), generator).tolist() == [[3.0, 6.0], [0.0, 0.0]]
