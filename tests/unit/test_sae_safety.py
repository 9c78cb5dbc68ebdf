"""Sparse dictionaries under threads, interrupted calls, failed saves and hostile transcoder folders.

Expected values are the SAE's own clean arithmetic (``by_hand``, written out in test_sae_splicing) and the files'
previous contents; every hostile input must end in a clear error naming what is wrong, before anything big is built.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import workbench as wb
from tests.unit.test_sae_splicing import by_hand, features_by_hand, model, random_sae, tokens  # noqa: F401 (fixtures)
from workbench.errors import CheckpointError, ConfigError, InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "attribution"


# ---- a dictionary used directly while spliced ---------------------------------------------------------------
def test_an_sae_used_directly_in_another_thread_meets_neither_the_runs_cache_nor_its_edits(model, tokens):
    sae = random_sae("standard", "blocks.1.hook_resid_pre", 32, seed=4)
    other = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    acts_name = "blocks.1.hook_resid_pre.hook_sae_acts_post"
    direct = {}

    def use_directly_meanwhile(resid, hook):  # the spliced run is under way: another thread encodes with the SAE
        worker = threading.Thread(target=lambda: direct.update(features=sae.encode(other).detach()))
        worker.start()
        worker.join()
        return resid

    with torch.no_grad():
        _, solo = model.run_with_cache_with_saes(tokens, saes=[sae], names_filter=[acts_name])
        with model.saes(saes=[sae]), model.hooks(fwd_hooks=[("blocks.0.hook_resid_mid", use_directly_meanwhile),
                                                            (acts_name, lambda acts, hook: acts * 0)]):
            _, cache = model.run_with_cache(tokens, names_filter=[acts_name])
    assert torch.equal(direct["features"], features_by_hand(sae, other))   # not zeroed by the run's edit
    assert cache[acts_name].shape == solo[acts_name].shape == (2, 10, 24)  # only the run's own activations
    assert torch.equal(cache[acts_name], torch.zeros_like(solo[acts_name]))
    assert model.attached_hooks() == {} and not sae.hook_sae_acts_post.fwd_hooks


def transcoder(model) -> wb.SAE:
    """A transcoder reading layer 0's output and writing layer 1's MLP output (two blocks apart)."""
    return random_sae("transcoder", "blocks.0.hook_resid_post", 32, d_out=32, apply_b_dec_to_input=False,
                      meta={"hook_name_out": "blocks.1.hook_mlp_out"})


@pytest.mark.parametrize("interrupted", ["stopped", "raised"])
def test_a_spliced_transcoder_never_reuses_the_input_of_an_interrupted_call(model, tokens, interrupted):
    tc = transcoder(model)
    with torch.no_grad():
        resid = model(tokens, stop_at_layer=1)
        model.add_sae(tc)
        try:
            if interrupted == "stopped":
                model(tokens * 0, stop_at_layer=1)   # reads the input hook, never reaches the output hook
            else:
                def boom(x, hook):
                    raise RuntimeError("boom")
                with pytest.raises(RuntimeError, match="boom"):
                    model.run_with_hooks(tokens * 0, fwd_hooks=[("blocks.1.hook_resid_mid", boom)])
            with pytest.raises(InputError, match="fired before its input hook"):
                model(resid, start_at_layer=1)   # no input of its own this call: an error, not the old one
            spliced = model(tokens)
        finally:
            model.reset_saes()
        expected = model.run_with_hooks(tokens, fwd_hooks=[
            ("blocks.1.hook_mlp_out", lambda out, hook: by_hand(tc, resid))])
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)
    assert model.attached_hooks() == {}


# ---- saves ----------------------------------------------------------------------------------------------------
def _failing_after_partial_write(path, *args, **kwargs):
    Path(path).write_bytes(b"half a file")
    raise OSError("disk full")


def test_a_failed_sae_save_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    old = random_sae("standard", "blocks.0.hook_resid_pre", 32, seed=1)
    new = random_sae("standard", "blocks.0.hook_resid_pre", 32, seed=2)
    old.save(tmp_path / "sae")
    monkeypatch.setattr("workbench.sae.format.save_file", lambda tensors, path: _failing_after_partial_write(path))
    with pytest.raises(OSError, match="disk full"):
        new.save(tmp_path / "sae")
    with pytest.raises(OSError, match="disk full"):
        wb.sae.save_sae(new, tmp_path / "sae")
    back = wb.load_sae(tmp_path / "sae")
    assert torch.equal(back.W_enc, old.W_enc) and sorted(p.name for p in (tmp_path / "sae").iterdir()) == [
        "cfg.json", "sae_weights.safetensors"]


def test_a_failed_transcoder_save_leaves_the_previous_set_loadable(tmp_path, monkeypatch):
    tc = wb.load_transcoders(FIXTURES / "plt_skip")
    tc.save(tmp_path / "ours")
    monkeypatch.setattr("workbench.transcoders.format.save_file",
                        lambda tensors, path: _failing_after_partial_write(path))
    with pytest.raises(OSError, match="disk full"):
        wb.load_transcoders(FIXTURES / "plt").save(tmp_path / "ours")
    back = wb.load_transcoders(tmp_path / "ours")
    assert back.skip_connection and torch.equal(back.W_skip[1], tc.W_skip[1])
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["transcoders.json", "transcoders.safetensors"]


def test_saves_never_write_through_a_link(tmp_path):
    sae = random_sae("standard", "blocks.0.hook_resid_pre", 32)
    (tmp_path / "sae").mkdir()
    (tmp_path / "elsewhere.json").write_text("{}")
    (tmp_path / "sae" / "cfg.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match="through a link"):
        sae.save(tmp_path / "sae")
    assert (tmp_path / "elsewhere.json").read_text() == "{}"


# ---- transcoder readers ---------------------------------------------------------------------------------------
def test_an_empty_list_of_transcoders_is_a_clear_error():
    with pytest.raises(InputError, match="empty list"):
        wb.load_transcoders([])


def test_our_n_layers_is_bounded_by_the_layers_the_file_holds(tmp_path):
    folder = wb.load_transcoders(FIXTURES / "plt").save(tmp_path / "ours")
    config = json.loads((folder / "transcoders.json").read_text())
    (folder / "transcoders.json").write_text(json.dumps({**config, "n_layers": 10 ** 12}))
    with pytest.raises(ConfigError, match=r"'n_layers' is 1000000000000, but transcoders.safetensors holds 3 layers"):
        wb.load_transcoders(folder)


def test_layer_files_outside_the_folder_are_refused(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "plt", tmp_path / "plt"))
    outside = Path(shutil.copy(folder / "layer_0.safetensors", tmp_path / "outside.safetensors"))
    config = yaml.safe_load((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "transcoders": [str(outside)] * 3}))
    with pytest.raises(ConfigError, match="resolves outside the config's folder"):
        wb.load_transcoders(folder)
    (folder / "linked.safetensors").symlink_to(outside)
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "transcoders": ["linked.safetensors"] * 3}))
    with pytest.raises(ConfigError, match="resolves outside the config's folder"):
        wb.load_transcoders(folder)


@pytest.mark.parametrize("document, match", [
    ("a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nd: &d [*c, *c, *c, *c]\n"
     "e: [*d, *d, *d, *d]\n", "aliases expand to"),
    ("a: &a [1, *a]\n", "refers to the node that holds it"),
    ("model_kind: " + "[" * 100_000 + "]" * 100_000 + "\n", "not a readable YAML file"),
])
def test_yaml_aliases_expand_no_further_than_the_data(tmp_path, document, match):
    folder = Path(shutil.copytree(FIXTURES / "plt", tmp_path / "plt"))
    (folder / "config.yaml").write_text(document)
    with pytest.raises(CheckpointError, match=match):
        wb.load_transcoders(folder)


def test_a_negative_circuit_tracer_threshold_is_refused_not_computed_another_way(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "plt", tmp_path / "plt"))
    layer = load_file(str(folder / "layer_0.safetensors"))
    layer["activation_function.threshold"] = -layer["activation_function.threshold"]
    save_file(layer, str(folder / "layer_0.safetensors"))
    with pytest.raises(CheckpointError, match="'activation_function.threshold' has negative entries"):
        wb.load_transcoders(folder)


def test_the_set_is_a_module_list_of_sae_transcoders_in_saelens_layout():
    tc = wb.load_transcoders(FIXTURES / "clt")
    file = load_file(str(FIXTURES / "clt" / "W_enc_1.safetensors"))
    assert all(isinstance(sae, wb.SAE) and sae.spec.transcoder for sae in tc.layers)
    assert torch.equal(tc.layers[1].W_enc, file["W_enc_1"].T)            # [d_model, d_transcoder]
    x = torch.randn(4, tc.d_model)
    torch.testing.assert_close(tc.encode(1, x), tc.layers[1].encode(x).detach())
    assert tc.layer_sae(1).W_dec.shape == (tc.d_transcoder, tc.d_model)
