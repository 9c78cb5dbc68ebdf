"""run_with_cache over a dataset in batches: in memory, cache_size, the too-large error, bad input (streamed to
disk: test_cache_batches_on_disk.py).

Every expected value is a plain one-shot ``run_with_cache`` / forward pass over all the rows, or a
hand calculation (byte counts, the mean loss from one-shot per-token losses).
"""

from __future__ import annotations

import math

import pytest
import torch

import workbench as wb
import workbench.cache_batches as cache_batches
from tests.unit.batched_cache_setup import (B, P, VOCAB, assert_same_cache, cache_bytes, dataset, make_model,
                                            no_hooks_left, one_shot)
from tests.unit.helpers import make_model as make_variant


# ---- in memory -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gqa", "mha"])
@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("batch_size", [1, 3, B])
def test_batched_cache_logits_and_loss_equal_one_shot(kind, padding, batch_size):
    model = make_model(kind)
    tokens, mask = dataset(padding)
    expected_logits, expected = one_shot(model, tokens, mask)
    logits, cache = model.run_with_cache(tokens, attention_mask=mask, batch_size=batch_size, progress=False)
    assert_same_cache(cache, expected)
    assert (logits - expected_logits).abs().max() < 1e-5
    assert no_hooks_left(model)

    # The mean loss by hand: one-shot per-token losses over the pairs of two real tokens.
    with torch.no_grad():
        per_token = model(tokens, attention_mask=mask, return_type="loss", loss_per_token=True)
        whole = model(tokens, attention_mask=mask, return_type="loss")
    scored = torch.ones(B, P - 1, dtype=torch.bool) if mask is None else (mask[:, :-1] & mask[:, 1:]).bool()
    by_hand = per_token[scored].sum() / scored.sum()
    loss, _ = model.run_with_cache(tokens, "loss", attention_mask=mask, batch_size=batch_size, progress=False,
                                   names_filter="blocks.0.hook_resid_post")
    assert abs(loss.item() - by_hand.item()) < 1e-5 and abs(loss.item() - whole.item()) < 1e-5
    losses, _ = model.run_with_cache(tokens, return_type="loss", loss_per_token=True, attention_mask=mask,
                                     batch_size=batch_size, progress=False, names_filter=[])
    assert losses.shape == (B, P - 1) and (losses - per_token).abs().max() < 1e-5


def test_return_types_device_texts_and_stop_at_layer():
    model = make_model()
    tokens, mask = dataset("left")
    expected_logits, expected = one_shot(model, tokens, mask)
    for device in ("cpu", torch.device("cpu")):
        out, cache = model.run_with_cache(tokens, attention_mask=mask, batch_size=2, device=device, progress=False,
                                          return_type=None)
        assert out is None
        assert_same_cache(cache, expected)
        assert all(t.device == torch.device("cpu") for t in cache.values())
    (logits, loss), _ = model.run_with_cache(tokens, return_type="both", attention_mask=mask, batch_size=4,
                                             progress=False, names_filter=[])
    assert (logits - expected_logits).abs().max() < 1e-5
    assert abs(loss.item() - model(tokens, attention_mask=mask, return_type="loss").item()) < 1e-5

    texts = ["w5 w6 w7 w8", "w9", "w10 w11 w12", "w13 w14"]  # a list of texts builds its own mask
    expected_logits, expected = model.run_with_cache(texts, padding_side="left")
    logits, cache = model.run_with_cache(texts, padding_side="left", batch_size=3, progress=False)
    assert_same_cache(cache, expected)
    assert (logits - expected_logits).abs().max() < 1e-5

    resid, expected = one_shot(model, tokens, mask, stop_at_layer=1)
    got, cache = model.run_with_cache(tokens, attention_mask=mask, stop_at_layer=1, batch_size=3, progress=False)
    assert (got - resid).abs().max() < 1e-5 and "blocks.1.hook_resid_pre" not in cache
    assert_same_cache(cache, expected)


def test_without_batch_size_it_is_transformer_lens_run_with_cache():
    model = make_model()
    tokens, _ = dataset(None)
    logits, cache = model.run_with_cache(tokens, device="cpu", names_filter="blocks.0.hook_resid_post")
    assert list(cache.keys()) == ["blocks.0.hook_resid_post"] and cache.has_batch_dim
    _, single = model.run_with_cache(tokens[:1], remove_batch_dim=True)
    assert single["blocks.0.hook_resid_post"].shape == (P, 32) and not single.has_batch_dim
    _, sliced = model.run_with_cache(tokens, pos_slice=-1, names_filter="blocks.0.hook_resid_post")
    assert torch.equal(sliced["blocks.0.hook_resid_post"], cache["blocks.0.hook_resid_post"][:, -1:])
    _, batched = model.run_with_cache(tokens, pos_slice=-1, names_filter="blocks.0.hook_resid_post", batch_size=2,
                                      progress=False)
    # Two rows a batch against seven: the same sums in other GEMM blockings, equal to float rounding (not bitwise).
    torch.testing.assert_close(batched["blocks.0.hook_resid_post"], sliced["blocks.0.hook_resid_post"],
                               rtol=0, atol=1e-6)


def test_progress_bar_only_over_several_batches(capsys):
    model = make_model()
    tokens, _ = dataset(None)
    model.run_with_cache(tokens, batch_size=3, names_filter=[])
    assert "run_with_cache" in capsys.readouterr().err
    model.run_with_cache(tokens, batch_size=3, names_filter=[], progress=False)
    model.run_with_cache(tokens, batch_size=B, names_filter=[])
    assert capsys.readouterr().err == ""


# ---- cache_size and the too-large error ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gqa", "moe"])
@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("names_filter", [None, lambda n: n.endswith("hook_pattern")], ids=["all", "patterns"])
def test_cache_size_equals_the_bytes_of_the_real_cache(kind, padding, names_filter):
    model = make_model() if kind == "gqa" else make_variant("moe_gqa")  # MoE: integer expert ids, too
    tokens, mask = dataset(padding)
    _, cache = one_shot(model, tokens, mask, names_filter)
    assert wb.cache_size(model, tokens, names_filter, attention_mask=mask) == cache_bytes(cache)
    if names_filter is not None:  # by hand: 2 layers x [B, heads, P, P] float32
        assert cache_bytes(cache) == 2 * B * model.cfg.n_heads * P * P * 4


def test_too_large_for_memory_names_the_bytes(tmp_path, monkeypatch):
    model = make_model()
    tokens, mask = dataset("right")
    monkeypatch.setattr(cache_batches, "available_memory", lambda device: 1000)
    activations = wb.cache_size(model, tokens, attention_mask=mask)
    logits = B * P * VOCAB * 4
    with pytest.raises(wb.CacheTooLargeError) as caught:
        model.run_with_cache(tokens, attention_mask=mask, batch_size=2, progress=False)
    message = str(caught.value)
    assert f"{activations + logits:,} bytes" in message and f"{activations:,} bytes of activations" in message
    assert "1,000 bytes" in message and "cache_dir=" in message and "names_filter" in message
    assert isinstance(caught.value, wb.InputError) and no_hooks_left(model)
    # Streamed to disk, only the outputs stay in memory: none with return_type=None.
    _, cache = model.run_with_cache(tokens, attention_mask=mask, batch_size=2, progress=False, return_type=None,
                                    cache_dir=tmp_path / "c")
    assert len(cache) > 0


def test_too_large_for_the_disk_removes_what_it_wrote(tmp_path, monkeypatch):
    model = make_model()
    tokens, _ = dataset(None)
    monkeypatch.setattr(cache_batches, "available_disk", lambda directory: 10)
    with pytest.raises(wb.CacheTooLargeError, match=f"{wb.cache_size(model, tokens):,} bytes"):
        model.run_with_cache(tokens, batch_size=2, progress=False, cache_dir=tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


# ---- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [0, -2, 2.5, True, "4"])
def test_bad_batch_size(batch_size):
    with pytest.raises(wb.InputError, match="batch_size must be a positive integer"):
        make_model().run_with_cache(dataset(None)[0], batch_size=batch_size)


def test_bad_cache_dirs_are_refused_by_name_and_left_alone(tmp_path):
    model = make_model()
    tokens, _ = dataset(None)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(wb.InputError, match="notes.txt' is a file"):
        model.run_with_cache(tokens, batch_size=2, cache_dir=a_file)
    assert a_file.read_text() == "mine"
    with pytest.raises(wb.InputError, match="is not empty .*other files"):
        model.run_with_cache(tokens, batch_size=2, cache_dir=tmp_path)
    model.run_with_cache(tokens, cache_dir=tmp_path / "c", names_filter="hook_embed")  # all rows, one shard
    with pytest.raises(wb.InputError, match="holds an activation cache already"):
        model.run_with_cache(tokens, cache_dir=tmp_path / "c")
    assert len(list((tmp_path / "c").iterdir())) == 2


def test_other_bad_input_leaves_nothing(tmp_path):
    model = make_model()
    tokens, mask = dataset("right")
    directory = tmp_path / "c"
    with pytest.raises(wb.InputError, match="attention_mask has shape"):
        model.run_with_cache(tokens, attention_mask=mask[:, :-1], batch_size=2, cache_dir=directory)
    with pytest.raises(wb.InputError, match="no hook point named 'blocks.0.hook_resid_pots'"):
        model.run_with_cache(tokens, names_filter=["blocks.0.hook_resid_pots"], batch_size=2, cache_dir=directory)
    with pytest.raises(wb.InputError, match="return_type must be"):
        model.run_with_cache(tokens, return_type="logit", batch_size=2, cache_dir=directory)
    with pytest.raises(wb.InputError, match="incl_bwd"):
        model.run_with_cache(tokens, incl_bwd=True, batch_size=2, cache_dir=directory)
    with pytest.raises(wb.InputError, match="remove_batch_dim"):
        model.run_with_cache(tokens[:1], remove_batch_dim=True, batch_size=1)
    only_one_real = torch.zeros(B, P, dtype=torch.long)
    only_one_real[:, 0] = 1  # every row one real token: no pair to score
    with pytest.raises(wb.InputError, match="no pair of consecutive real tokens"):
        model.run_with_cache(tokens, "loss", attention_mask=only_one_real, batch_size=2, cache_dir=directory,
                             progress=False)
    assert list(tmp_path.iterdir()) == [] and no_hooks_left(model)
    assert not math.isnan(model.run_with_cache(tokens, "loss", batch_size=2, progress=False, names_filter=[])[0])
