"""Classic TransformerLens notebook workflows, run unchanged on our model apart from the load line.

Each test is written the way a TransformerLens notebook writes it (``model.W_U``, ``cache.decompose_resid``,
``cache.logit_attrs``, ``model.OV``, ``transformer_lens.patching`` ...). The expected values come from
TransformerLens itself, running the same code on a ``TransformerBridge`` that wraps the very
`transformers` model we load (nothing fetched), or from that model's raw logits: never from our helpers.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import transformer_lens.patching as tl_patching
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.utilities import test_prompt as tl_test_prompt
from transformers import PreTrainedTokenizerFast

import workbench as wb
from tests.integration.hf_tiny import VOCAB, build_and_save

ARCHITECTURES = ["gpt2", "llama"]  # LayerNorm + biases + learned positions; RMSNorm + GQA + rotary + SwiGLU


@pytest.fixture(scope="module", params=ARCHITECTURES)
def setup(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_and_save(request.param, directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf_model, tokenizer=tokenizer, device="cpu")
    tokens = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    return request.param, directory, hf_model, bridge, tokens


def _caches(model, bridge, tokens):
    """Our cache and TransformerLens's (on the bridge) for the same tokens."""
    with torch.no_grad():
        return model.run_with_cache(tokens)[1], bridge.run_with_cache(tokens)[1]


def _top_two(hf_model, tokens):
    with torch.no_grad():
        logits = hf_model(tokens).logits[:, -1].float()
    top = logits.topk(2, dim=-1).indices
    return logits, top[:, 0], top[:, 1]


def test_direct_logit_attribution_with_decompose_resid_and_logit_attrs(setup):
    name, directory, hf_model, _, tokens = setup
    processing = dict(fold_ln=True, center_writing_weights=name == "gpt2", center_unembed=True)
    model = wb.load_model(directory, **processing)  # the load line: everything below is TransformerLens's recipe
    hf_logits, answer, wrong = _top_two(hf_model, tokens)
    _, cache = model.run_with_cache(tokens)
    residual_stack, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    attrs = cache.logit_attrs(residual_stack, tokens=answer, incorrect_tokens=wrong, pos_slice=-1)  # applies ln_final
    # The stack's components add up to the logit difference; a folded LayerNorm bias lives in b_U.
    bias_term = model.b_U[answer] - model.b_U[wrong]
    expected = hf_logits.gather(1, answer[:, None])[:, 0] - hf_logits.gather(1, wrong[:, None])[:, 0]
    torch.testing.assert_close(attrs.sum(0) + bias_term, expected, rtol=0, atol=1e-4)
    # The same by hand: the normed stack read along W_U[:, a] - W_U[:, b].
    normed = cache.decompose_resid(layer=-1, pos_slice=-1, apply_ln=True)  # [components, batch, d_model]
    by_hand = torch.einsum("cbd,db->b", normed, model.W_U[:, answer] - model.W_U[:, wrong])
    torch.testing.assert_close(by_hand + bias_term, expected, rtol=0, atol=1e-4)
    assert labels[0] == "embed" and labels[-1] == f"{model.cfg.n_layers - 1}_mlp_out"
    assert (expected.abs() > 1e-3).all()  # a real difference, not two equal logits


def test_full_residual_decomposition_sums_to_the_final_residual(setup):
    _, directory, _, bridge, tokens = setup
    model = wb.load_model(directory)
    final = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    cache, reference = _caches(model, bridge, tokens)
    parts = cache.get_full_resid_decomposition(expand_neurons=True, pos_slice=-1)
    torch.testing.assert_close(parts.sum(0), reference[final][:, -1], rtol=0, atol=1e-4)
    reference_parts = reference.get_full_resid_decomposition(expand_neurons=True, pos_slice=-1)
    torch.testing.assert_close(parts, reference_parts, rtol=0, atol=1e-4)


def test_ov_and_qk_circuit_eigenvalue_scores(setup):
    _, directory, _, bridge, _ = setup
    model = wb.load_model(directory)
    for layer, head in ((0, 0), (1, 4)):
        full_ov = model.W_E @ model.OV[layer, head] @ model.W_U  # [d_vocab, d_vocab], factored
        reference_ov = bridge.W_E @ bridge.OV[layer, head] @ bridge.W_U
        ours, expected = full_ov.eigenvalues, reference_ov.eigenvalues
        score = lambda ev: (ev.sum() / ev.abs().sum()).real  # copying score  # noqa: E731
        assert score(ours).item() == pytest.approx(score(expected).item(), abs=1e-4)
        torch.testing.assert_close(model.QK[layer, head].eigenvalues.abs().sort().values,
                                   bridge.QK[layer, head].eigenvalues.abs().sort().values, rtol=1e-4, atol=1e-5)


def test_neuron_attribution_with_stack_neuron_results(setup):
    _, directory, _, bridge, tokens = setup
    model = wb.load_model(directory)
    cache, reference = _caches(model, bridge, tokens)
    direction = model.W_U[:, 7] - model.W_U[:, 9]
    neurons, labels = cache.stack_neuron_results(layer=model.cfg.n_layers, pos_slice=-1, return_labels=True)
    expected = reference.stack_neuron_results(layer=model.cfg.n_layers, pos_slice=-1)
    torch.testing.assert_close(neurons, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(neurons @ direction, expected @ (bridge.W_U[:, 7] - bridge.W_U[:, 9]), rtol=0, atol=1e-4)
    assert len(labels) == model.cfg.n_layers * model.cfg.d_mlp and labels[0] == "L0N0"
    # each layer's neurons (plus its b_out) add up to that layer's MLP output
    per_layer = neurons.view(model.cfg.n_layers, model.cfg.d_mlp, *neurons.shape[1:]).sum(1)
    torch.testing.assert_close(per_layer + model.b_out[:, None], reference.stack_activation("mlp_out")[:, :, -1],
                               rtol=0, atol=1e-4)


def test_test_prompt_reports_what_transformer_lens_reports(setup):
    _, directory, _, bridge, _ = setup
    model = wb.load_model(directory)
    prompt, answer = "t5 t9 t14 t5 t9", " t14"

    def report(m) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            tl_test_prompt(prompt, answer, m, prepend_bos=True, top_k=3)
        return out.getvalue()

    ours, expected = report(model), report(bridge)
    rank_line = lambda text: [line for line in text.splitlines() if "Rank" in line]  # noqa: E731
    assert rank_line(ours) == rank_line(expected) and rank_line(ours)
    assert "Tokenized prompt" in ours


@pytest.mark.parametrize("patch", ["get_act_patch_resid_pre", "get_act_patch_attn_head_out_all_pos",
                                   "get_act_patch_mlp_out"])
def test_transformer_lens_patching_functions(setup, patch):
    _, directory, hf_model, bridge, tokens = setup
    model = wb.load_model(directory)
    clean, corrupt = tokens[:1, :8], tokens[1:, :8]
    _, answer, wrong = _top_two(hf_model, clean)

    def metric(logits):
        return logits[0, -1, answer[0]] - logits[0, -1, wrong[0]]

    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)
        _, reference_cache = bridge.run_with_cache(clean)
        ours = getattr(tl_patching, patch)(model, corrupt, clean_cache, metric)
        expected = getattr(tl_patching, patch)(bridge, corrupt, reference_cache, metric)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    assert expected.abs().max() > 1e-3


def test_every_cache_helper_matches_transformer_lens(setup):
    _, directory, _, bridge, tokens = setup
    model = wb.load_model(directory)
    cache, reference = _caches(model, bridge, tokens)
    with torch.no_grad():
        _, without_result = model.run_with_cache(tokens, names_filter=lambda name: not name.endswith("hook_result"))
    L = model.cfg.n_layers
    close = lambda ours, expected: torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)  # noqa: E731
    close(cache.accumulated_resid(apply_ln=True, pos_slice=-1), reference.accumulated_resid(apply_ln=True, pos_slice=-1))
    close(cache.accumulated_resid(layer=1, incl_mid=True), reference.accumulated_resid(layer=1, incl_mid=True))
    heads, labels = cache.stack_head_results(layer=L, pos_slice=-1, return_labels=True)
    close(heads, reference.stack_head_results(layer=L, pos_slice=-1))
    assert labels[:2] == ["L0H0", "L0H1"] and len(labels) == L * model.cfg.n_heads
    close(without_result.stack_head_results(layer=L, pos_slice=-1), heads)  # computed from hook_z and W_O
    stack = cache.decompose_resid(pos_slice=-1)
    close(cache.apply_ln_to_stack(stack, pos_slice=-1), reference.apply_ln_to_stack(stack, pos_slice=-1))
    close(cache.get_neuron_results(1, pos_slice=-1), reference.get_neuron_results(1, pos_slice=-1))
    close(cache.stack_activation("z"), reference.stack_activation("z"))
    without_result.compute_head_results()
    close(without_result["blocks.1.attn.hook_result"], reference["blocks.1.attn.hook_result"])
