"""``workbench.loading.build``: every loader hands its runtime options (dtype, attn_impl, device) to
``build_model``, which applies them in one place; a bad option fails before any tensor is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.integration.gguf_tiny import tiny_llama, write_gguf
from tests.integration.hf_tiny import build_and_save
from workbench.loading import build, native
from workbench.loading.gguf import loader as gguf_loader
from workbench.loading.hf import loader as hf_loader


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    build_and_save("llama", root / "hf")
    saved = wb.load_model(root / "hf").save(root / "native")
    return {"hf": root / "hf", "gguf": write_gguf(tiny_llama(), root / "tiny.gguf"), "native": saved}


# Where each loader reads its tensors: a bad option must fail before that.
READERS = {"hf": (hf_loader, "SafetensorsCheckpoint"), "gguf": (gguf_loader, "read_tensors"), "native": (native, "load_file")}


@pytest.mark.parametrize("kind", sorted(READERS))
def test_each_loader_passes_dtype_and_attn_impl_to_build(sources, kind, monkeypatch):
    seen = []
    real = build.runtime_options
    monkeypatch.setattr(build, "runtime_options",
                        lambda cfg, **options: seen.append({k: options[k] for k in ("dtype", "attn_impl")})
                        or real(cfg, **options))
    model = wb.load_model(sources[kind], dtype=torch.bfloat16, attn_impl="eager")
    assert (model.cfg.dtype, model.cfg.attn_impl, model.cfg.device) == (torch.bfloat16, "eager", "cpu")
    assert dict(dtype=torch.bfloat16, attn_impl="eager") in seen  # build_model applied them


@pytest.mark.parametrize("kind", sorted(READERS))
def test_a_bad_option_fails_before_any_tensor_is_read(sources, kind, monkeypatch):
    module, reader = READERS[kind]

    def must_not_run(*args, **kwargs):
        raise AssertionError("tensors read before the options were checked")

    monkeypatch.setattr(module, reader, must_not_run)
    with pytest.raises(wb.ConfigError, match=r"attn_impl must be one of .*got 'fast'"):
        wb.load_model(sources[kind], attn_impl="fast")
    with pytest.raises(wb.ConfigError, match=r"dtype must be a floating-point torch\.dtype"):
        wb.load_model(sources[kind], dtype=torch.int8)
    with pytest.raises(wb.ConfigError, match=r"device='gpu' is not a device"):
        wb.load_model(sources[kind], device="gpu")
    missing = f"cuda:{torch.cuda.device_count()}"   # one past this machine's last GPU (cuda:0 on a CPU machine)
    with pytest.raises(wb.ConfigError, match=rf"device='{missing}', but this machine has \d+ CUDA device"):
        wb.load_model(sources[kind], device=missing)


def test_a_device_this_machine_lacks_is_refused_by_every_loader_before_a_file_is_read(monkeypatch):
    missing = f"cuda:{torch.cuda.device_count()}"
    # torch's own refusal ("Torch not compiled with CUDA enabled", an AssertionError) came after the files were read
    monkeypatch.setattr("workbench.sae.files.read_json", lambda *a, **k: pytest.fail("a config was read"))
    with pytest.raises(wb.ConfigError, match=rf"device='{missing}'"):
        wb.load_sae("toy-attn-2l-resid1-topk", device=missing)
    with pytest.raises(wb.ConfigError, match=rf"device='{missing}'"):
        wb.load_transcoders("toy-moe-2l-clt", device=missing)
    monkeypatch.undo()
    assert wb.load_sae("toy-attn-2l-resid1-topk", device=torch.device("cpu")).W_enc.device.type == "cpu"


def test_an_hf_load_keeps_the_checkpoint_dtype_unless_told(sources):
    assert wb.load_model(sources["hf"]).cfg.dtype == hf_loader.hf_checkpoint_dtype(sources["hf"])
    assert wb.load_model(sources["hf"], dtype=torch.float16).cfg.dtype == torch.float16


def test_a_dispatched_build_records_where_tokens_go(sources):
    pytest.importorskip("accelerate")
    model = wb.load_model(sources["native"], device_map={"embed": "cpu", "blocks": "cpu", "ln_final": "cpu",
                                                          "unembed": "cpu"}, attn_impl="eager")
    assert model.cfg.device == "cpu" and model.cfg.attn_impl == "eager" and model.device_map["blocks.1"] == "cpu"
