"""TransformerLens 4.3's edge-granularity ``attribution_patch`` / ``faithfulness`` and
``attention_head_subspace_affinity`` on our models, with a ``TransformerBridge``'s values.

The tools read a bridge's surface (``hook_dict`` listing aliases, ``blocks_with("attn")``);
``experiments.causal`` calls them on our model through that surface, names and signatures kept. The
reference is each tool on ``TransformerBridge.boot_transformers(hf_model=...)`` of the same weights (a
multi-head GPT-2 and a grouped-query Llama from ``hf_tiny``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformer_lens.tools.analysis as tla
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedTokenizerFast

import workbench as wb
from experiments.causal import attention_head_subspace_affinity, attribution_patch, faithfulness
from tests.integration.hf_tiny import VOCAB, build_and_save

ANSWER, WRONG = 5, 7
TOL = 1e-4
EDGES = tla.EdgeAttributionConfig(granularity="edge")


@pytest.fixture(scope="module", params=["gpt2", "llama"])  # multi-head, grouped-query (6 over 2 KV heads)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_and_save(request.param, directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf_model, tokenizer=tokenizer,
                                                     device="cpu")
    return wb.load_model(directory), bridge, request.param


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, VOCAB, (2, 8), generator=generator), torch.randint(3, VOCAB, (2, 8), generator=generator)


def _logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, ANSWER] - logits[0, -1, WRONG]


def _switches(model) -> tuple[bool, bool, bool]:
    return model.cfg.use_attn_result, model.cfg.use_split_qkv_input, model.cfg.use_hook_mlp_in


def test_edge_attribution_and_faithfulness_match_bridge(pair, prompts):
    ours, bridge, family = pair
    clean, corrupt = prompts
    if family == "llama":  # TransformerLens refuses edges on GQA: on the bridge and on ours alike
        refusals = []
        for run in (lambda: tla.attribution_patch(bridge, clean, corrupt, _logit_diff, EDGES),
                    lambda: attribution_patch(ours, clean, corrupt, _logit_diff, EDGES)):
            with pytest.raises(ValueError, match="GQA/MQA") as refused:
                run()
            refusals.append(str(refused.value))
        assert refusals[0] == refusals[1]
        assert _switches(ours) == (False, False, False)
        return
    reference = tla.attribution_patch(bridge, clean, corrupt, _logit_diff, EDGES)
    result = attribution_patch(ours, clean, corrupt, _logit_diff, EDGES)
    assert set(result.edge_scores) == set(reference.edge_scores)
    assert len(reference.edge_scores) == 1584  # 2 layers x 6 heads x 8 positions: q/k/v, MLP and logits readers
    assert max(abs(result.edge_scores[e] - reference.edge_scores[e]) for e in reference.edge_scores) < TOL
    assert max(abs(v) for v in reference.edge_scores.values()) > 0.05  # the scores are not all ~0
    circuit = reference.top_edges(20)
    assert [edge[:2] for edge in result.top_edges(20)] == [edge[:2] for edge in circuit]
    kept = tla.faithfulness(bridge, clean[:1], corrupt[:1], _logit_diff, circuit)
    ours_kept = faithfulness(ours, clean[:1], corrupt[:1], _logit_diff, circuit)
    assert ours_kept.recovered == pytest.approx(kept.recovered, abs=TOL)
    assert (ours_kept.full_metric, ours_kept.corrupt_metric) == pytest.approx((kept.full_metric, kept.corrupt_metric),
                                                                              abs=TOL)
    assert ours_kept.edge_class_counts == kept.edge_class_counts
    assert ours_kept.edge_class_recovered == pytest.approx(kept.edge_class_recovered, abs=TOL)
    assert _switches(ours) == (False, False, False)  # the tools restored the switches
    assert not any(point.fwd_hooks or point.bwd_hooks for point in ours.hook_dict.values())


@pytest.mark.parametrize("target_role", ["Q", "K", "V"])
def test_attention_head_subspace_affinity_matches_bridge(pair, target_role):
    ours, bridge, _ = pair
    reference = tla.attention_head_subspace_affinity(bridge, target_role=target_role, layer_order="all")
    result = attention_head_subspace_affinity(ours, target_role=target_role, layer_order="all")
    assert result.scores.shape == reference.scores.shape  # K/V on the key/value heads, as on the bridge
    assert (result.scores - reference.scores).abs().max().item() < TOL
    assert torch.equal(result.valid_mask, reference.valid_mask)
    assert result.source_layer_indices == reference.source_layer_indices
    assert torch.equal(result.target_ranks, reference.target_ranks)
    assert reference.scores.abs().max() > 0.1


def test_the_tools_called_directly_need_the_bridge_surface(pair, prompts):
    ours, _, family = pair
    with pytest.raises(ValueError, match="blocks_with"):
        tla.attention_head_subspace_affinity(ours, target_role="Q")
    if family == "gpt2":  # our hook_dict lists the per-head inputs once, as blocks.{l}.hook_q_input (k, v)
        with pytest.raises(ValueError, match="blocks.0.attn.hook_q_input"):
            tla.attribution_patch(ours, *prompts, _logit_diff, EDGES)
        assert _switches(ours) == (False, False, False)
    with pytest.raises(wb.InputError, match="Decoder"):
        attention_head_subspace_affinity(object(), target_role="Q")
