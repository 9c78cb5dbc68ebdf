"""TransformerLens 4.3's ``tools.analysis`` run unchanged on our models, with a ``TransformerBridge``'s values.

Reference: ``TransformerBridge.boot_transformers(hf_model=...)`` wraps the very `transformers` model we
saved (a multi-head GPT-2 and a grouped-query Llama from ``hf_tiny``), and each tool is called the same
way on it and on ``wb.load_model`` of the same directory. The tools that refuse our model, and why, are
listed in docs/guides/coming-from-transformerlens.md (edge granularity and ``attention_head_subspace_affinity``:
test_tl_edge_tools.py); the random-init control has our own ``experiments.causal.reinitialized``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformer_lens.tools.analysis as tla
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.patching import get_act_patch_direct_path
from transformers import PreTrainedTokenizerFast

import workbench as wb
from tests.integration.hf_tiny import VOCAB, build_and_save

FAMILIES = ["gpt2", "llama"]  # multi-head (6 heads) and grouped-query (6 query heads over 2 KV heads)
ANSWER, WRONG = 5, 7
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(our model, a bridge of the same weights, the HF directory, the family) for one family."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_and_save(request.param, directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf_model, tokenizer=tokenizer,
                                                     device="cpu")
    return wb.load_model(directory), bridge, directory, request.param


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, VOCAB, (2, 8), generator=generator), torch.randint(3, VOCAB, (2, 8), generator=generator)


def _logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, ANSWER] - logits[0, -1, WRONG]


def test_attribution_patch_node_scores_match_bridge(pair, prompts):
    ours, bridge, _, _ = pair
    clean, corrupt = prompts
    reference = tla.attribution_patch(bridge, clean, corrupt, _logit_diff).node_scores
    result = tla.attribution_patch(ours, clean, corrupt, _logit_diff).node_scores
    assert set(result) == set(reference)
    assert max(abs(result[node] - reference[node]) for node in reference) < TOL
    assert max(abs(v) for v in reference.values()) > 0.1  # the scores are not all ~0
    assert not ours.hook_dict["blocks.0.hook_resid_post"].fwd_hooks  # nothing left attached


def test_logit_lens_matches_bridge(pair, prompts):
    ours, bridge, _, _ = pair
    clean, _ = prompts
    reference = tla.logit_lens(bridge, clean, incl_mid=True)
    result = tla.logit_lens(ours, clean, incl_mid=True)
    assert result.labels == reference.labels
    assert (result.values - reference.values).abs().max().item() < TOL
    # the last entry is the model's own prediction, so the lens reproduces the forward
    assert (result.values[-1] - ours(clean)[:, -1].log_softmax(-1)).abs().max() < 1e-3 or \
        (result.values[-1] - ours(clean)[:, -1]).abs().max() < 1e-3


def test_direct_logit_attribution_matches_bridge_in_compatibility_mode(pair, prompts):
    _, _, directory, family = pair
    clean, _ = prompts
    # DLA reads W_U as the readout, so the final norm's gain must be folded into it first: on a bridge
    # by compatibility mode, on ours (as on a HookedTransformer) by the default weight processing
    ours = wb.load_model(directory)
    ours.process_weights_()
    hf_model = build_and_save(family, directory)  # same seed, same weights
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf_model, tokenizer=tokenizer,
                                                     device="cpu")
        bridge.enable_compatibility_mode()  # DLA refuses a bridge without it
    reference = tla.direct_logit_attribution(bridge, clean, answer_tokens=ANSWER, incorrect_tokens=WRONG)
    result = tla.direct_logit_attribution(ours, clean, answer_tokens=ANSWER, incorrect_tokens=WRONG)
    assert result.labels == reference.labels
    assert (result.attribution - reference.attribution).abs().max().item() < TOL
    assert reference.attribution.abs().max() > 0.05


def test_interchange_and_fit_das_match_bridge(pair, prompts):
    ours, bridge, _, _ = pair
    base, source = prompts
    hook, positions = "blocks.0.hook_resid_post", torch.tensor([3, 5])
    values = {}
    for name, model in (("bridge", bridge), ("ours", ours)):
        def task_logits(tokens, model=model):
            return model(tokens)[:, -1, [ANSWER, WRONG]]
        acts = tla.collect_activations(model, hook, source, task_logits, positions=positions)
        basis = tla.random_basis(model.cfg.d_model, 4, seed=0)
        swap = tla.SubspaceInterchange(basis)
        placebo = tla.NormMatchedPlacebo(swap, tla.random_basis(model.cfg.d_model, 4, seed=1))
        das = tla.fit_das(model, hook, base, source, torch.tensor([0, 1]), task_logits, rank=2,
                          base_positions=positions, source_positions=positions, epochs=3)
        values[name] = (acts, tla.intervened_logits(model, hook, swap, base, acts, task_logits, positions=positions),
                        tla.intervened_logits(model, hook, placebo, base, acts, task_logits, positions=positions),
                        torch.tensor(das.losses), das.basis)
    for reference, result in zip(values["bridge"], values["ours"][:4]):
        assert (result - reference).abs().max().item() < TOL
    # Adam divides each step by the gradient's running size, so 1e-7 differences in near-zero gradient
    # entries move the learned basis by up to ~lr * 0.3 over three steps; the losses above agree to 1e-4
    assert (values["ours"][4] - values["bridge"][4]).abs().max().item() < 1e-2
    assert not ours.hook_dict[hook].fwd_hooks


def test_sparse_probe_on_our_activations_matches_bridge(pair):
    ours, bridge, _, _ = pair
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, VOCAB, (40, 6), generator=generator)
    labels = (tokens[:, 2] % 2).long()  # a feature of the input both models see identically
    fits = []
    for model in (bridge, ours):
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens, names_filter="blocks.0.hook_resid_post")
        fits.append(tla.fit_sparse_probe(cache["blocks.0.hook_resid_post"][:, 2], labels, k=4, seed=0))
    reference, result = fits
    assert torch.equal(result.selected_features, reference.selected_features)
    assert (result.coefficients - reference.coefficients).abs().max().item() < 1e-3
    assert result.metrics.accuracy == pytest.approx(reference.metrics.accuracy)


def test_projection_kernel_of_our_head_subspaces_matches_bridge(pair):
    ours, bridge, _, _ = pair
    kernels = []
    for model in (bridge, ours):
        out = tla.orthonormal_subspace(model.W_O[0, 0].T.detach())  # head 0.0's write subspace [D, d_head]
        read = tla.orthonormal_subspace(model.W_V[1, 0].detach())  # head 1.0's value-read subspace
        kernels.append(tla.projection_kernel(out, read).score.item())
    assert kernels[1] == pytest.approx(kernels[0], abs=TOL)


@pytest.mark.parametrize("component", ["q", "k", "v"])
def test_direct_path_patching_matches_bridge(pair, prompts, component):
    ours, bridge, _, family = pair
    clean, corrupt = prompts
    results = []
    for model in (bridge, ours):
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(clean)
            _, corrupt_cache = model.run_with_cache(corrupt)
        run = lambda: get_act_patch_direct_path(model, corrupt, clean_cache, corrupt_cache,  # noqa: E731
                                                lambda logits: _logit_diff(logits), src_layer=0, src_head=1,
                                                component=component, verbose=False)
        if component != "q" and family == "llama":  # TransformerLens refuses K/V paths on GQA, on both alike
            with pytest.raises(ValueError, match="GQA"):
                run()
            return
        results.append(run())
    reference, result = results
    assert (result - reference).abs().max().item() < TOL
    assert reference[1].abs().max() > 0.05  # layer 1's rows are measurements, not placeholders
    assert not ours.cfg.use_split_qkv_input  # the sweep restored the switch
