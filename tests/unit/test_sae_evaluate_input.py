"""``evaluate_sae`` refuses, before any forward pass, what it cannot score: a temporal SAE (its codes read earlier
positions), an SAE whose hook the model lacks, an SAE whose ``k`` exceeds its ``d_sae`` (refused by its config),
a bad batch size; each an error naming the problem, with no hook left attached."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.sae import evaluate_sae
from workbench.errors import ConfigError, InputError
from workbench.sae.architectures import architecture_spec


@pytest.fixture(scope="module")
def model():
    return wb.load_model("toy-attn-2l", progress=False).eval()


def _standard(d_in: int, hook: str) -> wb.SAE:
    cfg = wb.SAEConfig("standard", d_in=d_in, d_sae=8, metadata={"hook_name": hook})
    return wb.SAE.from_tensors(cfg, {"W_enc": torch.zeros(d_in, 8), "W_dec": torch.zeros(8, d_in),
                                     "b_enc": torch.zeros(8), "b_dec": torch.zeros(d_in)})


def _temporal(d_in: int, hook: str) -> wb.SAE:
    cfg = wb.SAEConfig("temporal", d_in=d_in, d_sae=2 * d_in, n_heads=2, bottleneck_factor=4, n_attn_layers=1,
                       kval_topk=8, tied_weights=False, metadata={"hook_name": hook})
    shapes = architecture_spec("temporal").weight_shapes(cfg.d_in, cfg.d_sae, cfg.d_out, cfg)
    generator = torch.Generator().manual_seed(0)
    return wb.SAE.from_tensors(cfg, {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()})


def _no_hooks_left(model) -> bool:
    return not any(point._forward_hooks for point in model.hook_dict.values())


def test_a_temporal_sae_is_refused_naming_why(model):
    sae = _temporal(model.cfg.d_model, "blocks.0.hook_resid_post")
    with pytest.raises(InputError, match="'temporal' SAE's codes read the positions before them"):
        evaluate_sae(model, sae, torch.randint(1, 100, (2, 8)), progress=False)
    assert _no_hooks_left(model)


def test_an_sae_whose_hook_the_model_lacks_is_refused(model):
    sae = _standard(model.cfg.d_model, "blocks.7.hook_resid_post")
    with pytest.raises(InputError, match="blocks.7.hook_resid_post"):
        evaluate_sae(model, sae, torch.randint(1, 100, (2, 8)), progress=False)
    assert _no_hooks_left(model)


def test_k_above_d_sae_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="k must be an integer from 1 to d_sae=8, got 9"):
        wb.SAEConfig("topk", d_in=4, d_sae=8, k=9, metadata={"hook_name": "blocks.0.hook_resid_post"})


@pytest.mark.parametrize("batch_size", [0, True, 1.5])
def test_a_bad_batch_size_is_refused(model, batch_size):
    with pytest.raises(InputError, match="batch_size"):
        evaluate_sae(model, _standard(model.cfg.d_model, "blocks.0.hook_resid_post"), torch.randint(1, 100, (2, 8)),
                     batch_size=batch_size, progress=False)


def test_not_an_sae_is_refused(model):
    with pytest.raises(InputError, match="sae must be a wb.SAE"):
        evaluate_sae(model, {"W_enc": torch.zeros(2, 2)}, torch.randint(1, 100, (2, 8)), progress=False)
