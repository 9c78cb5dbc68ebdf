"""Ablation: each method writes what it should, and the batched head sweep equals a per-head loop.

References: models whose weights were edited to remove a component (zeroed W_O / W_out), the
activations TransformerLens's cache records for the reference batch, and a plain loop of
``run_with_hooks`` calls with hooks written here.
"""

import pytest
import torch

import workbench as wb
from experiments.ablation import (AblationTarget, ablation_hooks, head_sweep, per_token_loss_change, run_ablated,
                                  top_predictions_change)
from tests.unit.helpers import make_model, same_weights



@pytest.fixture(scope="module")
def model():
    return make_model("gqa_rotary_rms_swiglu")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference():
    return torch.randint(0, 61, (4, 14), generator=torch.Generator().manual_seed(1))


def capture_after(name, store):
    """A hook registered after the ablation hook on the same point: sees the ablated value."""
    def hook(activation, hook):
        store[name] = activation.clone()
    return hook


def test_zero_ablating_every_head_equals_a_model_without_attention_output(model, tokens):
    targets = [AblationTarget("head", l, h) for l in range(2) for h in range(4)]
    no_attention = same_weights(model)
    with torch.no_grad():
        for block in no_attention.blocks:
            block.attn.W_O.zero_()
    torch.testing.assert_close(run_ablated(model, tokens, targets), no_attention(tokens), rtol=0, atol=1e-5)


def test_zero_ablating_layers_equals_zeroed_output_weights():
    model = make_model("alibi_gelu_new")  # attention and MLP biases: the layer output includes them
    tokens = torch.randint(0, 61, (2, 10))
    edited = same_weights(model)
    with torch.no_grad():
        edited.blocks[1].attn.W_O.zero_(); edited.blocks[1].attn.b_O.zero_()
        edited.blocks[0].mlp.W_out.zero_(); edited.blocks[0].mlp.b_out.zero_()
    targets = [AblationTarget("attn_layer", 1), AblationTarget("mlp_layer", 0)]
    torch.testing.assert_close(run_ablated(model, tokens, targets), edited(tokens), rtol=0, atol=1e-5)


def test_zero_ablating_a_neuron_equals_zeroing_its_output_column(model, tokens):
    edited = same_weights(model)
    with torch.no_grad():
        edited.blocks[0].mlp.W_out[7] = 0  # W_out [d_mlp, d_model]: neuron 7's output row
    torch.testing.assert_close(run_ablated(model, tokens, [AblationTarget("neuron", 0, 7)]), edited(tokens),
                               rtol=0, atol=1e-5)


def test_zero_ablating_an_expert_equals_zeroing_its_weights():
    model = make_model("moe_gqa")
    tokens = torch.randint(0, 61, (2, 10))
    edited = same_weights(model)
    with torch.no_grad():
        edited.blocks[1].mlp.W_out[2].zero_()  # the expert's output is zero; routing is unchanged
    torch.testing.assert_close(run_ablated(model, tokens, [AblationTarget("expert", 1, 2)]), edited(tokens),
                               rtol=0, atol=1e-5)
    assert not torch.allclose(model(tokens), edited(tokens), atol=1e-4)  # the expert was used


def test_mean_ablation_writes_the_reference_batch_mean(model, tokens, reference):
    name = "blocks.1.attn.hook_z"
    _, cache = model.run_with_cache(reference, names_filter=lambda n: n == name)
    expected_mean = cache[name][:, :tokens.shape[1], 2].mean(0)  # [pos, d_head]
    seen = {}
    hooks = ablation_hooks(model, [AblationTarget("head", 1, 2)], "mean", reference) + [(name, capture_after(name, seen))]
    model.run_with_hooks(tokens, fwd_hooks=hooks)
    for b in range(tokens.shape[0]):
        torch.testing.assert_close(seen[name][b, :, 2], expected_mean)
    _, clean = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    torch.testing.assert_close(seen[name][:, :, [0, 1, 3]], clean[name][:, :, [0, 1, 3]])  # other heads untouched


def test_resample_ablation_writes_another_prompts_activation(model, tokens, reference):
    name = "blocks.0.mlp.hook_post"
    _, cache = model.run_with_cache(reference, names_filter=lambda n: n == name)
    seen = {}
    hooks = ablation_hooks(model, [AblationTarget("neuron", 0, 5)], "resample", reference) + [(name, capture_after(name, seen))]
    model.run_with_hooks(tokens, fwd_hooks=hooks)
    for b in range(tokens.shape[0]):
        torch.testing.assert_close(seen[name][b, :, 5], cache[name][b % 4, :tokens.shape[1], 5])
    # Without a reference, run_ablated resamples from the next prompt of the input batch.
    _, own = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    expected_loss = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[
        (name, lambda act, hook: torch.cat([act[:, :, :5], own[name][[1, 2, 0], :, 5:6], act[:, :, 6:]], dim=2))])
    torch.testing.assert_close(run_ablated(model, tokens, [AblationTarget("neuron", 0, 5)], "resample",
                                           return_type="loss"), expected_loss)


def loop_sweep(model, tokens, method, reference, metric):
    """One run_with_hooks per head, with the replacement written out here."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    _, ref_cache = model.run_with_cache(reference, names_filter=lambda n: n.endswith("hook_z"))
    out = []
    for l in range(L):
        ref_z = ref_cache[f"blocks.{l}.attn.hook_z"][:, :tokens.shape[1]]
        for h in range(H):
            def hook(z, hook, h=h, ref_z=ref_z):
                z = z.clone()
                if method == "zero":
                    z[:, :, h] = 0
                elif method == "mean":
                    z[:, :, h] = ref_z[:, :, h].mean(0)
                else:
                    z[:, :, h] = ref_z[torch.arange(z.shape[0]) % ref_z.shape[0], :, h]
                return z
            logits = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", hook)])
            out.append(float(metric(logits, tokens).detach()))
    return torch.tensor(out)


def mean_loss(logits, tokens):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def last_logit_of_token_3(logits, tokens):
    return logits[:, -1, 3].mean()


@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "mha_learned_ln", "sinusoidal_postnorm", "moe_gqa"])
@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
def test_batched_head_sweep_equals_a_per_head_loop(variant, method, tokens, reference):
    model = make_model(variant)
    clean = float(mean_loss(model(tokens), tokens).detach())
    # A small tokens_per_pass forces several staircase chunks (chunks start at different layers).
    df = head_sweep(model, tokens, "loss", method, reference, progress=False, tokens_per_pass=100)
    expected = loop_sweep(model, tokens, method, reference, mean_loss)
    assert list(df.columns) == ["layer", "head", "metric", "delta"]
    assert df[["layer", "head"]].values.tolist() == [[l, h] for l in range(2) for h in range(4)]
    torch.testing.assert_close(torch.tensor(df.metric.values), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(df.delta.values), expected - clean, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["gqa_rotary_rms_swiglu", "sinusoidal_postnorm"])
def test_head_sweep_loss_computed_in_tiles_equals_the_loop(variant, tokens, monkeypatch):
    # The loss is computed from logits tiles; tiles this small (7 positions x 16 of the 61
    # tokens, both ragged at the end) put targets in every tile and split every variant's rows.
    import workbench.loss
    monkeypatch.setattr(workbench.loss, "TILE_POSITIONS", 7)
    monkeypatch.setattr(workbench.loss, "TILE_VOCAB", 16)
    model = make_model(variant)
    df = head_sweep(model, tokens, "loss", progress=False)
    torch.testing.assert_close(torch.tensor(df.metric.values), loop_sweep(model, tokens, "zero", tokens, mean_loss),
                               rtol=0, atol=1e-5)


def test_head_sweep_takes_a_callable_metric_and_reports_progress(model, tokens):
    calls = []
    df = head_sweep(model, tokens, last_logit_of_token_3, progress=lambda done, total: calls.append((done, total)))
    torch.testing.assert_close(torch.tensor(df.metric.values), loop_sweep(model, tokens, "zero", tokens, last_logit_of_token_3),
                               rtol=0, atol=1e-5)
    assert calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_per_token_loss_change(model, tokens):
    target = [AblationTarget("attn_layer", 0)]
    df = per_token_loss_change(model, tokens[:1], target)
    logits = model(tokens[:1])
    clean = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="none")
    ablated_logits = model.run_with_hooks(tokens[:1], fwd_hooks=[("blocks.0.hook_attn_out", lambda a, hook: a * 0)])
    ablated = torch.nn.functional.cross_entropy(ablated_logits[0, :-1], tokens[0, 1:], reduction="none")
    assert list(df.columns) == ["position", "token", "clean_loss", "ablated_loss", "delta"]
    assert df.position.tolist() == list(range(1, tokens.shape[1]))
    torch.testing.assert_close(torch.tensor(df.clean_loss.values), clean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(df.ablated_loss.values), ablated, rtol=1e-5, atol=1e-5)


def test_top_predictions_change(model, tokens):
    df = top_predictions_change(model, tokens[:1], [AblationTarget("mlp_layer", 1)], "zero", k=3)
    probs = model(tokens[:1])[0, -1].softmax(-1)
    assert df.clean_token_id.tolist() == probs.topk(3).indices.tolist()
    torch.testing.assert_close(torch.tensor(df.clean_prob.values), probs.topk(3).values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(kind="layer", layer=0), "kind must be one of"),
    (dict(kind="head", layer=0), "needs an index"),
    (dict(kind="attn_layer", layer=0, index=1), "index must be None"),
])
def test_bad_targets_are_named(bad, message):
    with pytest.raises(wb.InputError, match=message):
        AblationTarget(**bad)


def test_targets_that_do_not_exist_are_input_errors(model, tokens):
    for target, message in [(AblationTarget("head", 5, 0), "layer must be in"),
                            (AblationTarget("head", 0, 9), "index must be in"),
                            (AblationTarget("expert", 0, 0), "no mixture of experts")]:
        with pytest.raises(wb.InputError, match=message):
            run_ablated(model, tokens, [target])
    with pytest.raises(wb.InputError, match="method must be one of"):
        run_ablated(model, tokens, [AblationTarget("head", 0, 0)], "noise")
    with pytest.raises(wb.InputError, match="needs reference_tokens"):
        ablation_hooks(model, [AblationTarget("head", 0, 0)], "mean")
    with pytest.raises(wb.InputError, match="another prompt"):
        run_ablated(model, tokens[:1], [AblationTarget("head", 0, 0)], "resample")


def test_both_tables_from_one_pair_of_forwards_equal_each_alone(model):
    from experiments.ablation import loss_and_top_predictions_change, top_predictions_change

    prompts = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0   # row 1 is a 7-token prompt, right-padded
    targets = [AblationTarget("head", 1, 0), AblationTarget("mlp_layer", 0)]
    forwards = []
    hook = model.hook_dict["hook_embed"]
    hook.add_hook(lambda activation, hook: forwards.append(1), level=None, is_permanent=True)
    try:
        for row in (0, 1):   # a padded row reads as its prompt alone in both
            kwargs = dict(method="mean", row=row, attention_mask=mask)
            before = len(forwards)
            losses, top = loss_and_top_predictions_change(model, prompts, targets, k=4, **kwargs)
            together = len(forwards) - before
            assert losses.equals(per_token_loss_change(model, prompts, targets, **kwargs))
            alone = len(forwards) - before - together
            assert top.equals(top_predictions_change(model, prompts, targets, k=4, **kwargs))
            assert together == alone   # both tables for the forwards of one ("mean" adds one for its reference)
    finally:
        model.reset_hooks(including_permanent=True)
    with pytest.raises(wb.InputError, match="position must be 'last' or an index"):
        loss_and_top_predictions_change(model, prompts, targets, position=99)


@pytest.mark.parametrize("targets, method", [
    ([AblationTarget("head", 1, 0)], "zero"),                                    # the last layer alone
    ([AblationTarget("mlp_layer", 1), AblationTarget("head", 0, 2)], "mean"),     # the first ablated layer is 0
    ([AblationTarget("neuron", 1, 5)], "mean"),
])
@torch.no_grad()
def test_the_ablated_run_starts_at_the_first_ablated_layer_and_equals_a_whole_ablated_forward(model, targets, method):
    from experiments.ablation import loss_and_top_predictions_change
    from experiments.ablation.hooks import hooks_for_input
    from experiments.metrics import prompt_batch

    prompts = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0   # row 1: a 7-token prompt, left-padded
    kwargs = dict(attention_mask=mask, padding_side="left")
    first = min(target.layer for target in targets)
    # Passes through block 0: the clean run, the batch's own mean reference ("mean"), and the ablated run only when
    # it ablates block 0.
    passes = []
    model.hook_dict["blocks.0.hook_resid_pre"].add_hook(lambda a, hook: passes.append(1), level=None, is_permanent=True)
    try:
        for row in (0, 1):
            before = len(passes)
            losses, top = loss_and_top_predictions_change(model, prompts, targets, method, k=4, row=row, **kwargs)
            assert len(passes) - before == 1 + (method == "mean") + (first == 0)
            # By hand: the whole ablated forward from the embedding, under the same hooks.
            hooks = hooks_for_input(model, prompt_batch(model, prompts, mask, "left"), targets, method, None)
            logits_BPV = model.run_with_hooks(prompts, attention_mask=mask, fwd_hooks=hooks)
            real = mask[row].bool()
            logits_PV, tokens_P = logits_BPV[row][real], prompts[row][real]
            expected_loss = torch.nn.functional.cross_entropy(logits_PV[:-1], tokens_P[1:], reduction="none")
            torch.testing.assert_close(torch.tensor(losses["ablated_loss"].values), expected_loss, rtol=1e-5,
                                       atol=1e-6)
            probs_V = logits_PV[-1].softmax(-1)
            assert top["ablated_token_id"].tolist() == probs_V.topk(4).indices.tolist()
            torch.testing.assert_close(torch.tensor(top["ablated_prob"].values), probs_V.topk(4).values, rtol=1e-5,
                                       atol=1e-7)
            torch.testing.assert_close(torch.tensor(top["ablated_prob_of_clean"].values),
                                       probs_V[torch.tensor(top["clean_token_id"].values)], rtol=1e-5, atol=1e-7)
    finally:
        model.reset_hooks(including_permanent=True)


@torch.no_grad()
def test_top_predictions_are_the_clean_columns_of_the_ablation_table(model):
    from experiments.ablation import top_predictions

    prompts = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0   # row 1: a 6-token prompt, right-padded
    for row, position in ((0, "last"), (1, "last"), (1, 2)):
        top = top_predictions(model, prompts, k=4, position=position, row=row, attention_mask=mask)
        table = top_predictions_change(model, prompts, [AblationTarget("head", 1, 1)], k=4, position=position,
                                       row=row, attention_mask=mask)
        assert list(top.columns) == ["rank", "token", "token_id", "prob"]
        assert top["token_id"].tolist() == table["clean_token_id"].tolist()
        assert top["token"].tolist() == table["clean_token"].tolist()
        torch.testing.assert_close(torch.tensor(top["prob"].values), torch.tensor(table["clean_prob"].values),
                                   rtol=1e-5, atol=1e-7)
        column = 5 if position == "last" and row == 1 else (9 if position == "last" else 2)   # by hand
        probs_V = model(prompts[row:row + 1, :column + 1])[0, -1].softmax(-1)
        assert top["token_id"].tolist() == probs_V.topk(4).indices.tolist()
        torch.testing.assert_close(torch.tensor(top["prob"].values), probs_V.topk(4).values, rtol=1e-5, atol=1e-7)
