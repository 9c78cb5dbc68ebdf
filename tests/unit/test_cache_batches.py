"""run_with_cache over a dataset in batches: in memory, streamed to disk, cache_size, the too-large error.

Every expected value is a plain one-shot ``run_with_cache`` / forward pass over all the rows, or a
hand calculation (byte counts, the mean loss from one-shot per-token losses).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

import workbench as wb
import workbench.cache_batches as cache_batches
import workbench.cache_store as cache_store
from tests.unit.helpers import make_model as make_variant
from workbench.tokenizer import SpecialTokens, Tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 50
LENGTHS = (9, 4, 7, 9, 2, 6, 8)  # B = 7 rows, P = 9; row 4 has one scored pair only
B, P = len(LENGTHS), max(LENGTHS)
ALL = None


def make_model(kind: str = "gqa") -> wb.Decoder:
    torch.manual_seed(0)
    sizes = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=VOCAB, n_ctx=32)
    if kind == "gqa":
        cfg = wb.ModelConfig(**sizes, n_key_value_heads=2, positional="rotary", normalization="RMS",
                             gated_mlp=True, act_fn="silu")
    else:
        cfg = wb.ModelConfig(**sizes, positional="learned", normalization="LN", attn_bias=True, mlp_bias=True)
    words = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(words, SpecialTokens(bos_token="w1", eos_token="w2", pad_token="w0"))
    return wb.Decoder(cfg, tokenizer=tokenizer).eval()


def dataset(padding: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, P] ids and, when padded, the mask (rows of LENGTHS real tokens on that side)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (B, P), generator=generator)
    if padding is None:
        return tokens, None
    mask = torch.zeros(B, P, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    if padding == "left":
        mask = mask.flip(1)
    return tokens, mask


def one_shot(model, tokens, mask, names_filter=ALL, **kwargs):
    with torch.no_grad():
        return model.run_with_cache(tokens, attention_mask=mask, names_filter=names_filter, **kwargs)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.values())


def assert_same_cache(cache, expected) -> None:
    assert sorted(cache.keys()) == sorted(expected.keys())
    for name, tensor in expected.items():
        got = cache[name]
        torch.testing.assert_close(got, tensor, atol=1e-5, rtol=0, msg=name)  # same shape, dtype; -inf scores equal


def no_hooks_left(model) -> bool:
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values())


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


# ---- on disk -------------------------------------------------------------------------------------------------
class CountingSafeOpen:
    """Stands in for safetensors.safe_open and records which tensors are read."""

    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, *args, **kwargs):
        counter = self

        class Handle:
            def __enter__(self):
                self.file = counter.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.file.__exit__(*exc)

            def get_tensor(self, name):
                counter.read.append(name)
                return self.file.get_tensor(name)

        return Handle()


@pytest.mark.parametrize("padding", [None, "right"])
def test_streamed_cache_reads_back_one_hook_at_a_time(tmp_path, monkeypatch, padding):
    model = make_model()
    tokens, mask = dataset(padding)
    expected_logits, expected = one_shot(model, tokens, mask)
    directory = tmp_path / "new" / "acts"  # parents created too
    logits, cache = model.run_with_cache(tokens, attention_mask=mask, batch_size=3, cache_dir=directory,
                                         progress=False)
    assert (logits - expected_logits).abs().max() < 1e-5
    shards = sorted(p.name for p in directory.glob("shard-*.safetensors"))
    assert shards == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    index = json.loads((directory / "index.json").read_text())
    assert [s["rows"] for s in index["shards"]] == [[0, 3], [3, 6], [6, 7]]
    assert sorted(p.name for p in directory.iterdir()) == ["index.json", *shards]  # no temporary files

    counter = CountingSafeOpen(cache_store.safe_open)
    monkeypatch.setattr(cache_store, "safe_open", counter)
    assert len(cache) == len(expected) and "hook_embed" in cache and ("pattern", 0) not in cache.cache_dict
    assert sorted(cache.keys()) == sorted(expected.keys()) and counter.read == []
    resid = cache["blocks.0.hook_resid_post"]
    assert counter.read == ["blocks.0.hook_resid_post"] * len(shards)  # that hook, once per shard, nothing else
    assert (resid - expected["blocks.0.hook_resid_post"]).abs().max() < 1e-5
    assert torch.equal(cache["pattern", 0], cache["blocks.0.attn.hook_pattern"])
    monkeypatch.setattr(cache_store, "safe_open", counter.real)
    assert_same_cache(cache, expected)

    reopened = wb.load_cache(directory, model)
    assert_same_cache(reopened, expected)
    assert (reopened.accumulated_resid() - expected.accumulated_resid()).abs().max() < 1e-5
    assert (reopened.stack_activation("pattern") - expected.stack_activation("pattern")).abs().max() < 1e-5
    without_model = wb.load_cache(str(directory))
    # Batches of three rows against one of seven: equal to float rounding, not bitwise (GEMM blockings differ).
    torch.testing.assert_close(without_model["pattern", 1], expected["pattern", 1], rtol=0, atol=1e-6)


def test_a_filtered_cache_on_disk_keeps_only_its_hooks(tmp_path):
    model = make_model()
    tokens, mask = dataset("left")
    names = lambda n: n.endswith(("hook_resid_pre", "hook_resid_post"))  # noqa: E731
    _, expected = one_shot(model, tokens, mask, names)
    _, cache = model.run_with_cache(tokens, attention_mask=mask, names_filter=names, batch_size=4,
                                    cache_dir=tmp_path / "c", return_type=None, progress=False)
    assert_same_cache(cache, expected)
    assert (cache.accumulated_resid() - expected.accumulated_resid()).abs().max() < 1e-5
    assert (cache.stack_activation("resid_post") - expected.stack_activation("resid_post")).abs().max() < 1e-5


def test_load_cache_refuses_what_is_not_a_cache(tmp_path):
    model = make_model()
    with pytest.raises(wb.InputError, match="no index.json"):
        wb.load_cache(tmp_path)
    tokens, _ = dataset(None)
    model.run_with_cache(tokens, batch_size=4, cache_dir=tmp_path / "c", names_filter="hook_embed", progress=False)
    other = wb.Decoder(model.cfg.replace(d_model=64))
    with pytest.raises(wb.InputError, match="d_model 32 there, 64 here"):
        wb.load_cache(tmp_path / "c", other)
    (tmp_path / "c" / "shard-00001.safetensors").unlink()
    with pytest.raises(wb.InputError, match="shard-00001"):
        wb.load_cache(tmp_path / "c")


# ---- failures leave nothing behind ---------------------------------------------------------------------------
class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("existing", [False, True])
def test_a_hook_raising_mid_stream_leaves_no_files_and_no_hooks(tmp_path, error, existing):
    model = make_model()
    tokens, _ = dataset(None)
    directory = tmp_path / "acts"
    if existing:
        directory.mkdir()
    calls = []

    def raise_on_second_batch(tensor, hook):
        calls.append(1)
        if len(calls) == 2:
            raise error("second batch")

    model.add_hook("blocks.1.hook_resid_post", raise_on_second_batch)
    with pytest.raises(error):
        model.run_with_cache(tokens, batch_size=3, cache_dir=directory, progress=False)
    attached = {name: len(hp.fwd_hooks) + len(hp.bwd_hooks) for name, hp in model.hook_dict.items()}
    assert {name: n for name, n in attached.items() if n} == {"blocks.1.hook_resid_post": 1}  # the caller's own only
    assert (directory.exists() and list(directory.iterdir()) == []) if existing else not directory.exists()
    assert list(tmp_path.iterdir()) == ([directory] if existing else [])


def test_a_failing_disk_write_leaves_no_files(tmp_path, monkeypatch):
    model = make_model()
    tokens, _ = dataset(None)
    real_save, saved = cache_store.save_file, []

    def save_then_fail(tensors, path):
        saved.append(path)
        if len(saved) == 2:
            real_save(tensors, path)  # a half-written temporary file, then the disk is full
            raise OSError(28, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(cache_store, "save_file", save_then_fail)
    with pytest.raises(OSError, match="No space"):
        model.run_with_cache(tokens, batch_size=3, cache_dir=tmp_path / "a" / "b", progress=False)
    assert list(tmp_path.iterdir()) == [] and no_hooks_left(model)


# ---- bounded memory ------------------------------------------------------------------------------------------
PEAK_CONFIG = dict(n_layers=1, d_model=32, n_heads=16, d_vocab=64, n_ctx=256, attn_only=True)
PEAK_NAMES = ("hook_resid_post", "hook_pattern")
PEAK_SCRIPT = f"""
import resource, sys, torch
import workbench as wb
torch.manual_seed(0)
torch.set_num_threads(1)  # two of these run side by side
model = wb.Decoder(wb.ModelConfig(**{PEAK_CONFIG!r})).eval()
tokens = torch.randint(0, 64, (int(sys.argv[1]), 256))
model.run_with_cache(tokens, names_filter=lambda n: n.endswith({PEAK_NAMES!r}), batch_size=5,
                     cache_dir=sys.argv[2], return_type=None, progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
def test_streaming_to_disk_holds_one_batch_not_the_dataset(tmp_path):
    rows = 100
    model = wb.Decoder(wb.ModelConfig(**PEAK_CONFIG))
    full = wb.cache_size(model, torch.zeros(rows, 256, dtype=torch.long), lambda n: n.endswith(PEAK_NAMES))
    # By hand, per row: the pattern 16 heads x 256 x 256 x 4 bytes = 4 MiB, resid_post 256 pos x
    # 32 d_model x 4 bytes = 32 KiB; a batch of 5 rows ~20 MiB, all 100 rows ~403 MiB.
    assert full == rows * (16 * 256 * 256 * 4 + 256 * 32 * 4) == 422_707_200
    # The same script over one batch and over all 100 rows (20 batches), side by side.
    runs = {n: subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, str(n), str(tmp_path / str(n))], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (5, rows)}
    peaks = {}
    for n, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        peaks[n] = int(out.strip().splitlines()[-1])
    assert len(list((tmp_path / str(rows)).glob("shard-*.safetensors"))) == 20
    assert sum(p.stat().st_size for p in (tmp_path / str(rows)).glob("shard-*")) > full
    assert peaks[rows] - peaks[5] < 0.25 * full, (peaks, full)


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
