"""The architecture table (``workbench.sae.architectures``): one module per architecture holding its inference
encode and its training form, the generic parts (``wb.SAE``, its checks and saves, the trainers) looking the
architecture up, so a new one is a file and a registry line; the cross-layer transcoder encoding each layer as a
per-layer transcoder does. Expected values are hand calculations.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import workbench as wb
import workbench.sae.architectures as architectures
from experiments.sae.clt import TrainingCLT
from experiments.sae.modules import TrainingSAE
from workbench.sae.architectures.base import Encoding, rows

MODULES = sorted(info.name for info in pkgutil.iter_modules(architectures.__path__) if info.name != "base")


def test_every_architecture_module_is_registered_and_the_table_is_built_from_them():
    registered = {module.__name__.rsplit(".", 1)[1] for module in architectures._MODULES}
    assert registered == set(MODULES) == {"standard", "gated", "jumprelu", "topk", "batchtopk", "temporal",
                                          "abstopk", "matching_pursuit", "batchtopk_checkpoint", "matryoshka"}
    specs = [spec for name in MODULES for spec in importlib.import_module(f"{architectures.__name__}.{name}").SPECS]
    assert sorted(spec.name for spec in specs) == sorted(architectures.ARCHITECTURES)
    assert list(architectures.ARCHITECTURES) == ["standard", "gated", "jumprelu", "topk", "temporal",
                                                 "abstopk", "matching_pursuit", "batchtopk", "matryoshka_batchtopk",
                                                 "transcoder", "skip_transcoder", "jumprelu_transcoder",
                                                 "jumprelu_skip_transcoder"]
    assert set(architectures.TRAINING_FORMS) == {"standard", "jumprelu", "topk", "batchtopk", "matryoshka_batchtopk"}
    for form in architectures.TRAINING_FORMS.values():  # every form saves as rows of the table
        assert {name for name in form.saved_as if name} <= set(architectures.ARCHITECTURES), form.name


class AbsTopK(Encoding):
    """SAELens's abs-top-k: the k pre-activations largest in magnitude, sign kept."""

    activation = "abstopk"
    config_fields = ("k",)

    def activate(self, sae, hidden_pre):
        top = hidden_pre.abs().topk(sae.cfg.k, dim=-1).indices
        return torch.zeros_like(hidden_pre).scatter(-1, top, hidden_pre.gather(-1, top))


def test_a_row_added_to_the_table_runs_through_the_sae_its_checks_and_save(monkeypatch, tmp_path):
    (spec,) = rows(AbsTopK(), "abstopk")
    monkeypatch.setitem(architectures.ARCHITECTURES, "abstopk", spec)
    cfg = wb.SAEConfig("abstopk", d_in=3, d_sae=3, k=1, apply_b_dec_to_input=False)
    sae = wb.SAE.from_tensors(cfg, {"W_enc": torch.eye(3), "W_dec": 2 * torch.eye(3), "b_enc": torch.zeros(3),
                                    "b_dec": torch.ones(3)})
    features = sae.encode(torch.tensor([1.0, -4.0, 3.0]))
    assert torch.equal(features, torch.tensor([0.0, -4.0, 0.0]))  # the largest magnitude, its sign kept
    assert torch.equal(sae.decode(features), torch.tensor([1.0, -7.0, 1.0]))  # 2 * (-4) + 1 at feature 1
    assert torch.equal(wb.load_sae(sae.save(tmp_path / "abstopk")).W_dec, sae.W_dec)
    with pytest.raises(wb.InputError, match="missing 'b_enc'"):
        wb.SAE.from_tensors(cfg, {"W_enc": torch.eye(3), "W_dec": torch.eye(3), "b_dec": torch.zeros(3)})


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "batchtopk"])
def test_a_cross_layer_transcoder_encodes_each_layer_as_a_per_layer_transcoder(architecture):
    generator = torch.Generator().manual_seed(0)
    options = {"k": 2, "jumprelu_init_threshold": 0.3}
    clt = TrainingCLT(architecture, n_layers=2, d_model=4, d_transcoder=6, options=options, generator=generator)
    x = torch.randn(5, 2, 4, generator=generator)
    acts, hidden_pre = clt.encode(x)
    for layer, sae in enumerate(clt.transcoders.layers):
        pre = x[:, layer] @ sae.W_enc + sae.b_enc  # by hand: no centring, no decoder-norm rescaling
        assert torch.allclose(hidden_pre[:, layer], pre, atol=1e-6)
        tenth = pre.relu().flatten().sort(descending=True).values[9]  # batch-top-k keeps k * N = 10 of the layer's
        expected = {"standard": pre.relu(),
                    "jumprelu": pre * (pre > 0.3),
                    "batchtopk": pre.relu() * (pre >= tenth)}[architecture]
        assert torch.allclose(acts[:, layer], expected, atol=1e-6)
        alone = TrainingSAE(architecture, d_in=4, d_sae=6, d_out=4, transcoder=True, options=options)
        with torch.no_grad():
            alone.W_enc.copy_(sae.W_enc), alone.b_enc.copy_(sae.b_enc)
        per_layer, _ = alone.form.encode(alone.sae, x[:, layer], alone.form_state, options, rescale=False)
        assert torch.equal(per_layer, acts[:, layer])
