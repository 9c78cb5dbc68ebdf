"""The output head's top-k readout (``Decoder.top_logits_from_resid``, ``Unembed.screened_top_k``), exact and from a
bfloat16 screen: the exact path is the softmax of ``logits_from_resid`` (itself at parity with ``transformers``), the
screen keeps its ids and values, and a near-tie the screen cannot tell apart is ordered by the exact scores.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.lens import logit_lens
from workbench.vocab_readout import READOUT_ROWS_PER_BLOCK


def _decoder(**overrides) -> wb.Decoder:
    cfg = wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=300, n_ctx=16, d_mlp=32, **overrides)
    torch.manual_seed(0)
    model = wb.Decoder(cfg)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    return model.eval()


def test_the_exact_readout_is_the_softmax_of_the_logits_over_several_row_blocks():
    model = _decoder(unembed_bias=True, output_logits_soft_cap=5.0)
    rows = READOUT_ROWS_PER_BLOCK * 2 + 7  # three blocks, the last one short
    resid_ND = torch.randn(rows, 16) * 3
    values, ids, lse = model.top_logits_from_resid(resid_ND, 4)
    logits_NV = model.logits_from_resid(resid_ND[:, None])[:, 0]
    expected = logits_NV.softmax(-1).topk(4)
    assert torch.equal(ids, expected.indices)
    assert torch.allclose((values - lse[:, None]).exp(), expected.values, atol=1e-6)


def test_workers_read_the_blocks_at_once_with_the_callers_grad_mode():
    """Threads reading row blocks at once give the one-thread results bit for bit, exact and screened; under
    no_grad nothing they return carries a graph (grad mode is per thread), and a bad count is refused."""
    model = _decoder(unembed_bias=True, output_logits_soft_cap=5.0)
    resid_ND = torch.randn(READOUT_ROWS_PER_BLOCK * 3 + 5, 16) * 3  # four blocks, the last one short
    for screen in (None, torch.bfloat16):
        with torch.no_grad():
            alone = model.top_logits_from_resid(resid_ND, 4, screen)
            together = model.top_logits_from_resid(resid_ND, 4, screen, workers=3)
        assert all(torch.equal(a, b) for a, b in zip(alone, together))
        assert not any(t.requires_grad for t in together)
    assert model.top_logits_from_resid(resid_ND, 4, workers=2)[0].requires_grad  # outside no_grad: a graph, as alone
    with pytest.raises(wb.InputError, match="workers must be at least 1"):
        model.top_logits_from_resid(resid_ND, 4, workers=0)


def test_the_screen_gives_the_exact_ids_and_values_with_bias_and_soft_cap():
    model = _decoder(unembed_bias=True, output_logits_soft_cap=5.0)
    resid_ND = torch.randn(40, 16) * 3
    exact = model.top_logits_from_resid(resid_ND, 5)
    screened = model.top_logits_from_resid(resid_ND, 5, torch.bfloat16)
    assert torch.equal(screened[1], exact[1])
    assert torch.allclose(screened[0], exact[0], atol=1e-5)
    # The tail is read in bfloat16: a relative error near 2**-8 on each tail logit, not on the candidates.
    assert torch.allclose(screened[2], exact[2], atol=0.05)


def test_a_near_tie_the_screen_rounds_together_is_ordered_by_the_exact_scores():
    # Hand-built head: token 1's logit 1 + 2**-12 beats token 0's 1.0 by less than bfloat16 can tell (8 bits: both
    # round to 1.0); token 2 is far below. The screen sees a tie, the exact rescoring puts token 1 first.
    unembed = _decoder().unembed
    with torch.no_grad():
        unembed._W_U_lin.zero_()
        unembed._W_U_lin[0, 0] = 1.0
        unembed._W_U_lin[1, 0] = 1.0 + 2.0**-12
        unembed._W_U_lin[2, 0] = -4.0
    x_ND = torch.zeros(1, 16)
    x_ND[0, 0] = 1.0
    screen = torch.nn.functional.linear(x_ND.bfloat16(), unembed._W_U_lin.bfloat16())
    assert screen[0, 0] == screen[0, 1]  # the tie the screen cannot break
    values, ids, lse = unembed.screened_top_k(x_ND, 2, torch.bfloat16, margin=1)
    assert ids.tolist() == [[1, 0]]
    assert values.tolist() == [[1.0 + 2.0**-12, 1.0]]
    # logsumexp by hand: two exact candidates, token 2 (-4) from the screen, 297 zeros
    by_hand = torch.tensor([1.0 + 2.0**-12, 1.0, -4.0] + [0.0] * 297).logsumexp(0)
    assert abs(lse.item() - by_hand.item()) < 1e-6


def test_the_screened_copy_follows_the_weights():
    unembed = _decoder().unembed
    x_ND = torch.randn(3, 16)
    before = unembed.screened_top_k(x_ND, 1, torch.bfloat16)
    with torch.no_grad():
        unembed._W_U_lin.neg_()  # an in-place change: the held bfloat16 copy must not be reused
    after = unembed.screened_top_k(x_ND, 1, torch.bfloat16)
    expected = torch.nn.functional.linear(x_ND, unembed._W_U_lin).topk(1)
    assert torch.equal(after[1], expected.indices) and not torch.equal(after[1], before[1])


def test_the_screened_logit_lens_matches_the_exact_one_on_smollm2(smollm2):
    tokens = smollm2.to_tokens("The Eiffel Tower is in the city of Paris, and the Colosseum is in the city of Rome. "
                               "The river that runs through London is called the")
    exact, screened = logit_lens(smollm2, tokens, 5), logit_lens(smollm2, tokens, 5, screen=True)
    assert exact.attrs["screen"] is None
    assert screened.attrs["screen"] in ("bfloat16", None)  # None on a CPU without fast bfloat16: then it is exact
    assert screened["token_id"].tolist() == exact["token_id"].tolist()
    assert (screened["prob"] - exact["prob"]).abs().max() < 0.005


def test_rows_handed_in_as_they_come_read_as_all_at_once():
    """``top_logits_reader``: rows added a few at a time (as a forward hook hands in each snapshot), blocks filled
    across calls, give ``top_logits_from_resid``'s results bit for bit, on any worker count; the helpers end with the
    result; no rows, rows of the wrong width and a bad count are refused."""
    model = _decoder(unembed_bias=True)
    resid_ND = torch.randn(READOUT_ROWS_PER_BLOCK * 2 + 9, 16) * 3
    cuts = [0, 5, 5, 70, 71, 150, resid_ND.shape[0]]  # an empty piece, pieces across block edges
    with torch.no_grad():  # the reference: the softmax of the model's own logits (at parity with transformers)
        reference = model.logits_from_resid(resid_ND[:, None])[:, 0].softmax(-1).topk(3)
    for screen in (None, torch.bfloat16):
        with torch.no_grad():
            expected = model.top_logits_from_resid(resid_ND, 3, screen)
        assert torch.equal(expected[1], reference.indices)
        assert torch.allclose((expected[0] - expected[2][:, None]).exp(), reference.values, atol=1e-2 if screen else 1e-6)
        with torch.no_grad():
            for workers in (1, 2, 3):
                reader = model.top_logits_reader(3, screen, workers)
                for start, stop in zip(cuts, cuts[1:]):
                    reader.add(resid_ND[start:stop])
                assert all(torch.equal(a, b) for a, b in zip(reader.result(), expected))
                assert reader._pool is None  # the helpers ended with the result
    with model.top_logits_reader(3) as reader, pytest.raises(wb.InputError, match="no rows"):
        reader.result()
    with model.top_logits_reader(3, workers=2) as reader, pytest.raises(wb.InputError, match=r"\[rows, d_model=16\]"):
        reader.add(torch.zeros(4, 8))
    with pytest.raises(wb.InputError, match="workers must be at least 1"):
        model.top_logits_reader(3, workers=0)
