"""A checkpoint's declared sizes never allocate or compute beyond what its file holds.

Each hostile file is written by the test itself and opened in a subprocess whose address space is capped a
little above what the imports use (``CAP``) and whose run is bounded by a timeout: a layer count the weights
lack is a ``CheckpointError`` naming the field before any block is built (``load_model`` and ``plan_memory``
alike), and a huge declared context (RoPE or sinusoidal positions) builds tables only for the positions used.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.components import embedding
from workbench.loading.registry import ZOO

pytestmark = pytest.mark.slow  # a fresh process per hostile file

ROOT = Path(__file__).resolve().parents[2]
CAP = 768 * 2**20  # bytes of address space the hostile call may add to the imports' own
TIMEOUT_S = 120  # far above a refusal's cost; a block built per declared layer would take hours

PROBE = """
import resource, sys
import torch
import workbench as wb
size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + {cap}, size + {cap}))
path = sys.argv[1]
for name, call in (("load_model", lambda: wb.load_model(path, progress=False)),
                   ("plan_memory", lambda: wb.plan_memory(path, pos=16))):
    try:
        result = call()
    except (wb.CheckpointError, wb.ConfigError) as error:  # plan_memory: a plan that fits nowhere is a ConfigError
        print(name, "REFUSED", type(error).__name__, error)
        continue
    if name == "load_model":
        logits = result(torch.tensor([[1, 2, 3]]))
        print(name, "LOADED", bool(torch.isfinite(logits).all()))
    else:
        print(name, "PLANNED", int(result.weights_bytes.sum()))
"""


def probe(path: Path) -> dict[str, str]:
    """{call: what it printed} for ``load_model`` and ``plan_memory`` on ``path`` under the memory cap."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(cap=CAP), str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def saved_zoo_model(tmp_path: Path, **config) -> Path:
    """toy-attn-2l saved in our format with ``config`` written over its config.json."""
    directory = tmp_path / "model"
    shutil.copytree(ZOO / "toy-attn-2l", directory)
    data = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, **config}))
    return directory


def saved_hf_llama(tmp_path: Path, **config) -> Path:
    """A tiny Llama written by transformers, with ``config`` written over its config.json."""
    from tests.integration.hf_tiny import build_and_save
    directory = tmp_path / "llama"
    build_and_save("llama", directory)
    data = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, **config}))
    return directory


@pytest.mark.parametrize("write, field", [(saved_zoo_model, "n_layers"), (saved_hf_llama, "num_hidden_layers")])
def test_a_checkpoint_declaring_more_layers_than_its_weights_is_refused_before_building(tmp_path, write, field):
    out = probe(write(tmp_path, **{field: 100_000}))
    for call in ("load_model", "plan_memory"):
        assert out[call].startswith("REFUSED"), out
        assert f"config.json: field '{field}' declares 100000 layers, but the weights hold tensors for 2" in out[call]


@pytest.mark.parametrize("field", ["d_vocab", "d_model"])
def test_our_format_declaring_sizes_its_tensors_lack_is_refused_before_allocating(tmp_path, field):
    # 1e9 x 128 float32 parameters: 512 GB if the model were built before its tensors were checked.
    out = probe(saved_zoo_model(tmp_path, **{field: 10**9}))
    assert out["load_model"].startswith("REFUSED CheckpointError") and "expected (" in out["load_model"], out
    assert out["plan_memory"].split()[0] in ("REFUSED", "PLANNED"), out  # read from the config, within the cap


@pytest.mark.parametrize("rope_type", ["default", "dynamic"])
def test_a_huge_declared_rope_context_loads_and_plans_within_the_cap(tmp_path, rope_type):
    # 1e9 positions: RoPE's float64 table alone would be 32 GB. Dynamic NTK reads the longest position of each
    # call, which the plan's pass on the meta device does not have.
    rope = {"rope_type": rope_type, "rope_theta": 500.0, **({"factor": 2.0} if rope_type == "dynamic" else {})}
    out = probe(saved_hf_llama(tmp_path, max_position_embeddings=10**9, rope_parameters=rope))
    assert out["load_model"] == "LOADED True" and out["plan_memory"].startswith("PLANNED"), out


def test_a_huge_declared_sinusoidal_context_loads_and_plans_within_the_cap(tmp_path):
    # 1e9 positions x d_model 128 in float32: a 512 GB table if built whole.
    out = probe(saved_zoo_model(tmp_path, positional="sinusoidal", n_ctx=10**9))
    assert out["load_model"] == "LOADED True" and out["plan_memory"].startswith("PLANNED"), out


def test_the_sinusoidal_table_grows_to_the_positions_used_with_the_formulas_values(monkeypatch):
    monkeypatch.setattr(embedding, "INITIAL_POSITIONS", 4)
    cfg = wb.ModelConfig(n_layers=1, d_model=6, n_heads=1, d_vocab=10, n_ctx=100, positional="sinusoidal")
    pos_embed = embedding.SinusoidalPosEmbed(cfg, wb.RuntimeOptions())
    assert pos_embed.table.shape == (4, 6)
    out = pos_embed(torch.tensor([0, 3, 41]))
    assert pos_embed.table.shape == (42, 6)  # grown to the longest position used (doubling at least)
    for row, p in enumerate((0, 3, 41)):  # PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)
        expected = [f(p / 10000 ** (2 * (j // 2) / 6)) for j, f in zip(range(6), [math.sin, math.cos] * 3)]
        assert out[row].tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("style", ["interleaved", "fairseq"])
def test_w_pos_of_a_sinusoidal_model_covers_its_whole_context(monkeypatch, style):
    monkeypatch.setattr(embedding, "INITIAL_POSITIONS", 4)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=40,
                                      positional="sinusoidal", sinusoidal_style=style))
    model.pos_embed(torch.tensor([9]))  # grown once in between: the rows it had keep their values
    assert model.W_pos.shape == (40, 8)
    assert torch.equal(model.W_pos, embedding.sinusoidal_table(40, 8, style))

