"""SAEs spliced into a model (``workbench.sae.splicing``): every expected value is the model run with a
hand-written hook doing the SAE's arithmetic (written out here, not through ``wb.SAE``), or the plain forward."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import workbench as wb
from tests.unit.helpers import make_model
from workbench.generation import KVCache

D_SAE = 24


def random_sae(architecture: str, hook_name: str, d_in: int, seed: int = 0, **cfg) -> wb.SAE:
    """An SAE of random weights whose features are about half on."""
    generator = torch.Generator().manual_seed(seed)
    config = wb.SAEConfig(architecture, d_in=d_in, d_sae=D_SAE, metadata={"hook_name": hook_name, **cfg.pop("meta", {})},
                          **cfg)
    shapes = wb.sae.ARCHITECTURES[architecture].weight_shapes(d_in, D_SAE, config.d_out)
    tensors = {name: torch.randn(shape, generator=generator) * (0.3 if name.startswith("W_") else 0.05)
               for name, shape in shapes.items()}
    if "threshold" in tensors:
        tensors["threshold"] = tensors["threshold"].abs()
    return wb.SAE.from_tensors(config, tensors)


def by_hand(sae: wb.SAE, x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) of a standard / JumpReLU SAE or transcoder, written out."""
    w = {name: p.detach() for name, p in sae.named_parameters()}
    centred = x - w["b_dec"] if sae.cfg.apply_b_dec_to_input else x
    pre = centred @ w["W_enc"] + w["b_enc"]
    acts = torch.relu(pre) * (pre > w["threshold"]) if "threshold" in w else torch.relu(pre)
    out = acts @ w["W_dec"] + w["b_dec"]
    return out + x @ w["W_skip"].T if "W_skip" in w else out


def features_by_hand(sae: wb.SAE, x: torch.Tensor) -> torch.Tensor:
    w = {name: p.detach() for name, p in sae.named_parameters()}
    return torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])


@pytest.fixture(scope="module")
def model():
    return make_model("mha_learned_ln")


@pytest.fixture(scope="module")
def tokens(model):
    return torch.randint(0, model.cfg.d_vocab, (2, 10), generator=torch.Generator().manual_seed(3))


def test_with_the_error_term_the_output_is_unchanged_and_the_hooks_fire(model, tokens):
    sae = random_sae("standard", "blocks.1.hook_resid_pre", 32)
    with torch.no_grad():
        clean = model(tokens)
        spliced, cache = model.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True)
    torch.testing.assert_close(spliced, clean, atol=1e-5, rtol=0)
    with torch.no_grad():  # nothing edits the features: the activation passes on exactly
        assert torch.equal(model.run_with_saes(tokens, saes=[sae], use_error_term=True), clean)
    for name in ("input", "acts_pre", "acts_post", "recons", "error", "output"):
        assert f"blocks.1.hook_resid_pre.hook_sae_{name}" in cache
    assert model.attached_hooks() == {} and model.acts_to_saes == {}
    assert "blocks.1.hook_resid_pre.hook_sae_acts_post" not in model.hook_dict


@pytest.mark.parametrize("architecture", ["standard", "jumprelu"])
def test_without_the_error_term_logits_equal_a_hand_written_substitution(model, tokens, architecture):
    sae = random_sae(architecture, "blocks.0.hook_resid_post", 32)
    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post",
                                                             lambda x, hook: by_hand(sae, x))])
        spliced = model.run_with_saes(tokens, saes=[sae])
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(spliced, model(tokens), atol=1e-3)


def test_cached_features_equal_encode_of_the_cached_activation(model, tokens):
    sae = random_sae("standard", "blocks.1.hook_resid_mid", 32)
    with torch.no_grad():
        _, plain = model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_mid")
        _, cache = model.run_with_cache_with_saes(tokens, saes=sae, use_error_term=True)
    acts = cache["blocks.1.hook_resid_mid.hook_sae_acts_post"]
    torch.testing.assert_close(acts, features_by_hand(sae, plain["blocks.1.hook_resid_mid"]), atol=1e-5, rtol=0)
    torch.testing.assert_close(acts, sae.encode(plain["blocks.1.hook_resid_mid"]).detach(), atol=1e-5, rtol=0)
    assert (acts > 0).any() and (acts == 0).any()


def test_the_error_term_passes_gradients_through_the_sae_as_saelens(model, tokens):
    """SAELens computes the error term without gradient: the output's gradient reaches the SAE's weights, so
    dL/dW_dec = features^T (dL/d output) summed over tokens."""
    sae = random_sae("standard", "blocks.0.hook_resid_post", 32)
    seen = {}
    _, cache = model.run_with_cache_with_saes(tokens, saes=[sae], use_error_term=True,
                                              names_filter="blocks.0.hook_resid_post.hook_sae_acts_post")
    with model.saes(saes=[sae], use_error_term=True):
        logits = model.run_with_hooks(tokens, bwd_hooks=[
            ("blocks.0.hook_resid_post", lambda grad, hook: seen.update(grad=grad.detach()))])
    logits[:, -1].sum().backward()
    features = cache["blocks.0.hook_resid_post.hook_sae_acts_post"]
    expected = torch.einsum("bpf,bpd->fd", features, seen["grad"])
    torch.testing.assert_close(sae.W_dec.grad, expected, atol=1e-5, rtol=1e-4)
    assert expected.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_editing_a_feature_moves_the_output_by_its_decoded_change(model, tokens):
    sae, feature = random_sae("standard", "blocks.0.hook_resid_post", 32), 5

    def zero_feature(acts, hook):
        acts[..., feature] = 0
        return acts

    with torch.no_grad():
        edited = model.run_with_hooks_with_saes(tokens, saes=[sae], use_error_term=True, fwd_hooks=[
            ("blocks.0.hook_resid_post.hook_sae_acts_post", zero_feature)])
        # By hand: the activation minus that feature's decoded contribution, on the plain model.
        w_dec = sae.W_dec.detach()[feature]
        expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x - (
            features_by_hand(sae, x)[..., feature:feature + 1] * w_dec))])
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(edited, model(tokens), atol=1e-4)


@pytest.mark.parametrize("architecture", ["transcoder", "skip_transcoder", "jumprelu_skip_transcoder"])
def test_a_transcoder_reads_one_hook_writes_another_and_keeps_its_skip_term(model, tokens, architecture):
    sae = random_sae(architecture, "blocks.0.ln2.hook_normalized", 32, d_out=32, apply_b_dec_to_input=False,
                     meta={"hook_name_out": "blocks.0.hook_mlp_out"})
    kept = {}
    hand = [("blocks.0.ln2.hook_normalized", lambda x, hook: kept.update(x=x)),
            ("blocks.0.hook_mlp_out", lambda out, hook: by_hand(sae, kept["x"]))]
    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=hand)
        spliced, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
        unchanged = model.run_with_saes(tokens, saes=[sae], use_error_term=True)
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(unchanged, model(tokens), atol=1e-5, rtol=0)
    assert "blocks.0.hook_mlp_out.hook_sae_acts_post" in cache  # keyed where it writes, as SAELens
    assert model.attached_hooks() == {}


def test_a_hook_z_sae_reads_the_heads_flattened(model, tokens):
    sae = random_sae("standard", "blocks.1.attn.hook_z", 32, reshape_activations="hook_z")

    def hand(z, hook):
        return by_hand(sae, z.flatten(-2)).unflatten(-1, z.shape[-2:])

    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", hand)])
        spliced = model.run_with_saes(tokens, saes=[sae])
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)


def test_several_saes_at_once(model, tokens):
    first = random_sae("standard", "blocks.0.hook_resid_pre", 32, seed=1)
    second = random_sae("jumprelu", "blocks.1.hook_attn_out", 32, seed=2)
    hand = [("blocks.0.hook_resid_pre", lambda x, hook: by_hand(first, x)),
            ("blocks.1.hook_attn_out", lambda x, hook: by_hand(second, x))]
    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=hand)
        spliced = model.run_with_saes(tokens, saes=[first, second])
        unchanged = model.run_with_saes(tokens, saes=[first, second], use_error_term=True)
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(unchanged, model(tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa", "flash"])
def test_every_kernel_and_padded_batches(attn_impl, tokens):
    model = make_model("gqa_rotary_rms_swiglu", attn_impl=attn_impl)
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding in the first row
    sae = random_sae("standard", "blocks.1.hook_resid_pre", 32)
    with torch.no_grad():
        clean = model(tokens, attention_mask=mask)
        unchanged = model.run_with_saes(tokens, saes=[sae], use_error_term=True, attention_mask=mask)
        expected = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[
            ("blocks.1.hook_resid_pre", lambda x, hook: by_hand(sae, x))])
        spliced = model.run_with_saes(tokens, saes=[sae], attention_mask=mask)
    torch.testing.assert_close(unchanged, clean, atol=1e-5, rtol=0)
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)


def test_the_kv_cache_and_generate(model, tokens):
    sae = random_sae("standard", "blocks.0.hook_resid_post", 32)
    with torch.no_grad(), model.saes(saes=[sae]):
        whole = model(tokens)
        kv_cache = KVCache(model.cfg.n_layers)
        model(tokens[:, :6], kv_cache=kv_cache)
        rest = model(tokens[:, 6:], kv_cache=kv_cache)
        generated = model.generate(tokens, max_new_tokens=4)
    torch.testing.assert_close(rest, whole[:, 6:], atol=1e-5, rtol=0)
    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: by_hand(sae, x))]):
        by_hook = model.generate(tokens, max_new_tokens=4)
    assert torch.equal(generated, by_hook) and model.attached_hooks() == {}


def test_add_sae_stays_until_reset_saes_and_a_block_restores_what_it_replaced(model, tokens):
    first = random_sae("standard", "blocks.0.hook_resid_post", 32, seed=1)
    second = random_sae("standard", "blocks.0.hook_resid_post", 32, seed=2)
    with torch.no_grad():
        with_first = model.run_with_saes(tokens, saes=[first])
        model.add_sae(first)
        try:
            assert model.acts_to_saes == {"blocks.0.hook_resid_post": first}
            model.reset_hooks()  # TransformerLens's reset leaves SAEs, as SAELens's does
            torch.testing.assert_close(model(tokens), with_first, atol=0, rtol=0)
            with model.saes(saes=[second]):
                assert model.acts_to_saes == {"blocks.0.hook_resid_post": second}
            assert model.acts_to_saes == {"blocks.0.hook_resid_post": first}
            model.add_hook("blocks.0.hook_resid_post.hook_sae_acts_post", lambda acts, hook: acts * 0)
            assert model.attached_hooks() == {"blocks.0.hook_resid_post": 1,
                                              "blocks.0.hook_resid_post.hook_sae_acts_post": 1}
        finally:
            model.reset_saes()
    assert model.attached_hooks() == {} and model.acts_to_saes == {} and not first.hook_sae_acts_post.fwd_hooks
    assert first.hook_sae_acts_post.name == "hook_sae_acts_post"


def test_bad_saes_are_errors_naming_both_and_leave_nothing_attached(model, tokens):
    good = random_sae("standard", "blocks.0.hook_resid_pre", 32)
    wide = random_sae("standard", "blocks.1.hook_resid_pre", 48)
    with pytest.raises(wb.InputError, match=r"d_in=48, but this model's hook 'blocks.1.hook_resid_pre' carries \(32,\)"):
        model.run_with_saes(tokens, saes=[good, wide])
    nowhere = random_sae("standard", "blocks.7.hook_resid_pre", 32)
    with pytest.raises(wb.InputError, match="reads hook 'blocks.7.hook_resid_pre', which this model does not have"):
        model.add_sae(nowhere)
    z = random_sae("standard", "blocks.0.attn.hook_z", 16, reshape_activations="hook_z")
    with pytest.raises(wb.InputError, match=r"d_in=16.*carries \(4, 8\).*heads x d_head flattened"):
        model.run_with_cache_with_saes(tokens, saes=[z])
    with pytest.raises(wb.InputError, match="must be wb.SAE objects"):
        model.run_with_saes(tokens, saes=["blocks.0.hook_resid_pre"])
    with pytest.raises(wb.InputError, match="no SAE is spliced at 'blocks.0.hook_resid_pre'"):
        model.reset_saes("blocks.0.hook_resid_pre")

    def broken(acts, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks_with_saes(tokens, saes=[good], fwd_hooks=[
            ("blocks.0.hook_resid_pre.hook_sae_acts_post", broken)])
    assert model.attached_hooks() == {} and model.acts_to_saes == {}
    assert not any(".hook_sae_" in name for name in model.hook_dict)


def test_threads_sharing_a_model_never_see_each_others_saes():
    model = make_model("mha_learned_ln")
    prompts = [torch.randint(0, model.cfg.d_vocab, (1, 8), generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    saes = [random_sae("standard", f"blocks.{i % 2}.hook_resid_post", 32, seed=i) for i in range(3)]

    def run(call):
        kind, i = call
        with torch.no_grad():
            return call, model.run_with_saes(prompts[i], saes=[saes[i]]) if kind == "sae" else model(prompts[i])

    calls = [(kind, i) for kind in ("sae", "plain") for i in range(3)]
    with ThreadPoolExecutor(1) as pool:
        alone = dict(pool.map(run, calls))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, calls * 10))
    assert all(torch.equal(result, alone[call]) for call, result in results)
    assert model.attached_hooks() == {}


def test_an_sae_of_one_head_replaces_that_head_only(model, tokens):
    sae = random_sae("standard", "blocks.0.attn.hook_z", 8, meta={"hook_head_index": 2})

    def hand(z, hook):
        z = z.clone()
        z[:, :, 2] = by_hand(sae, z[:, :, 2])
        return z

    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", hand)])
        spliced = model.run_with_saes(tokens, saes=[sae])
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)
    flattened = random_sae("standard", "blocks.0.attn.hook_z", 8, reshape_activations="hook_z",
                           meta={"hook_head_index": 2})
    with pytest.raises(wb.InputError, match="hook_head_index=2 cannot be honoured"):
        model.add_sae(flattened)
    assert model.attached_hooks() == {}


def test_an_sae_of_another_dtype_writes_the_models_dtype(model, tokens):
    sae = random_sae("standard", "blocks.1.hook_resid_pre", 32)
    double = wb.SAE.from_tensors(sae.cfg, dict(sae.named_parameters()), dtype=torch.float64)
    with torch.no_grad():
        spliced = model.run_with_saes(tokens, saes=[double])
        expected = model.run_with_hooks(tokens, fwd_hooks=[
            ("blocks.1.hook_resid_pre", lambda x, hook: by_hand(double, x.double()).float())])
    assert spliced.dtype == torch.float32 and double.W_enc.dtype == torch.float64
    torch.testing.assert_close(spliced, expected, atol=1e-5, rtol=0)
