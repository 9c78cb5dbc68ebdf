"""``ReplacementModel``: its replaced forward is the model when the errors are the true ones (reconstruction plus
(output minus reconstruction) is the output), its weight reads are the transcoders' own rows, and ``attribute``,
the attention explanations and ``intervene`` all freeze through its one ``freeze_hooks``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from experiments.attribution import ReplacementModel, attention_qk, attribute, edge_heads, intervene
from experiments.attribution.replacement import mlp_transcoders
from workbench.errors import InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"
ATTRIBUTION = Path(__file__).resolve().parents[2] / "experiments" / "attribution"
PROMPT = [1, 3, 4, 5, 6, 3, 7, 15]


@pytest.fixture(scope="module")
def tiny_llama():
    return wb.load_model(FIXTURES / "tiny_llama")


@pytest.mark.parametrize("name", ["plt", "plt_skip", "clt"])
def test_the_replaced_forward_with_the_true_errors_is_the_model(tiny_llama, name):
    tc = wb.load_transcoders(FIXTURES / name)
    tokens = torch.tensor(PROMPT)
    logits, cache = tiny_llama.run_with_cache(tokens[None])
    inputs = torch.stack([cache[tc.input_hook(l)][0] for l in range(tc.n_layers)])
    outputs = torch.stack([cache[tc.output_hook(l)][0] for l in range(tc.n_layers)])
    errors = outputs - tc.reconstruct([tc.encode(l, inputs[l]) for l in range(tc.n_layers)], inputs)
    replacement = ReplacementModel.from_model_and_transcoders(tiny_llama, tc)
    torch.testing.assert_close(replacement.forward(tokens, errors), logits[0], rtol=1e-5, atol=1e-5)
    # without the errors it is the transcoders alone, which these (small, imperfect) transcoders are not
    assert (replacement(tokens) - logits[0]).abs().max() > 1e-2


def test_a_models_own_mlp_as_its_transcoder_replaces_it_exactly():
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=20, n_ctx=16, act_fn="relu", d_mlp=24))
    W_in, W_out, b_in, b_out = (t.detach() for t in (model.W_in, model.W_out, model.b_in, model.b_out))
    tc = wb.TranscoderSet(W_enc=[W_in[l].T for l in range(2)], b_enc=[b_in[l] for l in range(2)], threshold=[None] * 2,
                          W_dec=[W_out[l][:, None] for l in range(2)], b_dec=b_out, feature_input_hook="mlp.hook_in",
                          feature_output_hook="mlp.hook_out")
    tokens = torch.tensor([3, 5, 7, 9, 11, 2])
    torch.testing.assert_close(ReplacementModel(model, tc).forward(tokens), model(tokens[None])[0],
                               rtol=1e-5, atol=1e-5)


def test_mlp_transcoders_are_the_models_own_relu_mlps():
    torch.manual_seed(0)
    model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=20, n_ctx=16, act_fn="relu", d_mlp=24))
    tc = mlp_transcoders(model)
    for l in range(2):   # W_enc [F, D] is W_in's transpose, W_dec [F, 1, D] is W_out: one feature per neuron
        assert torch.equal(tc.W_enc[l], model.W_in[l].T) and torch.equal(tc.W_dec[l][:, 0], model.W_out[l])
        assert torch.equal(tc.b_enc[l], model.b_in[l]) and tc.W_enc[l].data_ptr() != model.W_in.data_ptr()
    tokens = torch.tensor([3, 5, 7, 9, 11, 2])
    torch.testing.assert_close(ReplacementModel(model, tc).forward(tokens), model(tokens[None])[0],
                               rtol=1e-5, atol=1e-5)
    gelu = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, act_fn="gelu"))
    with pytest.raises(InputError, match="act_fn='gelu'"):
        mlp_transcoders(gelu)


def _file_rows(name: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """circuit-tracer's own files: ``W_enc [F, D]`` and ``W_dec [F, n_out, D]`` of one layer."""
    if name == "clt":
        return (load_file(str(FIXTURES / name / f"W_enc_{layer}.safetensors"))[f"W_enc_{layer}"],
                load_file(str(FIXTURES / name / f"W_dec_{layer}.safetensors"))[f"W_dec_{layer}"])
    file = load_file(str(FIXTURES / name / f"layer_{layer}.safetensors"))
    return file["W_enc"], file["W_dec"][:, None]


@pytest.mark.parametrize("name", ["plt_skip", "clt"])
def test_weight_reads_are_the_files_rows(tiny_llama, name):
    tc = wb.load_transcoders(FIXTURES / name)
    replacement = ReplacementModel(tiny_llama, tc)
    features = torch.tensor([5, 0, 11])
    for layer in range(tc.n_layers):
        W_enc, W_dec = _file_rows(name, layer)
        assert torch.equal(replacement.encoder_rows(layer, features), W_enc[features])
        acts = torch.zeros(3, tc.d_transcoder)
        acts[torch.arange(3), features] = torch.tensor([2.0, -1.0, 0.5])
        written = replacement.decode(layer, acts)
        expected = torch.zeros_like(written)
        expected[layer:layer + W_dec.shape[1]] = (torch.tensor([2.0, -1.0, 0.5])[:, None, None] * W_dec[features]
                                                  ).transpose(0, 1)
        assert torch.equal(written, expected)


def test_attribute_the_attention_explanations_and_intervene_share_one_freezing(tiny_llama, monkeypatch):
    tc = wb.load_transcoders(FIXTURES / "plt_skip")
    graph = attribute(tiny_llama, tc, PROMPT, max_n_logits=2, batch_size=64, progress=False)
    calls: list[str] = []
    freeze = ReplacementModel.freeze_hooks

    def counted(self, clean=None, scales=True):
        calls.append("clean" if clean is not None else "live")
        return freeze(self, clean, scales)

    monkeypatch.setattr(ReplacementModel, "freeze_hooks", counted)
    runs = {
        "attribute": lambda: attribute(tiny_llama, tc, PROMPT, max_n_logits=2, batch_size=64, progress=False),
        "edge_heads": lambda: edge_heads(tiny_llama, tc, graph, graph.n_nodes - 1, graph.n_nodes - 2 - 3),
        "attention_qk": lambda: attention_qk(tiny_llama, tc, graph, layer=1, head=0, query_pos=5, key_pos=2),
        "intervene": lambda: intervene(tiny_llama, tc, PROMPT, [(0, 3, 1, 2.0)]),
        "intervene, direct": lambda: intervene(tiny_llama, tc, PROMPT, [(0, 3, 1, 2.0)],
                                               constrained_layers=range(tc.n_layers)),
    }
    for name, run in runs.items():
        calls.clear()
        run()
        assert calls, f"{name} froze nothing through ReplacementModel.freeze_hooks"
    # and no other module of the package names what it freezes: one copy of the freezing
    for path in ATTRIBUTION.glob("*.py"):
        if path.name != "replacement.py":
            text = path.read_text()
            assert "hook_pattern" not in text and "hook_scale" not in text, path.name


def test_a_replacement_model_in_place_of_the_model_gives_the_same_results(tiny_llama):
    tc = wb.load_transcoders(FIXTURES / "plt")
    replacement = ReplacementModel.from_model_and_transcoders(tiny_llama, tc)
    options = dict(max_n_logits=2, batch_size=64, progress=False)
    ours = attribute(tiny_llama, tc, PROMPT, **options)
    assert torch.equal(attribute(replacement, None, PROMPT, **options).adjacency_matrix, ours.adjacency_matrix)
    direct = intervene(tiny_llama, tc, PROMPT, [(1, 4, 2, 3.0)], constrained_layers=range(tc.n_layers))
    again = intervene(replacement, None, PROMPT, [(1, 4, 2, 3.0)], constrained_layers=range(tc.n_layers))
    assert torch.equal(again.logits, direct.logits) and torch.equal(again.activations, direct.activations)
    with pytest.raises(InputError, match="brings its own transcoders"):
        attribute(replacement, wb.load_transcoders(FIXTURES / "clt"), PROMPT, progress=False)
    with pytest.raises(InputError, match="errors must have shape"):
        replacement.forward(torch.tensor(PROMPT), torch.zeros(1, 2, 3))
    assert not any(point._forward_hooks for point in tiny_llama.hook_dict.values())   # nothing left attached
