"""experiments.datasets: IOI prompts, repeated random tokens, corpus windows and ablation references.

Expected values come from the tokenizer itself (``to_single_token``, ``to_tokens`` of each text on its
own), from hand arithmetic on a word-level tokenizer whose ids are readable ("w5" is id 5), or from
one big ``run_with_cache`` over the whole batch; never from the functions under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

import workbench as wb
from experiments import datasets, induction
from experiments.datasets import (corpus_windows, ioi_dataset, mean_activations, repeated_random_tokens,
                                  resample_reference)
from workbench.errors import InputError
from workbench.tokenizer import SpecialTokens, Tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 50
N_CTX = 32
BOS, EOS = 1, 2  # the word model's ids of w1 and w2


def word_model(bos: bool = True, eos: bool = True) -> wb.Decoder:
    """A tiny decoder whose tokenizer maps the word "wI" to id I (whitespace-separated)."""
    torch.manual_seed(0)
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=VOCAB, n_ctx=N_CTX, positional="rotary",
                         normalization="RMS", gated_mlp=True, act_fn="silu")
    words = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = SpecialTokens(bos_token="w1" if bos else None, eos_token="w2" if eos else None, pad_token="w0")
    return wb.Decoder(cfg, tokenizer=Tokenizer(words, specials)).eval()


def text(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def words():
    return word_model()


# ---- IOI --------------------------------------------------------------------------------------------
def name_id(model, name: str) -> int:
    return model.to_single_token(" " + name)


def test_ioi_rows_answers_and_orders(smol):
    data = ioi_dataset(smol, 20, seed=0)
    assert len(data) == 20 and data.clean_tokens.shape[0] == 20 and data.corrupt_tokens.shape[0] == 20
    assert set(data.orders) == {"ABBA", "BABA"}
    assert data.answer_tokens.tolist() == [name_id(smol, io) for io in data.io_names]
    assert data.wrong_tokens.tolist() == [name_id(smol, s) for s in data.s_names]
    assert all(io != s for io, s in zip(data.io_names, data.s_names))
    for row, (prompt, io, s, order) in enumerate(zip(data.clean_prompts, data.io_names, data.s_names, data.orders)):
        first, second = (io, s) if order == "ABBA" else (s, io)
        assert prompt.index(f" {first} ") < prompt.index(f" {second} ")  # the first clause in the row's order
        assert prompt.count(f" {s} ") + prompt.endswith(f" {s}") == 2 and not prompt.endswith(" ")
    frame = data.to_frame()
    assert frame.columns.tolist() == ["text", "corrupt", "io", "s", "order", "template"]
    assert len(frame) == 20 and frame.text.tolist() == data.clean_prompts


def test_ioi_rows_pad_to_one_batch(smol):
    data = ioi_dataset(smol, 20, seed=0)
    lengths = [len(smol.to_tokens(prompt)[0]) for prompt in data.clean_prompts]  # each prompt alone, BOS included
    assert len(set(lengths)) > 1, "the templates should give prompts of different lengths"
    assert data.clean_mask.sum(1).tolist() == lengths
    assert (data.clean_mask == 0).any()
    assert data.clean_tokens.shape == (20, max(lengths))


def test_ioi_corrupt_rows_keep_the_clean_length(smol):
    for corruption in ("swap_subject", "abc"):
        data = ioi_dataset(smol, 12, seed=3, corruption=corruption)
        assert data.clean_mask.sum(1).tolist() == data.corrupt_mask.sum(1).tolist()
        assert [len(smol.to_tokens(p)[0]) for p in data.corrupt_prompts] == data.corrupt_mask.sum(1).tolist()


def test_swap_subject_changes_only_the_subject_repeat_to_the_io(smol):
    data = ioi_dataset(smol, 10, seed=1, corruption="swap_subject")
    for row in range(len(data)):
        clean, corrupt = data.clean_tokens[row], data.corrupt_tokens[row]
        io, s = name_id(smol, data.io_names[row]), name_id(smol, data.s_names[row])
        changed = (clean != corrupt).nonzero().flatten().tolist()
        assert len(changed) == 1
        where = changed[0]
        s_positions = (clean == s).nonzero().flatten().tolist()
        assert len(s_positions) == 2 and where == s_positions[1]  # the second S is the repeat
        assert (clean == io).nonzero().flatten().tolist()[0] < where
        assert int(corrupt[where]) == io


def test_abc_replaces_the_three_name_slots_by_three_other_names(smol):
    data = ioi_dataset(smol, 10, seed=2, corruption="abc")
    for row in range(len(data)):
        clean, corrupt = data.clean_tokens[row], data.corrupt_tokens[row]
        io, s = name_id(smol, data.io_names[row]), name_id(smol, data.s_names[row])
        slots = sorted(((clean == io) | (clean == s)).nonzero().flatten().tolist())
        assert len(slots) == 3
        assert (clean != corrupt).nonzero().flatten().tolist() == slots
        new = [int(corrupt[p]) for p in slots]
        assert len(set(new)) == 3 and not set(new) & {io, s}


@pytest.mark.parametrize("side", ["right", "left"])
def test_answer_positions_are_each_rows_last_real_token(smol, side):
    data = ioi_dataset(smol, 8, seed=0, padding_side=side)
    P = data.clean_tokens.shape[1]
    for row, prompt in enumerate(data.clean_prompts):
        alone = smol.to_tokens(prompt)[0]
        expected = len(alone) - 1 if side == "right" else P - 1
        assert int(data.answer_positions[row]) == expected
        assert int(data.clean_tokens[row, expected]) == int(alone[-1])
        mask = data.clean_mask[row].tolist()
        if side == "right":
            assert mask == [1] * len(alone) + [0] * (P - len(alone))
        else:
            assert mask == [0] * (P - len(alone)) + [1] * len(alone)


def test_ioi_is_deterministic_per_seed(smol):
    a, b, c = ioi_dataset(smol, 10, seed=5), ioi_dataset(smol, 10, seed=5), ioi_dataset(smol, 10, seed=6)
    assert a.clean_prompts == b.clean_prompts and a.corrupt_prompts == b.corrupt_prompts
    assert torch.equal(a.clean_tokens, b.clean_tokens)
    assert a.clean_prompts != c.clean_prompts


def test_ioi_takes_given_names_templates_and_one_order(smol):
    template = "When {A} and {B} met, {S} waved to"
    data = ioi_dataset(smol, 6, names=["Mary", "John", "Tom"], templates=[template], orders=("BABA",))
    assert set(data.orders) == {"BABA"} and set(data.templates) == {template}
    assert set(data.io_names) | set(data.s_names) <= {"Mary", "John", "Tom"}


def test_ioi_errors(smol, words):
    assert smol.to_str_tokens(" Hermione", prepend_bos=False) == [" Herm", "ione"]  # what the message shows
    with pytest.raises(InputError, match=r"'Hermione' -> \[' Herm', 'ione'\]"):
        ioi_dataset(smol, 4, names=["Mary", "John", "Tom", "Hermione"])
    with pytest.raises(InputError, match="order"):
        ioi_dataset(smol, 4, orders=("ABBA", "ABAB"))
    with pytest.raises(InputError, match="n must be a positive"):
        ioi_dataset(smol, 0)
    with pytest.raises(InputError, match="at least 3"):
        ioi_dataset(smol, 4, names=["Mary", "John"])
    with pytest.raises(InputError, match="at least 5"):
        ioi_dataset(smol, 4, names=["Mary", "John", "Tom", "Sam"], corruption="abc")
    with pytest.raises(InputError, match="unknown corruption"):
        ioi_dataset(smol, 4, corruption="shuffle")
    with pytest.raises(InputError, match=r"\{A\}, \{B\} and \{S\}"):
        ioi_dataset(smol, 4, templates=["When {A} and {B} went out, {IO} smiled at"])
    with pytest.raises(InputError, match="follow a space"):
        ioi_dataset(smol, 4, templates=["{A} and {B} went out, {S} smiled at"])
    with pytest.raises(InputError, match="tokenizer"):
        ioi_dataset(wb.Decoder(words.cfg), 4)


def test_ioi_refuses_a_corruption_that_changes_the_token_length(smol):
    # " Johnson" and " Jackson" are one token, " Maryson" two: swapping names then shifts positions.
    assert len(smol.to_str_tokens(" Johnson", prepend_bos=False)) == 1
    assert len(smol.to_str_tokens(" Maryson", prepend_bos=False)) == 2
    with pytest.raises(InputError, match="corrupted prompt has \\d+ tokens but the clean one \\d+"):
        ioi_dataset(smol, 6, names=["John", "Mary", "Jack"], templates=["When {A} and {B} met, {S}son waved to"])


# ---- repeated random tokens ---------------------------------------------------------------------------
def test_repeated_random_tokens_moved_and_still_importable_from_induction(words):
    assert induction.repeated_random_tokens is datasets.repeated_random_tokens
    assert induction.prefix_token is datasets.prefix_token
    tokens = repeated_random_tokens(words, seq_len=6, batch=3, seed=4)
    assert tokens.shape == (3, 1 + 2 * 6)
    assert (tokens[:, 0] == BOS).all()  # the tokenizer's BOS (w1) leads
    assert torch.equal(tokens[:, 1:7], tokens[:, 7:])
    for row in tokens[:, 1:7].tolist():
        assert len(set(row)) == 6 and BOS not in row


# ---- corpus windows ----------------------------------------------------------------------------------
def test_windows_from_texts_by_hand(words):
    # stream: 5 6 7 EOS 8 9 10 11 EOS 12 -> 10 tokens; with BOS a window of 4 holds 3 of them.
    texts = [text(5, 6, 7), text(8, 9, 10, 11), text(12)]
    windows = corpus_windows(words, texts, window=4)  # starts 0, 3, 6: 1 + (10 - 3) // 3 windows
    assert windows.tolist() == [[BOS, 5, 6, 7], [BOS, EOS, 8, 9], [BOS, 10, 11, EOS]]
    overlapping = corpus_windows(words, texts, window=4, stride=2)  # starts 0, 2, 4, 6: 1 + (10 - 3) // 2
    assert overlapping.tolist() == [[BOS, 5, 6, 7], [BOS, 7, EOS, 8], [BOS, 8, 9, 10], [BOS, 10, 11, EOS]]
    assert corpus_windows(words, texts, window=4, stride=2, max_windows=2).tolist() == overlapping[:2].tolist()


def test_windows_without_bos_or_eos(words):
    plain = word_model(bos=False, eos=False)
    windows = corpus_windows(plain, [text(5, 6, 7), text(8, 9, 10, 11)], window=3)  # 7 tokens -> 2 windows
    assert windows.tolist() == [[5, 6, 7], [8, 9, 10]]


def test_windows_from_a_file_and_a_directory(words, tmp_path):
    file = tmp_path / "one.txt"
    file.write_text(text(*range(3, 13)), encoding="utf-8")  # 10 tokens
    assert corpus_windows(words, file, window=6).tolist() == [[BOS, 3, 4, 5, 6, 7], [BOS, 8, 9, 10, 11, 12]]
    assert corpus_windows(words, str(file), window=6).shape == (2, 6)

    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "b.txt").write_text(text(20, 21), encoding="utf-8")
    (folder / "a.txt").write_text(text(30, 31, 32), encoding="utf-8")
    (folder / "skip.md").write_text(text(40), encoding="utf-8")
    # sorted paths: a.txt, sub/b.txt -> 30 31 32 EOS 20 21 (skip.md does not match *.txt)
    assert corpus_windows(words, folder, window=4).tolist() == [[BOS, 30, 31, 32], [BOS, EOS, 20, 21]]
    assert corpus_windows(words, folder, window=2, pattern="*.md").tolist() == [[BOS, 40]]


def test_window_counts_on_a_real_tokenizer(smol):
    texts = ["The quick brown fox jumps over the lazy dog. " * 20, "Induction heads copy earlier tokens. " * 15]
    n_tokens = sum(len(smol.to_tokens(t, prepend_bos=False)[0]) for t in texts) + 1  # one EOS between them
    for window, stride in ((16, None), (16, 5), (33, 40)):
        step = stride or window - 1
        windows = corpus_windows(smol, texts, window=window, stride=stride)
        assert windows.shape == (1 + (n_tokens - (window - 1)) // step, window)
        assert (windows[:, 0] == smol.tokenizer.bos_token_id).all()
    first = smol.to_tokens(texts[0], prepend_bos=False)[0]
    assert torch.equal(corpus_windows(smol, texts, window=16)[0, 1:], first[:15])


def test_window_errors(words, tmp_path):
    with pytest.raises(InputError, match="no such file or directory"):
        corpus_windows(words, tmp_path / "missing.txt", window=4)
    (tmp_path / "only.md").write_text(text(5), encoding="utf-8")
    with pytest.raises(InputError, match=r"no file matching '\*\.txt'"):
        corpus_windows(words, tmp_path, window=4)
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(InputError, match="empty.txt is empty"):
        corpus_windows(words, tmp_path / "empty.txt", window=2)
    with pytest.raises(InputError, match="text 1 is empty"):
        corpus_windows(words, [text(5), ""], window=2)
    with pytest.raises(InputError, match="3 tokens, fewer than one window of 8"):
        corpus_windows(words, [text(5, 6, 7)], window=8)
    with pytest.raises(InputError, match=f"n_ctx={N_CTX}"):
        corpus_windows(words, [text(*range(3, 40))], window=N_CTX + 1)
    with pytest.raises(InputError, match="stride"):
        corpus_windows(words, [text(5, 6, 7)], window=2, stride=0)
    with pytest.raises(InputError, match="tokenizer"):
        corpus_windows(wb.Decoder(words.cfg), [text(5, 6, 7)], window=2)


# ---- mean activations ---------------------------------------------------------------------------------
NAMES = ["blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post", "blocks.0.mlp.hook_post"]


def test_streamed_means_equal_the_whole_batch_cache(words):
    tokens = torch.randint(3, VOCAB, (10, 12), generator=torch.Generator().manual_seed(0))
    _, cache = words.run_with_cache(tokens, names_filter=lambda n: n in NAMES)
    seen: list[int] = []
    calls: list[tuple[int, int]] = []
    words.add_hook("hook_embed", lambda act, hook: seen.append(act.shape[0]))
    try:
        means = mean_activations(words, tokens, NAMES, batch_size=3, progress=lambda d, t: calls.append((d, t)))
    finally:
        words.reset_hooks(including_permanent=True)
    assert seen == [3, 3, 3, 1]  # the model never saw more than one batch of rows at once
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    for name in NAMES:
        expected = cache[name].mean(0, keepdim=True)
        assert means[name].shape == expected.shape and means[name].dtype == expected.dtype
        assert (means[name] - expected).abs().max() < 1e-5, name


def test_masked_means_count_only_real_rows_at_each_position(words):
    # row 0 fills all 7 positions, row 1 is right-padded (4 real), row 2 left-padded (2 real)
    tokens = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for b, where in enumerate((slice(0, 7), slice(0, 4), slice(5, 7))):
        tokens[b, where] = torch.arange(3, 3 + where.stop - where.start) + 10 * b
        mask[b, where] = 1
    names = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"]
    _, cache = words.run_with_cache(tokens, attention_mask=mask, names_filter=lambda n: n in names)
    means = mean_activations(words, tokens, names, batch_size=2, attention_mask=mask)

    resid = cache["blocks.1.hook_resid_post"]
    for p in range(7):  # positions 0-3: rows 0 and 1; 4: row 0 alone; 5-6: rows 0 and 2
        real = [b for b in range(3) if mask[b, p]]
        expected = sum(resid[b, p] for b in real) / len(real)
        assert (means["blocks.1.hook_resid_post"][0, p] - expected).abs().max() < 1e-5
    pattern = cache["blocks.0.attn.hook_pattern"]  # the query position is axis 2
    for p in range(7):
        real = [b for b in range(3) if mask[b, p]]
        expected = sum(pattern[b, :, p] for b in real) / len(real)
        assert (means["blocks.0.attn.hook_pattern"][0, :, p] - expected).abs().max() < 1e-5


def test_a_position_no_row_has_is_zero(words):
    tokens = torch.tensor([[5, 6, 0], [7, 8, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    means = mean_activations(words, tokens, "blocks.0.hook_resid_pre", attention_mask=mask)
    assert (means["blocks.0.hook_resid_pre"][0, 2] == 0).all()
    assert means["blocks.0.hook_resid_pre"][0, :2].abs().sum() > 0


def test_mean_activation_errors(words):
    tokens = torch.randint(3, VOCAB, (4, 5))
    with pytest.raises(InputError, match="blocks.0.attn.hook_zz"):
        mean_activations(words, tokens, ["blocks.0.attn.hook_zz"])
    with pytest.raises(InputError, match="batch_size"):
        mean_activations(words, tokens, NAMES, batch_size=0)
    with pytest.raises(InputError, match="hook_names is empty"):
        mean_activations(words, tokens, [])
    with pytest.raises(InputError, match="did not fire"):  # computed only with set_use_split_qkv_input(True)
        mean_activations(words, tokens, ["blocks.0.hook_q_input"])


MEMORY_PROBE = """
import json, resource, torch
import workbench as wb
from experiments.datasets import mean_activations
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = wb.ModelConfig(n_layers={layers}, d_model=32, n_heads={heads}, d_vocab=61, n_ctx={pos}, positional="rotary")
model = wb.Decoder(cfg).eval()
tokens = torch.randint(61, ({rows}, {pos}))
names = [f"blocks.{{l}}.attn.hook_pattern" for l in range({layers})]
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
mean_activations(model, tokens[:{batch}], names, batch_size={batch})
one = peak()
mean_activations(model, tokens, names, batch_size={batch})
print(json.dumps({{"one_batch": one, "all": peak()}}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_streaming_memory_is_bounded_by_a_batch_not_the_dataset():
    shape = dict(layers=2, heads=8, pos=128, batch=8, rows=160)  # 20 batches
    # Hand count of what run_with_cache would hold: rows x layers x [heads, pos, pos] float32.
    full_cache_bytes = shape["rows"] * shape["layers"] * shape["heads"] * shape["pos"] ** 2 * 4  # 168 MB
    probe = subprocess.run([sys.executable, "-c", textwrap.dedent(MEMORY_PROBE.format(**shape))], cwd=ROOT,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert probe.returncode == 0, probe.stderr
    peaks = json.loads(probe.stdout.strip().splitlines()[-1])
    growth = peaks["all"] - peaks["one_batch"]
    print(f"\npeak RSS after one batch {peaks['one_batch'] / 2**20:.0f} MiB, growth streaming 20 batches "
          f"{growth / 2**20:.1f} MiB; the full cache would be {full_cache_bytes / 2**20:.0f} MiB")
    assert growth < full_cache_bytes / 4  # holding the whole cache grows it by more than full_cache_bytes


# ---- resample reference -------------------------------------------------------------------------------
def test_resample_reference_draws_rows_deterministically():
    tokens = torch.arange(40).reshape(10, 4)
    drawn = resample_reference(tokens, 6, seed=1)
    assert drawn.shape == (6, 4)
    firsts = drawn[:, 0].tolist()
    assert len(set(firsts)) == 6 and all(f % 4 == 0 for f in firsts)  # whole, distinct rows of tokens
    for row in drawn:
        assert torch.equal(row, tokens[int(row[0]) // 4])
    assert torch.equal(drawn, resample_reference(tokens, 6, seed=1))
    assert not torch.equal(drawn, resample_reference(tokens, 6, seed=2))
    many = resample_reference(tokens, 25, seed=0)  # more than there are rows: with replacement
    assert many.shape == (25, 4) and set(many[:, 0].tolist()) <= set(range(0, 40, 4))


def test_resample_reference_errors():
    with pytest.raises(InputError, match="n must be a positive"):
        resample_reference(torch.zeros(3, 4, dtype=torch.long), 0)
    with pytest.raises(InputError, match=r"\[batch, pos\]"):
        resample_reference(torch.zeros(4, dtype=torch.long), 2)
