"""The graph is exact, checked by forward passes instead of gradients: in the model with attention patterns and
norm divisors frozen at their values on the prompt (and MLP outputs frozen but for the transcoders' skip terms),
(1) each target's total input from the adjacency is its pre-activation (or logit) minus what the non-node parts
(decoder biases, the first position's MLP outputs) give it, and (2) perturbing one source changes each target by
its edge weight, and so does a small intervention through ``intervene`` constrained to every layer. Also: perfect transcoders give zero error nodes and a replacement score of 1; bad input errors."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

import workbench as wb
from experiments.attribution import attribute, compute_graph_scores, intervene
from workbench.errors import ConfigError, InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"
PROMPT = [1, 3, 4, 5, 6, 3, 7, 15]
FINAL = "ln_final.hook_normalized"


@pytest.fixture(scope="module")
def tiny_llama():
    return wb.load_model(FIXTURES / "tiny_llama")


def frozen_run(model, tc, tokens, mlp_out: Callable, embed: Optional[Callable] = None) -> dict[int, torch.Tensor]:
    """The transcoders' inputs per layer (and the final norm's output as layer n) with every pattern and norm
    divisor replaced by its value on the true run and each MLP output by ``mlp_out(layer, input)``."""
    _, true = model.run_with_cache(tokens[None])
    reads: dict[int, torch.Tensor] = {}

    def frozen(acts, hook):
        return true[hook.name]

    def read(layer):
        def hook(acts, hook):
            reads[layer] = acts[0]
        return hook

    hooks = [(name, frozen) for name in model.hook_dict if name.endswith("hook_pattern") or name.endswith("hook_scale")]
    hooks += [(tc.input_hook(l), read(l)) for l in range(tc.n_layers)] + [(FINAL, read(tc.n_layers))]
    hooks += [(tc.output_hook(l), (lambda l: lambda acts, hook: mlp_out(l, reads[l])[None])(l)) for l in range(tc.n_layers)]
    if embed is not None:
        hooks.append(("hook_embed", lambda acts, hook: embed(acts[0])[None]))
    with torch.no_grad():
        model.run_with_hooks(tokens[None], fwd_hooks=hooks)
    return reads


def _true_values(model, tc, tokens):
    _, cache = model.run_with_cache(tokens[None])
    inputs = {l: cache[tc.input_hook(l)][0] for l in range(tc.n_layers)}
    inputs[tc.n_layers] = cache[FINAL][0]
    outputs = {l: cache[tc.output_hook(l)][0] for l in range(tc.n_layers)}
    return inputs, outputs


def _skip(tc, layer, x):
    skip = tc.skip(layer, x)
    return torch.zeros_like(x) if skip is None else skip


def _target_reads(graph, tc, model, reads) -> torch.Tensor:
    """Each target's read of ``reads``: features' pre-activations without b_enc, logits along their directions."""
    W_U = model.W_U.detach()
    values = []
    for index in graph.selected_features.tolist():
        layer, pos, feature = graph.active_features[index].tolist()
        values.append(tc.W_enc[layer][feature] @ reads[layer][pos])
    for token in graph.logit_token_ids.tolist():
        values.append((W_U[:, token] - W_U.mean(dim=1)) @ reads[tc.n_layers][-1])
    return torch.stack(values)


def _target_rows(graph) -> torch.Tensor:
    n_features, n_logits = len(graph.selected_features), len(graph.logit_token_ids)
    rows = graph.adjacency_matrix[torch.cat([torch.arange(n_features), torch.arange(graph.n_nodes - n_logits, graph.n_nodes)])]
    return rows[:, :graph.n_nodes - n_logits]


@pytest.mark.parametrize("name", ["plt_skip", "clt", "plt"])
def test_each_targets_total_input_is_its_recomputed_read(tiny_llama, name):
    tc = wb.load_transcoders(FIXTURES / name)
    tokens = torch.tensor(PROMPT)
    graph = attribute(tiny_llama, tc, tokens, max_n_logits=3, batch_size=64, progress=False)
    inputs, outputs = _true_values(tiny_llama, tc, tokens)

    def constant_part(layer, x):  # what no node accounts for: b_dec, and the first position's output but its skip
        out = tc.b_dec[layer].expand_as(x) + _skip(tc, layer, x)
        out[0] = outputs[layer][0] - _skip(tc, layer, inputs[layer][0:1])[0] + _skip(tc, layer, x[0:1])[0]
        return out

    constant = frozen_run(tiny_llama, tc, tokens, constant_part, embed=torch.zeros_like)
    expected = _target_reads(graph, tc, tiny_llama, inputs) - _target_reads(graph, tc, tiny_llama, constant)
    totals = _target_rows(graph).sum(dim=1)
    torch.testing.assert_close(totals, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("name", ["plt_skip", "clt"])
def test_perturbing_one_source_moves_each_target_by_its_edge(tiny_llama, name):
    tc = wb.load_transcoders(FIXTURES / name)
    tokens = torch.tensor(PROMPT)
    graph = attribute(tiny_llama, tc, tokens, max_n_logits=3, batch_size=64, progress=False)
    inputs, outputs = _true_values(tiny_llama, tc, tokens)
    rows = _target_rows(graph)
    base = _target_reads(graph, tc, tiny_llama, inputs)
    n_features = len(graph.selected_features)
    eps = 0.5

    def frozen_mlps(extra):
        return lambda layer, x: outputs[layer] - _skip(tc, layer, inputs[layer]) + _skip(tc, layer, x) + extra(layer)

    # a feature of layer 0 (it has targets downstream): its written vectors, scaled by eps
    source = next(i for i in range(n_features) if graph.active_features[graph.selected_features[i], 0] == 0)
    layer0, pos0, feature0 = graph.active_features[graph.selected_features[source]].tolist()
    activation = graph.activation_values[graph.selected_features[source]]

    def feature_delta(layer):
        delta = torch.zeros(len(tokens), tc.d_model)
        if layer in tc.output_layers(layer0):
            delta[pos0] = eps * activation * tc.W_dec[layer0][feature0, layer - layer0]
        return delta

    moved = _target_reads(graph, tc, tiny_llama, frozen_run(tiny_llama, tc, tokens, frozen_mlps(feature_delta))) - base
    torch.testing.assert_close(moved, eps * rows[:, source], rtol=1e-4, atol=1e-5 * rows.abs().max().item())

    # a token: its embedding scaled by 1 + eps
    token_pos = 3
    column = n_features + tc.n_layers * len(tokens) + token_pos

    def embed(acts):
        out = acts.clone()
        out[token_pos] = (1 + eps) * acts[token_pos]
        return out

    moved = _target_reads(graph, tc, tiny_llama, frozen_run(tiny_llama, tc, tokens, frozen_mlps(lambda l: 0), embed)) - base
    torch.testing.assert_close(moved, eps * rows[:, column], rtol=1e-4, atol=1e-5 * rows.abs().max().item())


def test_perfect_transcoders_leave_no_error():
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=20, n_ctx=16, act_fn="relu", d_mlp=24))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    W_in, W_out, b_in, b_out = (t.detach() for t in (model.W_in, model.W_out, model.b_in, model.b_out))
    tc = wb.TranscoderSet(W_enc=[W_in[l].T for l in range(2)], b_enc=[b_in[l] for l in range(2)], threshold=[None] * 2,
                          W_dec=[W_out[l][:, None] for l in range(2)], b_dec=b_out, feature_input_hook="mlp.hook_in",
                          feature_output_hook="mlp.hook_out")
    graph = attribute(model, tc, [3, 5, 7, 9, 11, 2], max_n_logits=4, batch_size=128, progress=False)
    n_features = len(graph.selected_features)
    errors = graph.adjacency_matrix[:, n_features:n_features + 2 * graph.n_pos]
    assert errors.abs().max() < 1e-5 * graph.adjacency_matrix.abs().max()
    replacement, completeness = compute_graph_scores(graph)
    assert replacement == pytest.approx(1.0, abs=1e-5) and completeness == pytest.approx(1.0, abs=1e-5)


def test_bad_input_is_a_clear_error(tiny_llama):
    tc = wb.load_transcoders(FIXTURES / "plt")
    other = wb.Decoder(wb.ModelConfig(n_layers=3, d_model=8, n_heads=2, d_vocab=20, n_ctx=16, act_fn="relu"))
    with pytest.raises(ConfigError, match="cover 3 layers of width 16, the model has 3 layers of width 8"):
        attribute(other, tc, [1, 2, 3], progress=False)
    two_layers = wb.TranscoderSet(W_enc=tc.W_enc[:2], b_enc=tc.b_enc[:2], threshold=tc.threshold[:2],
                                  W_dec=tc.W_dec[:2], b_dec=tc.b_dec[:2], feature_input_hook="mlp.hook_in",
                                  feature_output_hook="mlp.hook_out")
    with pytest.raises(ConfigError, match="cover 2 layers"):
        attribute(tiny_llama, two_layers, PROMPT, progress=False)
    with pytest.raises(InputError, match="more than the model's context"):
        attribute(tiny_llama, tc, [1] + [3] * 100, progress=False)
    with pytest.raises(InputError, match="token ids must be in"):
        attribute(tiny_llama, tc, [1, 3, 999], progress=False)
    with pytest.raises(InputError, match="max_n_logits must be a positive integer"):
        attribute(tiny_llama, tc, PROMPT, max_n_logits=0, progress=False)
    attn_only = wb.Decoder(wb.ModelConfig(n_layers=3, d_model=16, n_heads=2, d_vocab=20, n_ctx=16, attn_only=True))
    with pytest.raises(ConfigError, match="has no hook 'blocks.0.ln2.hook_normalized'"):
        attribute(attn_only, tc, [1, 2, 3], progress=False)
    assert not any(point._forward_hooks for point in tiny_llama.hook_dict.values())   # nothing left attached


@pytest.mark.parametrize("name", ["plt_skip", "clt"])
def test_a_small_direct_intervention_moves_targets_by_the_edge_weights(tiny_llama, name):
    tc = wb.load_transcoders(FIXTURES / name)
    graph = attribute(tiny_llama, tc, PROMPT, max_n_logits=3, batch_size=64, progress=False)
    rows = _target_rows(graph)
    source = int((graph.active_features[graph.selected_features, 0] == 0).nonzero()[0])
    layer, pos, feature = graph.active_features[graph.selected_features[source]].tolist()
    activation = float(graph.activation_values[graph.selected_features[source]])
    eps = 0.01
    everything = range(tc.n_layers)
    before = intervene(tiny_llama, tc, PROMPT, [(layer, pos, feature, activation)], constrained_layers=everything,
                       apply_activation_function=False)
    after = intervene(tiny_llama, tc, PROMPT, [(layer, pos, feature, (1 + eps) * activation)],
                      constrained_layers=everything, apply_activation_function=False)
    n_features = len(graph.selected_features)
    moved = [after.activations[l, p, f] - before.activations[l, p, f]
             for l, p, f in graph.active_features[graph.selected_features].tolist()]
    for token in graph.logit_token_ids.tolist():   # a logit node reads the logit minus the mean logit
        moved.append((after.logits[-1, token] - after.logits[-1].mean()) - (before.logits[-1, token] - before.logits[-1].mean()))
    moved = torch.stack(moved)
    assert rows[:, source].abs().max() > 0.01
    torch.testing.assert_close(moved, eps * rows[:, source], rtol=1e-3, atol=2e-5 * rows.abs().max().item())
    assert len(moved) == n_features + len(graph.logit_token_ids)


def test_unfrozen_intervention_is_the_real_model_with_the_decoded_change(tiny_llama):
    tc = wb.load_transcoders(FIXTURES / "plt")
    tokens = torch.tensor([PROMPT])
    _, cache = tiny_llama.run_with_cache(tokens)
    acts = tc.encode(1, cache[tc.input_hook(1)][0])
    pos, feature = 4, int(acts[4].argmax())
    change = (3.0 - acts[pos, feature]) * tc.W_dec[1][feature, 0]

    def add(out, hook):
        out = out.clone()
        out[0, pos] += change
        return out

    expected = tiny_llama.run_with_hooks(tokens, fwd_hooks=[(tc.output_hook(1), add)])[0]
    result = intervene(tiny_llama, tc, PROMPT, [(1, pos, feature, 3.0)], freeze_attention=False)
    torch.testing.assert_close(result.logits, expected, rtol=1e-5, atol=1e-5)
    assert result.activations[1, pos, feature] == pytest.approx(float(acts[pos, feature]), rel=1e-5)


def test_bad_interventions_and_saved_graphs_are_clear_errors(tiny_llama, tmp_path):
    tc = wb.load_transcoders(FIXTURES / "plt")
    for bad, match in (((3, 1, 0, 1.0), "layer must be in"), ((0, 1, 99, 1.0), "feature must be in"),
                       ((0, 40, 0, 1.0), "position must be a position"), ((0, 1, 0), r"is \(layer, position")):
        with pytest.raises(InputError, match=match):
            intervene(tiny_llama, tc, PROMPT, [bad])
    from experiments.attribution import AttributionGraph
    from workbench.errors import CheckpointError
    with pytest.raises(CheckpointError, match="not a saved attribution graph"):
        AttributionGraph.load(tmp_path / "nothing")
    assert not any(point._forward_hooks for point in tiny_llama.hook_dict.values())
