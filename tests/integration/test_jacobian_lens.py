"""TransformerLens 4.3's Jacobian lens on a ``wb.load_model`` model, against the same tool on a ``TransformerBridge``
booted from the same HF checkpoint (the tiny random Llama transformers 4.57 saved in tests/fixtures/lenses).

Expected values: TransformerLens's own ``JacobianLens.fit`` / ``readout`` on the Bridge (its estimator, its
readout through the Bridge's final norm and unembedding).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import workbench as wb
from experiments.lenses import JacobianLens
from transformer_lens.tools.analysis.jacobian_lens import JacobianLens as ToolJacobianLens
from workbench.errors import InputError

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "lenses" / "tiny_llama"
PROMPTS = ["the cat sat on the mat and then it was happy", "a red dog ran to the big house and it was happy",
           "the big red cat ran to a house"]


@pytest.fixture(scope="module")
def models():
    from transformer_lens.model_bridge import TransformerBridge

    ours = wb.load_model(str(CHECKPOINT), progress=False).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(str(CHECKPOINT), device="cpu")
    return ours, bridge.eval()


@pytest.fixture(scope="module")
def lenses(models):
    ours, bridge = models
    options = dict(corpus="tiny", skip_first_positions=2, dim_batch=4, show_progress=False)
    return JacobianLens.fit(ours, PROMPTS, **options), JacobianLens.fit(bridge, PROMPTS, **options)


def test_the_tool_itself_refuses_our_model_and_the_wrapper_keeps_its_names(models):
    ours, _ = models
    with pytest.raises(TypeError, match="TransformerBridge only"):
        ToolJacobianLens.fit(ours, PROMPTS, corpus="tiny", skip_first_positions=2, show_progress=False)
    assert issubclass(JacobianLens, ToolJacobianLens)


def test_transport_matrices_equal_the_tools_on_a_bridge_of_the_same_weights(lenses):
    ours, bridge = lenses
    assert ours.source_layers == bridge.source_layers == [0, 1]
    assert ours.n_prompts == bridge.n_prompts == len(PROMPTS)
    for layer in ours.source_layers:
        torch.testing.assert_close(ours.jacobians[layer], bridge.jacobians[layer], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("use_jacobian", [True, False])
def test_readout_logits_equal_the_tools_on_a_bridge(models, lenses, use_jacobian):
    model, bridge_model = models
    ours, bridge = lenses
    mine = ours.readout(model, PROMPTS[0], top_k=5, use_jacobian=use_jacobian, return_full_logits=True)
    theirs = bridge.readout(bridge_model, PROMPTS[0], top_k=5, use_jacobian=use_jacobian, return_full_logits=True)
    assert sorted(mine.lens_logits) == sorted(theirs.lens_logits) == [0, 1, 2]
    for layer in theirs.lens_logits:
        torch.testing.assert_close(mine.lens_logits[layer], theirs.lens_logits[layer], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mine.model_logits, theirs.model_logits, atol=1e-4, rtol=1e-4)
    assert mine.positions == theirs.positions and torch.equal(mine.tokens, theirs.tokens)


def test_a_lens_fitted_on_the_bridge_reads_our_model_the_same(models, lenses):
    model, bridge_model = models
    _, bridge_lens = lenses
    lens = JacobianLens(bridge_lens.jacobians, n_prompts=bridge_lens.n_prompts, d_model=bridge_lens.d_model)
    mine = lens.readout(model, PROMPTS[1], top_k=3, return_full_logits=True)
    theirs = lens.readout(bridge_model, PROMPTS[1], top_k=3, return_full_logits=True)
    for layer in theirs.lens_logits:
        torch.testing.assert_close(mine.lens_logits[layer], theirs.lens_logits[layer], atol=1e-4, rtol=1e-4)


def test_bad_input_is_a_clear_error(models, lenses):
    model, _ = models
    ours, _ = lenses
    with pytest.raises(InputError, match="source layers must be"):
        JacobianLens.fit(model, PROMPTS, corpus="tiny", source_layers=[2], show_progress=False)
    with pytest.raises(InputError, match="not in this lens's source layers"):
        JacobianLens({0: ours.jacobians[0]}, n_prompts=1, d_model=16).readout(model, PROMPTS[0], layers=[1])
    with pytest.raises(InputError, match="d_model"):
        JacobianLens({0: torch.eye(8)}, n_prompts=1, d_model=8).readout(model, PROMPTS[0])
    with pytest.raises(InputError, match="too short"):
        JacobianLens.fit(model, ["the cat"], corpus="tiny", show_progress=False)
