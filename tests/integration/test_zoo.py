"""The shipped zoo checkpoints: they load fast and hold the circuits their cards claim.

Scores are computed here straight from ``hook_pattern`` / ``hook_expert_indices`` (not from
``experiments``, whose functions wrote the cards), so the cards' claims are checked independently.
"""

import json
import time
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.loading.native import load_native
from workbench.loading.registry import REGISTRY

ZOO = Path(wb.__file__).resolve().parent / "zoo"
SEQ_LEN, BATCH = 40, 16  # repeated random sequences: BOS + 40 tokens + the same 40 again


def _installed(name: str) -> Path:
    directory = ZOO / name
    if not (directory / "config.json").is_file():
        pytest.fail(f"{directory} has no checkpoint: train it with `python -m experiments.zoo --recipe {name} "
                    f"--out {directory}`")
    return directory


@pytest.fixture(scope="module")
def attn_model():
    return load_native(_installed("toy-attn-2l"), attn_impl="sdpa")


@pytest.fixture(scope="module")
def moe_model():
    return load_native(_installed("toy-moe-2l"), attn_impl="sdpa")


@pytest.fixture(scope="module")
def repeated_tokens(attn_model):
    generator = torch.Generator().manual_seed(1234)
    bos = attn_model.tokenizer.bos_token_id
    copy = torch.stack([torch.randperm(attn_model.cfg.d_vocab - 1, generator=generator)[:SEQ_LEN] + 1
                        for _ in range(BATCH)])  # ids 1.., never BOS (id 0)
    assert bos == 0
    return torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), copy, copy], dim=1)


def _patterns(model, tokens, fwd_hooks=()):
    logits, cache = None, {}

    def keep(pattern, hook):
        cache[hook.layer()] = pattern.detach()

    hooks = list(fwd_hooks) + [(f"blocks.{l}.attn.hook_pattern", keep) for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        model.run_with_hooks(tokens, return_type=None, fwd_hooks=hooks)
    return cache


def _induction_scores(pattern_BHQK):
    """Mean attention from second-copy position i (S+1..2S) to i - S + 1, per head."""
    q = torch.arange(SEQ_LEN + 1, 2 * SEQ_LEN + 1)
    return pattern_BHQK[:, :, q, q - SEQ_LEN + 1].mean((0, 2))


def _zero_head(layer_heads):
    def hook(z, hook):
        z[:, :, layer_heads] = 0.0
        return z

    return hook


# ---- both checkpoints ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["toy-attn-2l", "toy-moe-2l"])
def test_checkpoint_is_small_registered_and_loads_in_well_under_a_second(name):
    directory = _installed(name)
    assert sum(f.stat().st_size for f in directory.iterdir()) <= 10 * 2**20
    assert REGISTRY[name].path() == directory
    listed = wb.list_models() if hasattr(wb, "list_models") else None
    if listed is not None:
        assert bool(listed.set_index("name").loc[name, "installed"])
    load_native(directory)  # warm the imports and the file cache
    started = time.perf_counter()
    model = wb.load_model(directory)
    assert time.perf_counter() - started < 0.5
    assert model.tokenizer is not None and model.to_tokens("import os")[0, 0].item() == 0  # BOS first


@pytest.mark.parametrize("name", ["toy-attn-2l", "toy-moe-2l"])
def test_model_card_reports_how_to_reproduce_the_corpus_split_and_held_out_loss(name):
    directory = _installed(name)
    card = (directory / "MODEL_CARD.md").read_text()
    metrics = json.loads((directory / "metrics.json").read_text())
    for phrase in ("## Reproduce", f"--recipe {name}", "## Corpus", "corpus_manifest.tsv", "held-out", "Seed",
                   "tokens seen", "## Config"):
        assert phrase in card, phrase
    assert f"{metrics['final']['held_out_loss']:.3f}" in card
    manifest = (directory / "corpus_manifest.tsv").read_text().splitlines()
    held_out = [line for line in manifest if line.startswith("held_out\t")]
    train = [line for line in manifest if line.startswith("train\t")]
    assert len(held_out) == (len(held_out) + len(train)) // 20


def test_the_two_models_beat_a_unigram_model_on_held_out_code():
    # A unigram model of code with a 2048-token BPE is around 6 nats/token; bigram-level ~4.
    for name in ("toy-attn-2l", "toy-moe-2l"):
        metrics = json.loads((_installed(name) / "metrics.json").read_text())
        assert metrics["final"]["held_out_loss"] < 4.0, name


# ---- toy-attn-2l: the induction circuit ----------------------------------------------------------------
def test_layer1_has_an_induction_head_and_layer0_a_previous_token_head(attn_model, repeated_tokens):
    patterns = _patterns(attn_model, repeated_tokens)
    assert _induction_scores(patterns[1]).max() > 0.5
    # previous-token score on real code: mean attention from each position to the one before it
    code = attn_model.to_tokens(Path(torch.__file__).read_text()[:3000])[:, :128]
    code_patterns = _patterns(attn_model, code)
    q = torch.arange(1, code.shape[1])
    assert code_patterns[0][:, :, q, q - 1].mean((0, 2)).max() > 0.5


def test_ablating_the_previous_token_head_weakens_the_induction_head(attn_model, repeated_tokens):
    patterns = _patterns(attn_model, repeated_tokens)
    induction_head = int(_induction_scores(patterns[1]).argmax())
    q = torch.arange(1, repeated_tokens.shape[1])
    previous_head = int(patterns[0][:, :, q, q - 1].mean((0, 2)).argmax())
    before = _induction_scores(patterns[1])[induction_head]
    ablated = _patterns(attn_model, repeated_tokens, [("blocks.0.attn.hook_z", _zero_head([previous_head]))])
    after = _induction_scores(ablated[1])[induction_head]
    assert after < before - 0.2, (before, after)  # K-composition: layer 1 needs layer 0's previous-token info


def test_in_context_learning_on_repeats_comes_from_the_induction_heads(attn_model, repeated_tokens):
    def copy_losses(fwd_hooks=()):
        with torch.no_grad():
            loss_BP = attn_model.run_with_hooks(repeated_tokens, return_type="loss", loss_per_token=True,
                                                fwd_hooks=list(fwd_hooks))
        # loss_BP[:, j] predicts token j+1; skip each copy's first token (unpredictable / needs no induction)
        return loss_BP[:, 1:SEQ_LEN].mean().item(), loss_BP[:, SEQ_LEN + 1:].mean().item()

    first, second = copy_losses()
    assert second < 0.5 * first  # the repeat is far easier: the model learns in context
    scores = _induction_scores(_patterns(attn_model, repeated_tokens)[1])
    induction_heads = [h for h in range(attn_model.cfg.n_heads) if scores[h] > 0.2]
    ablated_first, ablated_second = copy_losses([("blocks.1.attn.hook_z", _zero_head(induction_heads))])
    assert (ablated_first - ablated_second) < 0.5 * (first - second)  # most of the gap is gone


# ---- toy-moe-2l: uneven, content-dependent routing ----------------------------------------------------
@pytest.fixture(scope="module")
def moe_routing(moe_model):
    tokens = moe_model.to_tokens(Path(json.__file__).read_text() + Path(pytest.__file__).read_text())[0]
    rows = tokens[: (tokens.numel() // 128) * 128].view(-1, 128)[:24]
    choices = {}

    def keep(indices, hook):
        choices[hook.layer()] = indices

    with torch.no_grad():
        moe_model.run_with_hooks(rows, return_type=None,
                                 fwd_hooks=[(f"blocks.{l}.mlp.hook_expert_indices", keep) for l in range(2)])
    return rows, choices


def test_every_expert_gets_between_10_and_90_percent_of_tokens_in_every_layer(moe_model, moe_routing):
    _, choices = moe_routing
    for layer, indices_BPk in choices.items():
        chosen_NE = torch.nn.functional.one_hot(indices_BPk.flatten(0, 1), moe_model.cfg.num_experts).sum(1)
        load_E = chosen_NE.float().mean(0)
        assert ((load_E >= 0.1) & (load_E <= 0.9)).all(), (layer, load_E)


def test_routing_depends_on_the_token_not_on_position_alone(moe_model, moe_routing):
    rows, choices = moe_routing
    for layer, indices_BPk in choices.items():
        top_BP = indices_BPk[..., 0]
        # at one position, different tokens go to different experts
        distinct_per_position = [len(set(top_BP[:, p].tolist())) for p in range(top_BP.shape[1])]
        assert sum(d > 1 for d in distinct_per_position) > 0.9 * len(distinct_per_position)
        # and one token id mostly keeps its expert wherever it stands: pick the frequent ids
        ids, counts = rows.flatten().unique(return_counts=True)
        agreement = []
        for token in ids[counts >= 20]:
            experts = top_BP[rows == token]
            agreement.append(experts.bincount().max().item() / experts.numel())
        assert torch.tensor(agreement).mean() > 0.6, (layer, agreement)
