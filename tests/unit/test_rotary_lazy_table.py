"""RoPE's table is built for the positions a model uses, not for its whole declared context (a config's
``max_position_embeddings`` alone must never allocate gigabytes)."""

import time

import torch

import workbench as wb
from workbench.components import rotary


def rotary_model(n_ctx: int) -> wb.Decoder:
    torch.manual_seed(0)
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=n_ctx, positional="rotary",
                         normalization="RMS", gated_mlp=True, act_fn="silu")
    return wb.Decoder(cfg).eval()


def test_a_huge_declared_context_allocates_only_the_initial_rows():
    start = time.process_time()
    model = rotary_model(10**8)  # 1e8 positions x 8 angles in float64: 6 GB if built whole
    assert time.process_time() - start < 5  # CPU time: the table is not built (about a second at 1e8 on a fast core)
    tables = {id(block.attn.rotary.cos) for block in model.blocks}
    assert len(tables) == 1  # one shared table
    assert model.blocks[0].attn.rotary.cos.shape[0] == rotary.INITIAL_POSITIONS


def test_the_table_grows_to_the_positions_used_with_the_same_values(monkeypatch):
    full = rotary_model(64)
    monkeypatch.setattr(rotary, "INITIAL_POSITIONS", 4)
    lazy = rotary_model(64)
    lazy.load_state_dict(full.state_dict())
    assert lazy.blocks[0].attn.rotary.cos.shape[0] == 4
    tokens = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(lazy(tokens), full(tokens))  # rows depend on their position only
    assert lazy.blocks[0].attn.rotary.cos.shape[0] == 40  # grown to what the call used (doubling, at least)
    longest = torch.randint(0, 50, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(lazy(longest), full(longest))
    assert lazy.blocks[0].attn.rotary.cos.shape[0] == 64  # at most n_ctx
