"""Head detectors and induction scores on a model whose heads were set by hand.

Expected values come from the construction (we know which head does what) and from
TransformerLens's own detection-pattern and scoring functions, never from our output.
"""

import pytest
import torch
from transformer_lens import head_detector as tl_detector

import workbench as wb
from experiments.detectors import (HEAD_KINDS, detection_patterns, duplicate_token_scores, induction_head_scores,
                                   previous_token_scores, score_patterns)
from experiments.induction import induction_loss, induction_scores, repeated_random_tokens

V, N_CTX, D_HEAD = 40, 32, 48
TOK, POS, PREV = 0, V, V + N_CTX  # residual subspaces: current token, position, previous token
D_MODEL = 2 * V + N_CTX
SEQ_LEN = 15  # 1 + 2 * 15 = 31 positions fit n_ctx = 32


def induction_circuit_model(attn_impl: str = "eager") -> wb.Decoder:
    """A 2-layer attention-only model with hand-set heads (the rest tiny random weights).

    L0H0: previous-token head (query at i looks for position i-1); copies that token into PREV.
    L0H1: duplicate-token head (query and key are the token itself); writes nothing.
    L1H0: induction head: query = current token, key = PREV (the token before the key), plus a
          default score for position 0 so it rests on BOS when nothing matches.
    L1H1: tiny random weights (near-uniform attention).
    """
    cfg = wb.ModelConfig(n_layers=2, d_model=D_MODEL, n_heads=2, d_head=D_HEAD, d_vocab=V, n_ctx=N_CTX,
                         attn_only=True, normalization="RMS", positional="learned")
    torch.manual_seed(0)
    model = wb.Decoder(cfg, attn_impl=attn_impl)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.01)
        for norm in (model.blocks[0].ln1, model.blocks[1].ln1, model.ln_final):
            norm.w.fill_(1.0)
        model.embed.W_E.zero_()
        model.embed.W_E[torch.arange(V), TOK + torch.arange(V)] = 1.0
        model.pos_embed.W_pos.zero_()
        model.pos_embed.W_pos[torch.arange(N_CTX), POS + torch.arange(N_CTX)] = 1.0
        # TransformerLens layout: W_Q/W_K/W_V [head, d_model, d_head], W_O [head, d_head, d_model].
        a0, a1 = model.blocks[0].attn, model.blocks[1].attn
        for W in (a0.W_Q, a0.W_K, a0.W_V, a1.W_Q, a1.W_K):
            W[0] = 0
        a0.W_O[0] = 0
        s = 2.0
        for i in range(1, N_CTX):
            a0.W_Q[0, POS + i, i - 1] = s
        for j in range(N_CTX):
            a0.W_K[0, POS + j, j] = s
        one_dim = (D_MODEL / 2) ** 0.5  # an active dimension after RMS norm (two of them are active)
        for t in range(V):
            a0.W_V[0, TOK + t, t] = 1.0
            a0.W_O[0, t, PREV + t] = 1.0 / one_dim
        a0.W_Q[1] = 0
        a0.W_K[1] = 0
        a0.W_O[1] = 0
        for t in range(V):
            a0.W_Q[1, TOK + t, t] = s
            a0.W_K[1, TOK + t, t] = s
        s1, to_bos = 2.4, 1.7
        for t in range(V):
            a1.W_Q[0, TOK + t, t] = s1
            a1.W_K[0, PREV + t, t] = s1
        a1.W_Q[0, POS:POS + N_CTX, D_HEAD - 1] = to_bos
        a1.W_K[0, POS, D_HEAD - 1] = to_bos
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return induction_circuit_model()


@pytest.fixture(scope="module")
def tokens(model):
    return repeated_random_tokens(model, seq_len=SEQ_LEN, batch=4)


def others_low(scores, keep, bound=0.3):
    mask = torch.ones_like(scores, dtype=torch.bool)
    mask[keep] = False
    return bool((scores[mask] < bound).all())


def test_repeated_random_tokens_shape_prefix_and_repeat(model):
    tokens = repeated_random_tokens(model, seq_len=SEQ_LEN, batch=3, seed=1)
    assert tokens.shape == (3, 1 + 2 * SEQ_LEN)
    assert (tokens[:, 0] == 0).all()  # no tokenizer: the fixed prefix token 0
    assert torch.equal(tokens[:, 1:SEQ_LEN + 1], tokens[:, SEQ_LEN + 1:])
    for row in tokens[:, 1:SEQ_LEN + 1]:
        assert len(set(row.tolist())) == SEQ_LEN and 0 not in row.tolist()
    assert torch.equal(tokens, repeated_random_tokens(model, seq_len=SEQ_LEN, batch=3, seed=1))
    assert not torch.equal(tokens, repeated_random_tokens(model, seq_len=SEQ_LEN, batch=3, seed=2))


def test_previous_token_head_is_found(model, tokens):
    scores = previous_token_scores(model, tokens)
    assert scores[0, 0] > 0.9
    assert others_low(scores, (0, 0))


def test_duplicate_token_head_is_found(model, tokens):
    # A duplicate-token head also attends to itself; TransformerLens's exclude_current_token drops that.
    scores = duplicate_token_scores(model, tokens, exclude_current_token=True)
    assert scores[0, 1] > 0.9
    assert others_low(scores, (0, 1))


def test_induction_head_is_found_by_detector_and_by_induction_scores(model, tokens):
    # The head rests on BOS in the first copy; exclude_bos makes the "mul" score measure the rest.
    detector = induction_head_scores(model, tokens, exclude_bos=True)
    assert detector[1, 0] > 0.9
    assert others_low(detector, (1, 0))
    scores = induction_scores(model, seq_len=SEQ_LEN, batch=6)
    assert scores.shape == (2, 2)
    assert scores[1, 0] > 0.9
    assert others_low(scores, (1, 0), bound=0.1)


def test_induction_scores_report_progress_per_layer(model):
    calls = []
    induction_scores(model, seq_len=5, batch=2, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 2), (2, 2)]


@pytest.mark.parametrize("attn_impl", ["sdpa", "flash"])
def test_scores_do_not_depend_on_the_attention_kernel(model, tokens, attn_impl):
    other = induction_circuit_model(attn_impl)
    torch.testing.assert_close(induction_scores(other, SEQ_LEN, 3), induction_scores(model, SEQ_LEN, 3))
    torch.testing.assert_close(previous_token_scores(other, tokens), previous_token_scores(model, tokens))


def test_induction_loss_falls_on_the_second_copy():
    # A 1-layer random model cannot predict either copy; the loss table must still be laid out
    # position by position: check it against the per-token loss computed here from the logits.
    cfg = wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=30, n_ctx=24)
    torch.manual_seed(1)
    small = wb.Decoder(cfg).eval()
    df = induction_loss(small, seq_len=10, batch=3)
    tokens = repeated_random_tokens(small, 10, 3)
    logits = small(tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").mean(0)
    assert list(df.columns) == ["position", "copy", "loss"] and len(df) == 20
    first, second = df[df["copy"] == "first"], df[df["copy"] == "second"]
    torch.testing.assert_close(torch.tensor(first.loss.values), expected[:10].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(second.loss.values), expected[10:].detach(), rtol=1e-5, atol=1e-5)
    assert second.position.tolist() == list(range(10))


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_detection_patterns_match_transformer_lens(kind):
    tokens = torch.tensor([[0, 5, 6, 7, 5, 6, 7, 7, 2]])
    reference = {"previous_token": tl_detector.get_previous_token_head_detection_pattern,
                 "duplicate_token": tl_detector.get_duplicate_token_head_detection_pattern,
                 "induction": tl_detector.get_induction_head_detection_pattern}[kind](tokens)
    torch.testing.assert_close(detection_patterns(kind, tokens)[0], reference.float())


@pytest.mark.parametrize("exclude_bos", [False, True])
@pytest.mark.parametrize("exclude_current_token", [False, True])
def test_mul_score_matches_transformer_lens(exclude_bos, exclude_current_token):
    torch.manual_seed(3)
    P = 9
    tokens = torch.tensor([[0, 5, 6, 7, 5, 6, 7, 7, 2]])
    pattern = torch.randn(1, 3, P, P).masked_fill(~torch.tril(torch.ones(P, P, dtype=torch.bool)), float("-inf")).softmax(-1)
    for kind, getter in (("induction", tl_detector.get_induction_head_detection_pattern),
                         ("duplicate_token", tl_detector.get_duplicate_token_head_detection_pattern)):
        ours = score_patterns(pattern, detection_patterns(kind, tokens), exclude_bos, exclude_current_token)
        for h in range(3):
            reference = tl_detector.compute_head_attention_similarity_score(
                pattern[0, h], getter(tokens).float(), exclude_bos=exclude_bos,
                exclude_current_token=exclude_current_token, error_measure="mul")
            assert ours[h].item() == pytest.approx(reference, abs=1e-6)
