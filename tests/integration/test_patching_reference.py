"""Our exact activation patching against TransformerLens's own ``transformer_lens.patching`` on the same weights.

A tiny random Llama (``hf_tiny.build_and_save("llama")``: 2 layers, 6 query heads over 2 KV heads,
weights re-drawn with a large spread, a word-level tokenizer) is saved once and loaded twice: by
``wb.load_model`` and, as the reference, by ``TransformerBridge.boot_transformers`` around the very
`transformers` model that was saved (nothing fetched).

Reference functions, called on the bridge unchanged:

- ``patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, metric)`` -> [layer, head]
  against ``patch_heads(...)["metric"]`` (one row per (layer, head), layer-major);
- ``patching.get_act_patch_resid_pre(bridge, corrupt, clean_cache, metric)`` -> [layer, pos]
  against ``patch_residual(...)["metric"]`` (one row per (layer, position)).

The TL metric is the mean over rows of logits[b, -1, answer_b] - logits[b, -1, wrong_b], which is
what our default ``LogitDiff`` at each row's last real token averages to when nothing is padded.
TransformerLens has no attention mask, so the three prompt pairs have EQUAL length; one more test
pads the same pairs by different amounts (right and left, with masks) and expects our masked head
patching to still give TL's unpadded numbers.

Both TL functions run on a bridge in TL 4.3 as they are (read from transformer_lens/patching.py):
``generic_activation_patch`` hooks ``utils.get_act_name("z" | "resid_pre", layer)`` =
``blocks.{l}.attn.hook_z`` / ``blocks.{l}.hook_resid_pre`` through ``run_with_hooks``, and the
bridge has both names as aliases of its own hooks (``attn.o.hook_in``, the output projection's
input, and the block's ``hook_in``) carrying TransformerLens's shapes ([batch, pos, head, d_head],
[batch, pos, d_model]); its only other requirement, ``require_eval_mode``, holds because nothing
in the bridge or its HF model is in training mode. Tolerance 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens import patching as tl_patching
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedTokenizerFast

import workbench as wb
from experiments.patching import patch_heads, patch_residual
from tests.integration.hf_tiny import VOCAB, build_and_save

BATCH, P = 3, 10
PAD_ID = 2  # hf_tiny's word tokenizer: pad/EOS "t2"
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours, bridge) over one saved tiny Llama."""
    directory = tmp_path_factory.mktemp("tiny_llama_patching")
    hf_model = build_and_save("llama", directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    bridge = TransformerBridge.boot_transformers(str(directory), hf_model=hf_model, tokenizer=tokenizer, device="cpu")
    ours = wb.load_model(str(directory), attn_impl="sdpa").eval()
    return ours, bridge


@pytest.fixture(scope="module")
def pairs(models):
    """Three clean/corrupt pairs of P tokens (corrupt: two positions changed) with per-row answer and wrong ids.

    answer_b is the clean run's top next token and wrong_b the corrupted run's, so the logit
    difference flips between the runs and the patching map has something to restore.
    """
    ours, bridge = models
    generator = torch.Generator().manual_seed(7)
    clean = torch.randint(3, VOCAB, (BATCH, P), generator=generator)
    clean[:, 0] = 1  # BOS "t1"
    corrupt = clean.clone()
    corrupt[:, [2, 5]] = torch.randint(3, VOCAB, (BATCH, 2), generator=generator)
    with torch.no_grad():
        clean_logits, corrupt_logits = bridge(clean)[:, -1], bridge(corrupt)[:, -1]
        torch.testing.assert_close(ours(clean)[:, -1], clean_logits, rtol=0, atol=ATOL)  # same weights
    answer = clean_logits.argmax(-1)
    wrong = torch.where(corrupt_logits.argmax(-1) != answer, corrupt_logits.argmax(-1),
                        corrupt_logits.topk(2, -1).indices[:, 1])
    assert (answer != wrong).all()
    return clean, corrupt, answer, wrong


def tl_metric(answer, wrong):
    rows = torch.arange(len(answer))
    return lambda logits: (logits[rows, -1, answer] - logits[rows, -1, wrong]).mean()


@pytest.fixture(scope="module")
def reference(models, pairs):
    """TransformerLens's head and residual patching maps on the bridge, and its clean/corrupt metrics."""
    _, bridge = models
    clean, corrupt, answer, wrong = pairs
    metric = tl_metric(answer, wrong)
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)
        heads_LH = tl_patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, metric)
        resid_LP = tl_patching.get_act_patch_resid_pre(bridge, corrupt, clean_cache, metric)
        clean_value, corrupt_value = float(metric(bridge(clean))), float(metric(bridge(corrupt)))
    assert clean_value - corrupt_value > 0.5  # the corruption moves the metric: a map worth comparing
    return {"heads": heads_LH.float(), "resid": resid_LP.float(), "clean": clean_value, "corrupt": corrupt_value}


def _grid(df, column: str, shape: tuple[int, int]) -> torch.Tensor:
    """Our DataFrame's ``metric`` column placed at [layer, ``column``] (TL's layout)."""
    grid = torch.full(shape, float("nan"))
    grid[torch.tensor(df["layer"].to_numpy()), torch.tensor(df[column].to_numpy())] = torch.tensor(
        df["metric"].to_numpy(), dtype=torch.float32)
    return grid


def test_patch_heads_equals_get_act_patch_attn_head_out_all_pos(models, pairs, reference):
    ours, _ = models
    clean, corrupt, answer, wrong = pairs
    df = patch_heads(ours, clean, corrupt, answer, wrong, progress=False, per_prompt=False)
    expected = reference["heads"]
    assert expected.shape == (ours.cfg.n_layers, ours.cfg.n_heads) and len(df) == expected.numel()
    torch.testing.assert_close(_grid(df, "head", tuple(expected.shape)), expected, rtol=0, atol=ATOL)
    assert df.attrs["clean_metric"] == pytest.approx(reference["clean"], abs=ATOL)
    assert df.attrs["corrupt_metric"] == pytest.approx(reference["corrupt"], abs=ATOL)
    # Normalized is TL's (patched - corrupt) / (clean - corrupt) over the same means.
    normalized = (expected - reference["corrupt"]) / (reference["clean"] - reference["corrupt"])
    torch.testing.assert_close(torch.tensor(df["normalized"].to_numpy(), dtype=torch.float32),
                               normalized.flatten(), rtol=0, atol=ATOL)
    assert expected.max() - expected.min() > 0.05  # heads differ: the comparison discriminates


def test_patch_residual_equals_get_act_patch_resid_pre(models, pairs, reference):
    ours, _ = models
    clean, corrupt, answer, wrong = pairs
    df = patch_residual(ours, clean, corrupt, answer, wrong, progress=False, per_prompt=False)
    expected = reference["resid"]
    assert expected.shape == (ours.cfg.n_layers, P) and len(df) == expected.numel()
    torch.testing.assert_close(_grid(df, "position", tuple(expected.shape)), expected, rtol=0, atol=ATOL)
    # Layer 0's residual is the embedding: patching a position the corruption left alone changes
    # nothing, patching a corrupted one (2 or 5) does, so the map discriminates.
    unchanged = [p for p in range(P) if p not in (2, 5)]
    torch.testing.assert_close(expected[0, unchanged], torch.full((len(unchanged),), reference["corrupt"]),
                               rtol=0, atol=ATOL)
    assert (expected[0, [2, 5]] - reference["corrupt"]).abs().max() > 0.05


def _pad(tokens: torch.Tensor, extra: list[int], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row padded with ``extra[b]`` pad tokens on ``side`` then to one width; the mask marks real tokens."""
    width = tokens.shape[1] + max(extra)
    rows, masks = [], []
    for row, n in zip(tokens, extra):
        pad = torch.full((width - len(row),), PAD_ID, dtype=tokens.dtype)
        real, none = torch.ones(len(row), dtype=torch.long), torch.zeros(len(pad), dtype=torch.long)
        rows.append(torch.cat([row, pad] if side == "right" else [pad, row]))
        masks.append(torch.cat([real, none] if side == "right" else [none, real]))
    return torch.stack(rows), torch.stack(masks)


@pytest.mark.parametrize("side", ["right", "left"])
def test_masked_patch_heads_on_padded_pairs_equals_transformer_lens_unpadded(models, pairs, reference, side):
    """The same pairs padded by 0, 3 and 1 tokens (clean and corrupt alike): pads change nothing."""
    ours, _ = models
    clean, corrupt, answer, wrong = pairs
    extra = [0, 3, 1]
    clean_padded, clean_mask = _pad(clean, extra, side)
    corrupt_padded, corrupt_mask = _pad(corrupt, extra, side)
    df = patch_heads(ours, clean_padded, corrupt_padded, answer, wrong, progress=False,
                     clean_mask=clean_mask, corrupt_mask=corrupt_mask)
    expected = reference["heads"]
    torch.testing.assert_close(_grid(df, "head", tuple(expected.shape)), expected, rtol=0, atol=ATOL)
    assert df.attrs["corrupt_metric"] == pytest.approx(reference["corrupt"], abs=ATOL)
