"""One answer to "is this hook point observed" (``workbench.hook_point.is_observed``) and one cacher behind every
caching entry point."""

import pytest
import torch
from torch.nn.modules import module as torch_module

import workbench as wb
from workbench.hook_point import is_observed

B, P = 3, 6


def make_model(attn_impl: str = "sdpa") -> wb.Decoder:
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_key_value_heads=2, d_vocab=50, n_ctx=16,
                         normalization="RMS", positional="rotary", act_fn="silu", gated_mlp=True)
    return wb.Decoder(cfg, attn_impl=attn_impl).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 50, (B, P), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attn_impl", wb.ATTN_IMPLS)
def test_a_pre_hook_on_the_pattern_fires_under_every_kernel(attn_impl):
    model, seen = make_model(attn_impl), []
    point = model.hook_dict["blocks.1.attn.hook_pattern"]
    handle = point.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    try:
        assert is_observed(point) and not is_observed(model.hook_dict["blocks.0.attn.hook_pattern"])
        model(tokens())
    finally:
        handle.remove()
    assert seen == [torch.Size([B, 4, P, P])] and not is_observed(point)


@pytest.mark.parametrize("attn_impl", wb.ATTN_IMPLS)
def test_a_global_module_hook_sees_every_pattern_under_every_kernel(attn_impl):
    model, seen = make_model(attn_impl), []
    names = {point: name for name, point in model.hook_dict.items()}

    def record(module, args, output):
        if names.get(module, "").endswith("hook_pattern"):
            seen.append((names[module], output.sum(-1)))

    handle = torch_module.register_module_forward_hook(record)
    try:
        model(tokens())
    finally:
        handle.remove()
    assert [name for name, _ in seen] == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    for _, row_sums in seen:  # real softmax rows
        torch.testing.assert_close(row_sums, torch.ones(B, 4, P))


def test_every_caching_entry_point_gives_the_same_cache():
    model, toks = make_model(), tokens()
    _, plain = model.run_with_cache(toks)  # the cacher as sinks on the points
    _, as_hooks = model.run_with_cache(toks, reset_hooks_end=False)  # the cacher as hooks that outlive the call
    model.reset_hooks()
    _, batched = model.run_with_cache(toks, batch_size=B, progress=False)  # workbench.cache_batches
    cache = model.add_caching_hooks()  # TransformerLens's entry point
    model(toks)
    model.reset_hooks()
    assert model.attached_hooks() == {} and all(p.cache_into is None for p in model.hook_dict.values())
    assert list(plain.keys()) == list(as_hooks.keys()) == list(batched.keys()) == list(cache)
    assert "blocks.0.attn.hook_pattern" in cache and "blocks.0.attn.hook_result" not in cache  # cache-all's choice
    for name in plain.keys():
        for other in (as_hooks[name], batched[name], cache[name]):
            assert torch.equal(plain[name], other), name


def test_tl_options_are_applied_by_the_one_cacher():
    model, toks = make_model(), tokens()
    _, full = model.run_with_cache(toks)
    _, last = model.run_with_cache(toks, pos_slice=-1, device="cpu")
    assert torch.equal(last["blocks.0.attn.hook_z"], full["blocks.0.attn.hook_z"][:, -1:])  # positions 3rd from last
    assert torch.equal(last["blocks.0.hook_resid_post"], full["blocks.0.hook_resid_post"][:, -1:])
    _, one = model.run_with_cache(toks[:1], remove_batch_dim=True)
    # one row against three: the same sums to float rounding
    torch.testing.assert_close(one["blocks.1.hook_resid_pre"], full["blocks.1.hook_resid_pre"][0], rtol=0, atol=1e-6)
    with pytest.raises(wb.InputError, match="batch of one row"):
        model.run_with_cache(toks, remove_batch_dim=True)
    _, with_grads = model.run_with_cache(toks, return_type="loss", incl_bwd=True, reset_hooks_end=False,
                                         names_filter="blocks.1.hook_resid_pre")
    model.reset_hooks()
    assert set(with_grads.keys()) == {"blocks.1.hook_resid_pre", "blocks.1.hook_resid_pre_grad"}
    assert with_grads["blocks.1.hook_resid_pre_grad"].abs().sum() > 0
