"""Without autograd, RMSNorm, the gated MLP and the residual adds write into tensors they made themselves
(fewer allocations in a head sweep). The reference is the same model with autograd on, where
every step makes a new tensor: logits, cached activations and hook edits must be the same bits, and no
cached or hooked tensor may be changed afterwards by a later in-place step."""

import pytest
import torch

from tests.unit.helpers import VARIANTS, make_model
from workbench.components import GatedMLP, RMSNorm
from workbench.options import RuntimeOptions

import workbench as wb

TOKENS = torch.tensor([[1, 7, 3, 9, 4, 12, 5, 2], [6, 2, 8, 8, 1, 30, 11, 0]])
# Every point the in-place steps touch or read: the norm's output, the MLP's product, the sublayer outputs and the
# residual stream on both sides of the adds.
WATCHED = ("ln1.hook_normalized", "ln2.hook_normalized", "mlp.hook_post", "hook_attn_out", "hook_mlp_out",
           "hook_resid_pre", "hook_resid_mid", "hook_resid_post")


def _watched(name: str) -> bool:
    return name.endswith(WATCHED) or name == "ln_final.hook_normalized"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_cache_without_autograd_equal_the_autograd_path(variant):
    model = make_model(variant)
    with torch.enable_grad():
        logits_grad, cache_grad = model.run_with_cache(TOKENS, names_filter=_watched)
    assert logits_grad.requires_grad  # the reference really took the out-of-place path
    with torch.no_grad():
        logits, cache = model.run_with_cache(TOKENS, names_filter=_watched)
        plain = model(TOKENS)  # nothing observed: every in-place step taken
    assert torch.equal(logits, logits_grad.detach()) and torch.equal(plain, logits_grad.detach())
    assert set(cache.keys()) == set(cache_grad.keys()) and len(cache.keys()) > 0
    for name in cache_grad.keys():
        assert torch.equal(cache[name], cache_grad[name].detach()), name


def test_a_hook_edit_of_a_sublayer_output_is_added_once_and_its_tensor_left_as_returned():
    model = make_model("gqa_rotary_rms_swiglu")
    kept = {}

    def halve(out, hook):
        kept[hook.name] = out * 0.5
        return kept[hook.name]

    hooks = [("blocks.0.hook_mlp_out", halve), ("blocks.1.hook_attn_out", halve)]
    with torch.enable_grad():
        reference = model.run_with_hooks(TOKENS, fwd_hooks=hooks).detach()
    reference_kept = {name: t.detach().clone() for name, t in kept.items()}
    with torch.no_grad():
        edited = model.run_with_hooks(TOKENS, fwd_hooks=hooks)
    assert torch.equal(edited, reference)
    for name, tensor in kept.items():  # what a hook returned is not overwritten by the residual add
        assert torch.equal(tensor, reference_kept[name]), name


def test_rms_norm_without_autograd_is_the_formula_bit_for_bit_in_each_dtype():
    cfg = wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=8)
    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.bfloat16, torch.float32)):  # the last: a gain in another dtype promotes
        norm = RMSNorm(cfg, RuntimeOptions(dtype=w_dtype))
        with torch.no_grad():
            norm.w.copy_(torch.linspace(0.5, 2.0, 16))
        x = torch.randn(2, 3, 16).to(x_dtype)
        x_before = x.clone()
        xf = x.float()
        expected = norm.w * (xf / (xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt()).to(x_dtype)
        with torch.no_grad():
            out = norm(x)
        assert out.dtype == expected.dtype and torch.equal(out, expected.detach()), (x_dtype, w_dtype)
        assert torch.equal(x, x_before)  # the input is read, never written


def test_gated_mlp_without_autograd_is_silu_gate_times_linear_and_gradients_still_flow():
    cfg = wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=10, n_ctx=8, d_mlp=12, gated_mlp=True,
                         act_fn="silu")
    mlp = GatedMLP(cfg, RuntimeOptions())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 3, 8)
    gate, linear = x @ mlp.W_gate, x @ mlp.W_in
    expected = (torch.nn.functional.silu(gate) * linear) @ mlp.W_out
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected.detach(), rtol=1e-6, atol=1e-6)
    x.requires_grad_(True)
    mlp(x).sum().backward()  # the autograd path is the out-of-place one
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_torch_forward_hooks_on_the_sublayers_see_and_keep_their_outputs_unchanged():
    """A plain torch forward hook (baukit or nnsight style) on an attention or MLP module keeps or replaces
    its output; the residual add must then leave that tensor alone."""
    model = make_model("gqa_rotary_rms_swiglu")
    replacement = torch.full((*TOKENS.shape, model.cfg.d_model), 0.25)
    seen = {}

    def keep(module, args, out):
        seen[module] = out

    def replace(module, args, out):
        return replacement

    handles = [model.blocks[0].attn.register_forward_hook(keep), model.blocks[0].mlp.register_forward_hook(keep),
               model.blocks[1].mlp.register_forward_hook(replace)]
    try:
        with torch.enable_grad():
            reference = model(TOKENS).detach()
        reference_seen = {module: out.detach().clone() for module, out in seen.items()}
        with torch.no_grad():
            logits = model(TOKENS)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(logits, reference)
    for module, out in seen.items():
        assert torch.equal(out, reference_seen[module]), module
    assert torch.equal(replacement, torch.full_like(replacement, 0.25))
