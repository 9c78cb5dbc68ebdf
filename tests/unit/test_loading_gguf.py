"""A GGUF load reads shapes from the file's metadata and builds its model once: every tensor's shape is
what the config implies (checked before anything is dequantised), and a hostile file is refused before
anything is allocated for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.integration.gguf_tiny import D_MLP, tiny_llama, write_gguf
from workbench.loading.gguf import loader as gguf_loader
from workbench.loading.build import empty_model
from workbench.loading.gguf.loader import GGUFCheckpoint, GGUFFile, describe, model_config_from_gguf, read_tensors
from workbench.loading.hf.loader import ARCHITECTURES

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("n_experts", [0, 4])
def test_the_meta_dry_run_gives_the_decoders_own_shapes(tmp_path, n_experts):
    """Read on meta tensors (nothing dequantised), the file's tensors have the shapes of the model built
    from its config, and every GGUF tensor is read."""
    file = GGUFFile(write_gguf(tiny_llama(n_experts=n_experts), tmp_path / "tiny.gguf"))
    cfg = model_config_from_gguf(file)
    described = describe(file)
    dry = GGUFCheckpoint(file, described, cfg.n_layers, meta=True)
    tensors = ARCHITECTURES[described.hf_architecture].convert_tensors(dry, cfg, described.hf_architecture)
    params = {n: tuple(p.shape) for n, p in empty_model(cfg).state_dict(keep_vars=True).items()}
    params.pop("unembed._W_U_lin")  # tied: the embedding itself, under a second name
    assert {n: tuple(t.shape) for n, t in tensors.items()} == params
    assert {t.device.type for t in tensors.values()} == {"meta"} and dry.untaken() == []


def test_a_gguf_load_builds_one_model(tiny_gguf, monkeypatch):
    built = []  # the device each Decoder is built on: one, on meta (shapes checked with nothing allocated), filled
    real_init = wb.Decoder.__init__
    monkeypatch.setattr(wb.Decoder, "__init__",
                        lambda self, *a, **k: built.append(torch.empty(0).device.type) or real_init(self, *a, **k))
    model = wb.load_model(tiny_gguf)
    assert built == ["meta"] and model.cfg.n_layers == 2
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_a_hostile_block_count_is_refused_before_any_layer_is_listed(tiny_gguf):
    file = GGUFFile(tiny_gguf)
    cfg = model_config_from_gguf(file).replace(n_layers=10**12)
    with pytest.raises(wb.CheckpointError, match=r"tiny\.gguf: field 'llama\.block_count' declares 1000000000000 "
                                                 r"layers, but the weights hold tensors for 2"):
        read_tensors(file, cfg)


def test_every_shape_is_checked_before_anything_is_dequantised(tiny_gguf, monkeypatch):
    def must_not_run(*args):
        raise AssertionError("dequantised before every shape was checked")

    monkeypatch.setattr(gguf_loader, "_dequantised", must_not_run)
    file = GGUFFile(tiny_gguf)
    cfg = model_config_from_gguf(file).replace(d_mlp=D_MLP + 1)
    with pytest.raises(wb.CheckpointError, match=rf"tiny\.gguf: tensor 'blk\.0\.ffn_gate\.weight' has shape "
                                                 rf"\({D_MLP}, 64\) \(rows, cols as stored\), expected \({D_MLP + 1}, 64\)"):
        read_tensors(file, cfg)


def test_a_zero_head_count_is_refused_naming_the_field(tiny_gguf, monkeypatch):
    file = GGUFFile(tiny_gguf)
    real_field = file.field
    monkeypatch.setattr(file, "field", lambda name, *default: 0 if name == "llama.attention.head_count"
                        else real_field(name, *default))
    with pytest.raises(wb.ConfigError, match=r"llama\.attention\.head_count.*0.*must be a positive integer"):
        model_config_from_gguf(file)  # was a ZeroDivisionError
