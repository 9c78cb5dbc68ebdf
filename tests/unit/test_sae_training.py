"""Training SAEs and transcoders (``experiments.sae``): planted directions recovered, memory bounded by the buffer,
resume equals uninterrupted, ``evaluate_sae`` against a hand computation, trained transcoders in attribution,
bad input. Expected values come from hand computations and the independent splicing code, never from the trainer.
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

import workbench as wb
from experiments.sae import evaluate_sae, train_clt, train_sae
from workbench.cache_store import ShardWriter
from workbench.errors import InputError

FAST = dict(progress=False, train_batch_size_tokens=256, buffer_tokens=1024, log_every=1)


def _mlp_model(seed: int = 0, d_model: int = 32) -> wb.Decoder:
    torch.manual_seed(seed)
    return wb.Decoder(wb.ModelConfig(n_layers=2, d_model=d_model, n_heads=2, d_vocab=64, n_ctx=32)).eval()


def _planted_cache(folder: Path, model, n_rows: int, pos: int, directions: torch.Tensor, seed: int) -> Path:
    """A run_with_cache-format cache of 'blocks.0.hook_resid_post' holding sparse sums of ``directions``."""
    generator = torch.Generator().manual_seed(seed)
    n_true, width = directions.shape
    writer = ShardWriter(folder, model)
    for start in range(0, n_rows, 64):
        rows = min(64, n_rows - start)
        active = torch.rand(rows, pos, n_true, generator=generator) < 2 / n_true
        magnitude = 1 + torch.rand(rows, pos, n_true, generator=generator)
        writer.write(start, start + rows, {"blocks.0.hook_resid_post": (active * magnitude) @ directions})
    writer.finish(rows=n_rows)
    return folder


def test_training_recovers_planted_sparse_directions(tmp_path):
    model = _mlp_model()
    # 24 random (non-orthogonal) unit directions in 32 dimensions, about 2 active per token with magnitudes in [1, 2]
    directions = torch.nn.functional.normalize(torch.randn(24, 32, generator=torch.Generator().manual_seed(1)), dim=-1)
    tokens = torch.randint(1, 64, (128, 16))
    cache = _planted_cache(tmp_path / "cache", model, 128, 16, directions, seed=2)
    sae = train_sae(model, "blocks.0.hook_resid_post", tokens, "topk", d_sae=48, k=3, activation_cache=[cache],
                    training_tokens=256 * 40, lr=3e-2, dead_feature_window=5, **FAST)
    decoder = torch.nn.functional.normalize(sae.W_dec.detach(), dim=-1)
    best = (directions @ decoder.T).max(dim=1).values
    assert (best >= 0.9).float().mean() >= 0.9, best


def test_resume_gives_the_uninterrupted_result(tmp_path):
    model = _mlp_model()
    tokens = torch.randint(1, 64, (24, 16))
    kwargs = dict(architecture="topk", d_sae=64, k=4, training_tokens=256 * 6, checkpoint_every=2, **FAST)
    whole = train_sae(model, "blocks.1.hook_resid_post", tokens, checkpoint_dir=tmp_path / "a", **kwargs)
    resumed = train_sae(model, "blocks.1.hook_resid_post", tokens, resume_from=tmp_path / "a" / "step-2", **kwargs)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    assert whole.training_log.equals(resumed.training_log)


def test_training_memory_is_bounded_by_the_buffer(tmp_path):
    # One process trains on a small cache (17 MB of activations, twice the buffer), then on a large one (67 MB):
    # the peak RSS after the larger run stays within 24 MB of the first, under half the 50 MB more that holding its
    # activations would take (measured: 12 to 19 MB, from the allocator and the larger run's token rows and order).
    model = _mlp_model(d_model=256)
    small, large = tmp_path / "small", tmp_path / "large"
    directions = torch.randn(64, 256)
    _planted_cache(small, model, 256, 64, directions, seed=0)
    _planted_cache(large, model, 1024, 64, directions, seed=1)
    script = textwrap.dedent(f"""
        import resource, torch, workbench as wb
        from experiments.sae import train_sae
        torch.manual_seed(0)
        model = wb.Decoder(wb.ModelConfig(n_layers=2, d_model=256, n_heads=2, d_vocab=64, n_ctx=32)).eval()
        peaks = []
        for folder, rows in (({str(small)!r}, 256), ({str(large)!r}, 1024)):
            train_sae(model, "blocks.0.hook_resid_post", torch.randint(1, 64, (rows, 64)), "topk", d_sae=16, k=2,
                      activation_cache=[folder], training_tokens=rows * 64, train_batch_size_tokens=4096,
                      buffer_tokens=8192, store_batch_size_prompts=16, progress=False)
            peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        print(peaks)
    """)
    # A fixed mmap threshold: glibc's dynamic one would keep freed buffers in the heap, so the peak would depend on
    # the order of allocations rather than on what is held.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parents[2], env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = json.loads(result.stdout.strip().splitlines()[-1])
    assert second - first < 24 * 1024, (first, second)  # KiB


def test_evaluate_sae_matches_a_hand_computation():
    model = wb.load_model("toy-attn-2l", progress=False).eval()
    torch.manual_seed(0)
    hook = "blocks.1.hook_resid_post"
    cfg = wb.SAEConfig("standard", d_in=128, d_sae=64, metadata={"hook_name": hook})
    sae = wb.SAE.from_tensors(cfg, {"W_enc": torch.randn(128, 64) / 8, "W_dec": torch.randn(64, 128) / 8,
                                    "b_enc": torch.randn(64) / 4 - 0.3, "b_dec": torch.randn(128) / 8})
    tokens = torch.randint(1, 2048, (3, 20))
    metrics = evaluate_sae(model, sae, tokens, batch_size=2, exclude_special_tokens=False, progress=False)
    with torch.no_grad():
        clean, cache = model.run_with_cache(tokens, names_filter=hook)
        y = cache[hook].reshape(-1, 128)
        features = torch.relu((y - sae.b_dec) @ sae.W_enc + sae.b_enc)
        y_hat = features @ sae.W_dec + sae.b_dec
        loss_clean = model(tokens, return_type="loss")
        loss_spliced = model.run_with_saes(tokens, saes=[sae], return_type="loss")
        loss_zero = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(hook, lambda a, hook: torch.zeros_like(a))])
    density = (features > 0).float().mean(0)
    expected = {"l0": (features > 0).sum(-1).float().mean(),
                "explained_variance": 1 - (y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum(),
                "ce_loss_without_sae": loss_clean, "ce_loss_with_sae": loss_spliced, "ce_loss_with_ablation": loss_zero,
                "ce_loss_score": (loss_zero - loss_spliced) / (loss_zero - loss_clean),
                "dead_fraction": (density == 0).float().mean(), "dense_fraction": (density > 0.1).float().mean()}
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(float(value), rel=1e-4, abs=1e-5), name
    assert metrics["n_tokens"] == 60


def test_trained_transcoders_load_and_run_in_attribution(tmp_path):
    from experiments.attribution import attribute

    model = _mlp_model()
    tokens = torch.randint(1, 64, (16, 16))
    folders = []
    for layer in range(2):
        folder = tmp_path / "per_layer" / f"layer_{layer}"
        train_sae(model, f"blocks.{layer}.ln2.hook_normalized", tokens, "standard", d_sae=32,
                  hook_name_out=f"blocks.{layer}.hook_mlp_out", skip=True, training_tokens=512, out=folder, **FAST)
        folders.append(folder)
    per_layer = wb.load_transcoders(tmp_path / "per_layer")
    assert per_layer.n_layers == 2 and per_layer.skip_connection and not per_layer.cross_layer
    clt = train_clt(model, tokens, d_transcoder=16, architecture="batchtopk", k=4, training_tokens=512,
                    out=tmp_path / "clt", **FAST)
    loaded = wb.load_transcoders(tmp_path / "clt")
    assert loaded.cross_layer and [d.shape[1] for d in loaded.W_dec] == [2, 1]
    x = torch.randn(5, 32)
    assert torch.allclose(loaded.encode(0, x), clt.encode(0, x))
    for transcoders in (per_layer, loaded):
        graph = attribute(model, transcoders, [1, 5, 9, 13], max_n_logits=2, progress=False)
        assert graph.adjacency_matrix.shape[0] == graph.n_nodes and torch.isfinite(graph.adjacency_matrix).all()


def test_saved_formats_round_trip(tmp_path):
    model = _mlp_model()
    tokens = torch.randint(1, 64, (16, 16))
    sae = train_sae(model, "blocks.0.hook_resid_post", tokens, "batchtopk", d_sae=32, k=4, training_tokens=1024,
                    out=tmp_path / "btk", **FAST)
    loaded = wb.load_sae(tmp_path / "btk")
    assert loaded.cfg.architecture() == "jumprelu" and torch.equal(loaded.threshold, sae.threshold)
    assert (tmp_path / "btk" / "training_log.csv").is_file()
    x = torch.randn(4, 32)
    assert torch.equal(loaded.encode(x), sae.encode(x))


@pytest.mark.parametrize("kwargs, named", [
    (dict(hook_name="blocks.9.hook_resid_post"), "hook_name"),
    (dict(architecture="gated"), "architecture"),
    (dict(k=100), "k"),
    (dict(d_sae=0), "d_sae"),
    (dict(skip=True), "skip"),
    (dict(hook_name_out="blocks.0.hook_mlp_out"), "architecture='topk' cannot be a transcoder"),
    (dict(hook_name_out="blocks.0.no_such_hook", architecture="standard"), "hook_name_out"),
    (dict(training_tokens=10), "training_tokens"),
    (dict(buffer_tokens=8), "buffer_tokens"),
    (dict(no_such_option=1), "no_such_option"),
])
def test_bad_input_is_a_clear_error_leaving_nothing_attached(kwargs, named):
    model = _mlp_model()
    arguments = dict(hook_name="blocks.0.hook_resid_post", architecture="topk", d_sae=32, k=4, progress=False,
                     training_tokens=1024, train_batch_size_tokens=256)
    arguments.update(kwargs)
    with pytest.raises(InputError, match=named.replace("(", r"\(").replace("[", r"\[")):
        train_sae(model, data=torch.randint(1, 64, (4, 8)), **arguments)
    assert not any(point._forward_hooks for point in model.hook_dict.values())


def test_shipped_dictionaries_load_by_name():
    table = wb.shipped_saes()
    for row in table[table.kind == "sae"].itertuples():
        sae = wb.load_sae(row.name)
        assert (sae.cfg.hook_name, sae.cfg.d_sae, sae.cfg.architecture()) == (row.hook_name, row.d_sae, row.architecture)
        assert (Path(row.path) / "CARD.md").is_file()
        # By name in float32, as SAELens's from_pretrained opens a release; by path in the config's dtype, as
        # its load_from_disk; an explicit dtype wins either way.
        config_dtype = json.loads((Path(row.path) / "cfg.json").read_text()).get("dtype", "float32")
        assert sae.W_enc.dtype == torch.float32
        assert wb.load_sae(row.path).W_enc.dtype == getattr(torch, config_dtype)
        assert wb.load_sae(row.name, dtype="bfloat16").W_enc.dtype == torch.bfloat16
    assert "float16" in {json.loads((Path(path) / "cfg.json").read_text()).get("dtype")
                         for path in table[table.kind == "sae"].path}   # the case the default is for is shipped
    for row in table[table.kind == "transcoders"].itertuples():
        assert wb.load_transcoders(row.path).n_layers == wb.loading.model_config(row.model).n_layers
        assert (Path(row.path) / "CARD.md").is_file()


def test_the_command_line_lists_its_commands_on_help_and_refuses_an_unknown_one(capsys):
    from experiments.cli.sae import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: python -m experiments.sae {cache,train,evaluate,bench}")
    assert all(f"\n  {name} " in shown for name in ("cache", "train", "evaluate", "bench"))
    with pytest.raises(SystemExit, match=r"(?s)usage: .*\(got \['bogus'\]\)"):
        main(["bogus"])
