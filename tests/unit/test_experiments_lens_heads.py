"""Logit lens, direct logit attribution, the per-head table and composition scores.

References: the model's own logits from a plain forward pass, the logit difference the
attribution decomposes, TransformerLens's ``composition_scores`` on ``FactoredMatrix`` circuits,
and the detectors / head sweep run separately.
"""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformer_lens import FactoredMatrix
from transformer_lens.utilities import composition_scores as tl_composition_scores

import workbench as wb
from workbench.errors import InputError
from experiments.ablation import head_sweep
from experiments.attention import attention_patterns
from experiments.detectors import head_detector_scores
from experiments.heads import composition_scores, head_scores_table
from experiments.lens import direct_logit_attribution, logit_lens, logit_lens_logits
from experiments.plots.lens import dla_figure, logit_lens_figure
from tests.unit.helpers import make_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu", "sinusoidal_postnorm"])
def test_logit_lens_at_the_last_layer_equals_the_models_logits(variant, tokens):
    model = make_model(variant)
    logits = model(tokens)[0]
    torch.testing.assert_close(logit_lens_logits(model, tokens)[-1], logits, rtol=0, atol=1e-5)
    df = logit_lens(model, tokens, top_k=3)
    assert list(df.columns) == ["layer", "position", "rank", "token", "token_id", "prob"]
    assert len(df) == (model.cfg.n_layers + 1) * tokens.shape[1] * 3
    final = df[df.layer == model.cfg.n_layers].sort_values(["position", "rank"])
    top = logits.softmax(-1).topk(3)
    assert final.token_id.tolist() == top.indices.flatten().tolist()
    torch.testing.assert_close(torch.tensor(final.prob.values), top.values.flatten(), rtol=1e-5, atol=1e-6)
    assert logit_lens_figure(df).data


def test_logit_lens_first_snapshot_is_the_unembedded_embedding(tokens):
    model = make_model("attn_only_tied")
    embedded = model.embed.W_E[tokens[0]]
    expected = model.unembed(model.ln_final(embedded[None]))[0]
    torch.testing.assert_close(logit_lens_logits(model, tokens)[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu", "alibi_gelu_new", "moe_gqa", "attn_only_tied"])
@pytest.mark.parametrize("baseline", [None, 11])
@pytest.mark.parametrize("position", [-1, 4])
def test_direct_logit_attribution_sums_to_the_logit_difference(variant, baseline, position, tokens):
    model = make_model(variant)
    logits = model(tokens)[0, position]
    expected = logits[5] - (logits[baseline] if baseline is not None else 0)
    df = direct_logit_attribution(model, tokens, 5, baseline, position)
    assert df.attribution.sum() == pytest.approx(expected.item(), abs=1e-4)
    assert df.attrs["logit_diff"] == pytest.approx(expected.item(), abs=1e-5)
    assert (df.component == "head").sum() == model.cfg.n_layers * model.cfg.n_heads
    assert dla_figure(df).data


@pytest.mark.parametrize("variant", ["mha_learned_ln", "alibi_gelu_new", "gqa_rotary_rms_swiglu"])
def test_direct_logit_attribution_is_exact_on_processed_weights_too(variant, tokens):
    model = make_model(variant)
    steps = dict(fold_ln=True, center_unembed=True, fold_value_biases=True,
                 center_writing_weights=model.cfg.normalization == "LN")
    model.process_weights_(**steps)
    logits = model(tokens)[0, -1]
    df = direct_logit_attribution(model, tokens, 5, 11)
    assert df.attribution.sum() == pytest.approx((logits[5] - logits[11]).item(), abs=1e-4)
    assert df.attrs["weights"] == "processed: " + ", ".join(step for step in
                                                            ("fold_ln", "center_writing_weights", "center_unembed",
                                                             "fold_value_biases") if steps[step])
    assert direct_logit_attribution(make_model(variant), tokens, 5).attrs["weights"] == "as loaded"


def test_dla_of_a_head_is_its_output_read_through_the_frozen_norm(tokens):
    model = make_model("gqa_rotary_rms_swiglu")
    _, cache = model.run_with_cache(tokens)
    scale = cache["ln_final.hook_scale"][0, -1]
    z = cache["blocks.1.attn.hook_z"][0, -1, 3]  # [d_head]
    head_out = z @ model.blocks[1].attn.W_O[3]  # W_O [n_heads, d_head, d_model]: head 3
    expected = (head_out / scale * model.ln_final.w) @ model.unembed.W_U[:, 5]  # W_U [d_model, d_vocab]
    df = direct_logit_attribution(model, tokens, 5)
    row = df[(df.component == "head") & (df.layer == 1) & (df["head"] == 3)]
    assert row.attribution.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu"])
def test_one_run_serves_the_logit_lens_and_every_attribution(variant, tokens):
    # TransformerLens's way: run_with_cache once, then analyses read the cache. The values are those of each
    # function's own run, and a cache that lacks a hook or is of other tokens is refused.
    model = make_model(variant)
    _, cache = model.run_with_cache(tokens)
    for target in (3, 7):
        shared = direct_logit_attribution(model, tokens, target, 5, cache=cache)
        alone = direct_logit_attribution(model, tokens, target, 5)
        torch.testing.assert_close(torch.tensor(shared.attribution.values), torch.tensor(alone.attribution.values),
                                   rtol=0, atol=1e-5)
    lens_shared, lens_alone = logit_lens(model, tokens, 3, cache=cache), logit_lens(model, tokens, 3)
    assert lens_shared.token_id.tolist() == lens_alone.token_id.tolist()
    assert (lens_shared.prob - lens_alone.prob).abs().max() < 1e-5
    partial = {name: cache[name] for name in cache.keys() if "hook_z" not in name}
    with pytest.raises(InputError, match="the cache lacks .*hook_z"):
        direct_logit_attribution(model, tokens, 3, cache=partial)
    with pytest.raises(InputError, match=r"the cache's .* is \(1, 9\) \[batch, pos\], but these tokens are \(1, 4\)"):
        logit_lens(model, tokens[:, :4], 3, cache=cache)


def test_dla_rejects_post_norm_models_and_bad_tokens(tokens):
    with pytest.raises(wb.InputError, match=r"post-norm, ln\(x \+ f\(x\)\)"):
        direct_logit_attribution(make_model("sinusoidal_postnorm"), tokens, 5)
    with pytest.raises(wb.InputError, match="outside the vocabulary"):
        direct_logit_attribution(make_model("mha_learned_ln"), tokens, 500)


@pytest.mark.parametrize("kind", ["Q", "K", "V"])
@pytest.mark.parametrize("variant", ["mha_learned_ln", "gqa_rotary_rms_swiglu"])
def test_composition_scores_match_transformer_lens(kind, variant):
    model = make_model(variant, n_layers=3)
    stack = lambda attr: torch.stack([getattr(b.attn, attr) for b in model.blocks]).detach()
    W_Q, W_K, W_V, W_O = stack("W_Q"), stack("W_K"), stack("W_V"), stack("W_O")
    left = FactoredMatrix(W_V, W_O)
    right = {"Q": FactoredMatrix(W_Q, W_K.transpose(-2, -1)), "K": FactoredMatrix(W_Q, W_K.transpose(-2, -1)).T,
             "V": FactoredMatrix(W_V, W_O)}[kind]
    expected = tl_composition_scores(left, right, broadcast_dims=True)
    earlier = torch.arange(3)[:, None, None, None] < torch.arange(3)[None, None, :, None]
    expected = torch.where(earlier, expected, torch.zeros_like(expected))
    torch.testing.assert_close(composition_scores(model, kind), expected, rtol=1e-4, atol=1e-6)


def test_composition_scores_on_latent_attention_name_it():
    model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=61, n_ctx=16, positional="rotary",
                                      normalization="RMS", d_head=12, rotary_dim=4,
                                      latent=wb.LatentAttentionConfig(kv_lora_rank=16, q_lora_rank=20, d_head_v=10)))
    with pytest.raises(wb.InputError, match="multi-head latent attention"):  # was a bare AttributeError
        composition_scores(model, "K")


def test_python_m_runs_each_command_line():
    """``python -m experiments.<name>`` runs the command line, now in ``experiments.cli.<name>``."""
    probe = ("import contextlib, io, runpy, sys\n"
             "for name in ('lens', 'heads', 'flow', 'router'):\n"
             "    sys.argv, out = [name, '--help'], io.StringIO()\n"
             "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
             "        runpy.run_module(f'experiments.{name}', run_name='__main__', alter_sys=True)\n"
             "    print(out.getvalue().split(chr(10))[0])\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    usages = done.stdout.strip().splitlines()
    assert [line.split(" [")[0] for line in usages] == [f"usage: python -m experiments.{name}"
                                                        for name in ("lens", "heads", "flow", "router")]


def test_head_scores_table_collects_every_score():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(4))
    table = head_scores_table(model, tokens, progress=False)
    assert list(table.columns) == ["layer", "head", "induction", "previous_token", "duplicate_token", "entropy",
                                   "ablation_delta"]
    detectors = head_detector_scores(model, tokens)
    for kind in ("induction", "previous_token", "duplicate_token"):
        torch.testing.assert_close(torch.tensor(table[kind].values), detectors[kind].flatten())
    torch.testing.assert_close(torch.tensor(table.ablation_delta.values),
                               torch.tensor(head_sweep(model, tokens, progress=False).delta.values))
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    p = cache["pattern", 1][:, 2]  # [batch, q, k] of L1H2
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
    assert table[(table.layer == 1) & (table["head"] == 2)].entropy.item() == pytest.approx(entropy.item(), abs=1e-5)
    assert head_scores_table(model, tokens, include_ablation=False).ablation_delta.isna().all()
    # One prompt's patterns computed already (the dashboard's cached ones): the same scores, no forward pass.
    one = tokens[:1]
    from_patterns = head_scores_table(model, one, include_ablation=False, patterns_LHPS=attention_patterns(model, one))
    for kind, scores in head_detector_scores(model, one).items():
        torch.testing.assert_close(torch.tensor(from_patterns[kind].values), scores.flatten())
    with pytest.raises(InputError, match="one prompt"):
        head_scores_table(model, tokens, include_ablation=False, patterns_LHPS=attention_patterns(model, one))


@pytest.mark.parametrize("workers", [1, 2])
def test_the_lens_read_during_its_pass_is_the_lens_read_from_a_cache(workers):
    """``logit_lens_with_cache`` reads each snapshot as the pass reaches it: its table is bit-equal to ``logit_lens``'s
    read from a cache of the same run (positions and screen, a tuned lens, a padded batch's row), the cache it returns
    is that run's, and no hook stays attached."""
    from experiments.lens import attribution_hook_names, logit_lens, logit_lens_with_cache, snapshot_hook_names
    from experiments.lenses import TunedLens

    model = wb.load_model("toy-attn-2l", progress=False).eval()
    tuned = TunedLens.for_model(model).attach(model)
    with torch.no_grad():
        for parameter in tuned.layer_translators.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)  # not the identity: the translators matter
    cases = [  # (tokens, the prompt alone, options)
        (model.to_tokens("The cat sat on the mat. The cat sat"), None, dict(screen=True, positions=[3, 7, 9])),
        (model.to_tokens("When Mary and John went to the store, John gave"), None, dict(tuned_lens=tuned)),
        (["The cat sat on the mat", "The cat"], model.to_tokens("The cat"), dict(row=1)),
    ]
    names = attribution_hook_names(model)
    for tokens, alone, options in cases:
        table, run = logit_lens_with_cache(model, tokens, 4, names_filter=names, workers=workers, **options)
        assert model.attached_hooks() == {}
        with torch.no_grad():
            _, reference = model.run_with_cache(tokens if alone is None else alone, stop_at_layer=model.cfg.n_layers,
                                                names_filter=names + snapshot_hook_names(model))
        pd.testing.assert_frame_equal(table, logit_lens(model, tokens, 4, cache=reference, **options))
        assert sorted(run.keys()) == sorted(names)
        assert all(torch.equal(run[name], reference[name]) for name in names)
