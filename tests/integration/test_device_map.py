"""Models across devices: a device map splitting a model between the CPU and disk offload
gives what the in-memory model gives, for logits, caches, hooks, patching, ablation and generation.

The expected values are the same checkpoint loaded whole into memory (SmolLM2-135M from its GGUF; a
tiny `transformers` Llama whose own logits are the reference too), and `transformers`' logits.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import workbench as wb
from experiments.ablation import AblationTarget, head_sweep, run_ablated
from experiments.patching import patch_heads
from tests.integration.hf_tiny import build_and_save
from workbench.errors import ConfigError, InputError
from workbench.extras import MissingExtraError
from workbench.loading.placement import OFFLOAD_INDEX

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def in_memory():
    return wb.load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """SmolLM2 with a CPU budget that holds the embedding and some blocks: the rest goes to disk."""
    folder = tmp_path_factory.mktemp("offload")
    model = wb.load_model("smollm2-135m", device_map="auto", max_memory={"cpu": "300MiB"},
                          offload_folder=folder, progress=False)
    return model, folder


@pytest.fixture(scope="module")
def prompts(in_memory):
    clean = in_memory.to_tokens("When Mary and John went to the store, John gave a drink to")
    corrupt = in_memory.to_tokens("When Mary and John went to the store, Mary gave a drink to")
    return clean, corrupt, in_memory.to_single_token(" Mary"), in_memory.to_single_token(" John")


def test_max_memory_smaller_than_the_model_offloads_blocks_to_disk(offloaded, in_memory):
    model, folder = offloaded
    weights = sum(p.numel() * p.element_size() for p in in_memory.parameters())
    assert weights > 300 * 2**20  # the budget really is smaller than the model
    devices = model.device_map
    assert set(devices.values()) == {"cpu", "disk"}
    assert devices["embed"] == devices["unembed"] == devices["ln_final"] == "cpu"
    on_disk = [unit for unit, device in devices.items() if device == "disk"]
    assert on_disk == [f"blocks.{layer}" for layer in range(30 - len(on_disk), 30)]  # the last blocks, in order
    index = json.loads((folder / OFFLOAD_INDEX).read_text())
    assert {name.split(".attn.")[0].split(".mlp.")[0].rsplit(".ln", 1)[0] for name in index} == set(on_disk)
    assert all((folder / f"{name}.dat").is_file() for name in index)
    # the CPU holds what it was allowed to: top-level modules, its blocks and room for one disk block
    on_cpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
    assert on_cpu <= 300 * 2**20


def test_logits_and_every_cached_activation_equal_the_in_memory_model(offloaded, in_memory, prompts):
    model, _ = offloaded
    clean = prompts[0]
    expected_logits, expected_cache = in_memory.run_with_cache(clean)
    logits, cache = model.run_with_cache(clean, device="cpu")
    torch.testing.assert_close(logits, expected_logits, atol=TOL, rtol=0)
    assert set(cache.keys()) == set(expected_cache.keys())
    for name in expected_cache.keys():
        torch.testing.assert_close(cache[name], expected_cache[name], atol=TOL, rtol=0, msg=name)
        assert cache[name].device.type == "cpu"
    assert model.attached_hooks() == {}


def test_hooks_edit_offloaded_blocks_like_in_memory_ones(offloaded, in_memory, prompts):
    model, _ = offloaded
    clean = prompts[0]
    seen = {}

    def zero_head_3(z, hook):
        seen[hook.name] = z.device
        z[:, :, 3] = 0
        return z

    hooks = [("blocks.2.attn.hook_z", zero_head_3), ("blocks.28.attn.hook_z", zero_head_3)]  # a CPU and a disk block
    assert model.device_map["blocks.2"] == "cpu" and model.device_map["blocks.28"] == "disk"
    expected = in_memory.run_with_hooks(clean, fwd_hooks=hooks)
    torch.testing.assert_close(model.run_with_hooks(clean, fwd_hooks=hooks), expected, atol=TOL, rtol=0)
    assert set(seen) == {"blocks.2.attn.hook_z", "blocks.28.attn.hook_z"}
    assert all(device.type == "cpu" for device in seen.values())  # a disk block runs on the CPU


def test_patching_and_ablation_equal_the_in_memory_model(offloaded, in_memory, prompts):
    model, _ = offloaded
    clean, corrupt, answer, wrong = prompts
    expected = patch_heads(in_memory, clean, corrupt, answer, wrong, progress=False)
    got = patch_heads(model, clean, corrupt, answer, wrong, progress=False)
    torch.testing.assert_close(torch.tensor(got["metric"].values), torch.tensor(expected["metric"].values),
                               atol=TOL, rtol=0)
    targets = [AblationTarget("head", 29, 1), AblationTarget("mlp_layer", 1)]
    torch.testing.assert_close(run_ablated(model, clean, targets), run_ablated(in_memory, clean, targets),
                               atol=TOL, rtol=0)
    short = clean[:, :6]  # the loss over every position: a short prompt keeps the two 270-head sweeps quick
    expected_sweep = head_sweep(in_memory, short, progress=False)
    got_sweep = head_sweep(model, short, progress=False)
    torch.testing.assert_close(torch.tensor(got_sweep["delta"].values), torch.tensor(expected_sweep["delta"].values),
                               atol=TOL, rtol=0)


def test_generation_with_the_kv_cache_equals_the_in_memory_model(offloaded, in_memory, prompts):
    model, _ = offloaded
    clean = prompts[0]
    expected = in_memory.generate(clean, max_new_tokens=12, verbose=False)
    assert torch.equal(model.generate(clean, max_new_tokens=12, verbose=False), expected)
    sampled = dict(max_new_tokens=6, temperature=0.8, top_k=20, seed=3, verbose=False)
    assert torch.equal(model.generate(clean, **sampled), in_memory.generate(clean, **sampled))


def test_a_hook_moving_its_tensor_to_another_device_is_an_error_naming_it(offloaded, prompts):
    model, _ = offloaded

    def elsewhere(resid, hook):
        return resid.to("meta")

    with pytest.raises(InputError, match=r"elsewhere.*'blocks\.20\.hook_resid_post'.*returned a tensor on meta"):
        model.run_with_hooks(prompts[0], fwd_hooks=[("blocks.20.hook_resid_post", elsewhere)])
    assert model.attached_hooks() == {}


def test_plan_memory_matches_the_load_and_a_real_cache(offloaded, in_memory):
    model, _ = offloaded
    table = wb.plan_memory("smollm2-135m", max_memory={"cpu": "300MiB"}, batch=2, pos=11)
    placed = {row.device: row.units for row in table.itertuples()}
    last_cpu_block = max(int(u.split(".")[1]) for u, d in model.device_map.items() if d == "cpu" and u[0] == "b")
    assert placed == {"cpu": f"embed, ln_final, unembed, blocks.0-{last_cpu_block}",
                      "disk": f"blocks.{last_cpu_block + 1}-29"}
    # weights: each parameter of the in-memory model once (the tied embedding too), by where it went
    per_device = {"cpu": 0, "disk": 0}
    for name, param in in_memory.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]
        per_device[model.device_map[unit]] += param.numel() * 4
    assert dict(zip(table.device, table.weights_bytes)) == per_device
    # cache: what run_with_cache really holds for 2 x 11 tokens, split by block
    tokens = torch.randint(0, in_memory.cfg.d_vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    _, cache = in_memory.run_with_cache(tokens)
    per_device = {"cpu": 0, "disk": 0}
    for name, activation in cache.items():
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "embed"
        per_device[model.device_map[unit]] += activation.numel() * activation.element_size()
    assert dict(zip(table.device, table.cache_bytes)) == per_device


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf_model = build_and_save("llama", directory)
    return directory, hf_model


def test_an_explicit_map_over_an_hf_checkpoint_matches_transformers(tiny_llama, tmp_path):
    directory, hf_model = tiny_llama
    device_map = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "ln_final": "cpu", "unembed": "cpu"}
    model = wb.load_model(directory, attn_impl="eager", device_map=device_map, offload_folder=tmp_path / "off")
    assert model.device_map == device_map
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
    torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=0)
    whole = wb.load_model(directory, attn_impl="eager")
    torch.testing.assert_close(model(tokens), whole(tokens), atol=TOL, rtol=0)


def test_tied_embeddings_split_across_devices_are_refused_by_name(tmp_path):
    """Qwen2 ties its unembedding to the embedding: one tensor, so one device. Checked before the devices
    exist, so the error is the same on a machine without the GPU the map names."""
    build_and_save("qwen2", tmp_path)
    device_map = {"embed": "cuda:0", "blocks": "cpu", "ln_final": "cpu", "unembed": "cpu"}
    with pytest.raises(ConfigError, match=r"'embed' on 'cuda:0', 'unembed' on 'cpu', but they share one weight"):
        wb.load_model(tmp_path, device_map=device_map)
    together = wb.load_model(tmp_path, device_map={**device_map, "embed": "cpu"})
    assert together.device_map["embed"] == together.device_map["unembed"] == "cpu"


def test_a_saved_model_loads_with_every_block_on_disk(tmp_path):
    toy = wb.load_model("toy-moe-2l")
    toy.save(tmp_path / "saved")
    model = wb.load_model(tmp_path / "saved", device_map={"blocks": "disk", "embed": "cpu", "ln_final": "cpu",
                                                         "unembed": "cpu"}, offload_folder=tmp_path / "off")
    tokens = torch.randint(0, toy.cfg.d_vocab, (1, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(tokens), toy(tokens), atol=TOL, rtol=0)
    assert all(p.device.type == "meta" for p in model.blocks.parameters())  # read from disk only to run


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_map={"embed": "cpu", "blocks.0.attn": "cpu"}), r"'blocks\.0\.attn' is part of a block"),
    (dict(device_map={"encoder": "cpu"}), r"'encoder' is not a module of this model"),
    (dict(device_map={"embed": "cpu", "blocks.0": "cpu", "ln_final": "cpu", "unembed": "cpu"}),
     r"does not say where 'blocks\.1' goes"),
    (dict(device_map={"blocks": "cpu", "embed": "disk", "ln_final": "cpu", "unembed": "cpu"}),
     r"puts \['embed'\] on 'disk'"),
    (dict(device_map={"blocks": "disk", "embed": "cpu", "ln_final": "cpu", "unembed": "cpu"}),
     r"pass offload_folder="),
    (dict(device_map={"blocks": "cuda:0", "embed": "cpu", "ln_final": "cpu", "unembed": "cpu"}),
     r"device_map\['blocks\.0'\] = 'cuda:0'"),
    (dict(device_map="balanced"), r"use 'auto', 'sequential' or a dict"),
    (dict(device_map={"blocks": "tpu", "embed": "cpu", "ln_final": "cpu", "unembed": "cpu"}), r"'tpu' is not a device"),
    (dict(device_map="auto", device="cuda"), r"both say where the weights go"),
    (dict(max_memory={"cpu": "1GiB"}), r"need a device_map"),
    (dict(device_map="auto", max_memory={"cpu": "1MiB"}), r"need .* on cpu, but max_memory allows 1\.0 MiB"),
])
def test_bad_placements_are_refused_by_name(kwargs, message):
    if "cuda" in message and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=message):
        wb.load_model("toy-attn-2l", **kwargs)


def test_a_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and not an earlier offload"):
        wb.load_model("toy-attn-2l", device_map={"blocks": "disk", "embed": "cpu", "ln_final": "cpu",
                                                 "unembed": "cpu"}, offload_folder=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_failed_load_leaves_no_offloaded_file(tmp_path, monkeypatch):
    import accelerate

    def broken(*args, **kwargs):
        raise RuntimeError("dispatch failed")

    monkeypatch.setattr(accelerate, "dispatch_model", broken)
    with pytest.raises(RuntimeError, match="dispatch failed"):
        wb.load_model("toy-attn-2l", device_map={"blocks": "disk", "embed": "cpu", "ln_final": "cpu",
                                                 "unembed": "cpu"}, offload_folder=tmp_path / "off")
    assert list((tmp_path / "off").iterdir()) == []


def test_reloading_into_the_same_folder_replaces_the_earlier_offload(tmp_path):
    device_map = {"blocks": "disk", "embed": "cpu", "ln_final": "cpu", "unembed": "cpu"}
    wb.load_model("toy-moe-2l", device_map=device_map, offload_folder=tmp_path)
    model = wb.load_model("toy-attn-2l", device_map=device_map, offload_folder=tmp_path)
    index = json.loads((tmp_path / OFFLOAD_INDEX).read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{n}.dat" for n in index] + [OFFLOAD_INDEX])
    tokens = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(tokens), wb.load_model("toy-attn-2l")(tokens), atol=TOL, rtol=0)


def test_without_accelerate_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(MissingExtraError, match=r"need the package 'accelerate'.*pip install -e \"\.\[scale\]\""):
        wb.load_model("toy-attn-2l", device_map="auto")


def test_workbench_plan_prints_the_bytes_per_device(capsys):
    from workbench.cli import main

    assert main(["plan", "smollm2-135m", "--max-memory", "cpu=300MiB", "--batch", "2", "--pos", "11"]) == 0
    printed = capsys.readouterr().out
    table = wb.plan_memory("smollm2-135m", max_memory={"cpu": "300MiB"}, batch=2, pos=11)
    for row in table.itertuples():
        assert f"{row.device}" in printed and row.units in printed and row.weights in printed
    assert main(["plan", "smollm2-135m", "--max-memory", "cpu"]) != 0
