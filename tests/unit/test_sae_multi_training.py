"""Several SAEs trained from one forward pass per batch (``experiments.sae.multi``): each equals the SAE
``train_sae`` trains alone on the same data, seed and settings; transcoder sets; resume; bad specs."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from experiments.sae import train_sae, train_saes, train_transcoders
from experiments.sae.multi import SAESpec
from workbench.errors import InputError

FAST = dict(progress=False, training_tokens=1536, train_batch_size_tokens=128, buffer_tokens=512, log_every=2,
            store_batch_size_prompts=4, seed=3)
SAE_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec")


def _mlp_model(seed: int = 0) -> wb.Decoder:
    torch.manual_seed(seed)
    return wb.Decoder(wb.ModelConfig(n_layers=2, d_model=16, n_heads=2, d_vocab=64, n_ctx=32)).eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 64, (24, 16), generator=torch.Generator().manual_seed(seed))


def _assert_same(a: wb.SAE, b: wb.SAE) -> None:
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name  # the same float operations in the same order
    assert a.cfg.to_dict() == b.cfg.to_dict()


SPECS = [
    SAESpec("blocks.0.hook_resid_post", "topk", d_sae=48, k=4),
    SAESpec("blocks.1.hook_resid_post", "jumprelu", d_sae=32, config={"lr": 1e-3, "l0_warm_up_steps": 5}),
    SAESpec("blocks.0.ln2.hook_normalized", "standard", d_sae=24, hook_name_out="blocks.0.hook_mlp_out", skip=True,
            config={"l1_warm_up_steps": 4, "b_dec_init": "geometric_median"}),
]


def _alone(model, tokens, spec: SAESpec, **kwargs) -> wb.SAE:
    return train_sae(model, spec.hook_name, tokens, spec.architecture, spec.d_sae, spec.k,
                     hook_name_out=spec.hook_name_out, skip=spec.skip, **{**FAST, **dict(spec.config), **kwargs})


def test_saes_trained_together_equal_each_trained_alone(tmp_path):
    model, tokens = _mlp_model(), _tokens()
    together = train_saes(model, SPECS, tokens, out=tmp_path, **FAST)
    for spec, sae in zip(SPECS, together):
        alone = _alone(model, tokens, spec)
        _assert_same(sae, alone)
        assert sae.training_log.equals(alone.training_log)
        saved = wb.load_sae(tmp_path / spec.label)
        assert (saved.cfg.architecture(), saved.cfg.hook_name, saved.cfg.d_sae) == \
            (sae.cfg.architecture(), spec.hook_name, spec.d_sae)
        for name in SAE_TENSORS:
            assert torch.equal(getattr(saved, name), getattr(sae, name)), name
        assert (tmp_path / spec.label / "training_log.csv").is_file()


def test_batch_topk_together_equals_alone():
    model, tokens = _mlp_model(), _tokens()
    specs = [SAESpec("blocks.0.hook_resid_post", "batchtopk", d_sae=40, k=3),
             SAESpec("blocks.0.hook_resid_post", "topk", d_sae=40, k=3)]
    together = train_saes(model, specs, tokens, **FAST)
    _assert_same(together[0], _alone(model, tokens, specs[0]))


def test_transcoders_trained_together_load_back_equal(tmp_path):
    model, tokens = _mlp_model(), _tokens()
    tc = train_transcoders(model, tokens, d_transcoder=24, out=tmp_path / "tc", **FAST)
    assert (tc.n_layers, tc.d_transcoder, tc.cross_layer) == (2, 24, False)
    loaded = wb.load_transcoders(tmp_path / "tc")
    for layer in range(2):
        assert loaded.input_hook(layer) == f"blocks.{layer}.ln2.hook_normalized"
        assert loaded.output_hook(layer) == f"blocks.{layer}.hook_mlp_out"
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            assert torch.equal(getattr(loaded.layers[layer], name), getattr(tc.layers[layer], name)), (layer, name)
        alone = train_sae(model, f"blocks.{layer}.ln2.hook_normalized", tokens, "standard", 24, None,
                          hook_name_out=f"blocks.{layer}.hook_mlp_out", **FAST)
        for name in SAE_TENSORS:
            assert torch.equal(getattr(tc.layers[layer], name), getattr(alone, name)), (layer, name)


def test_resume_gives_the_uninterrupted_result(tmp_path):
    model, tokens = _mlp_model(), _tokens()
    whole = train_saes(model, SPECS, tokens, **FAST)
    train_saes(model, SPECS, tokens, checkpoint_dir=tmp_path / "ckpt", **{**FAST, "checkpoint_every": 6})
    resumed = train_saes(model, SPECS, tokens, resume_from=tmp_path / "ckpt" / "step-6", **FAST)
    for a, b in zip(whole, resumed):
        for name, tensor in a.state_dict().items():
            assert torch.equal(tensor, b.state_dict()[name]), name
        assert a.training_log.equals(b.training_log)


def test_a_checkpoint_of_other_specs_is_refused(tmp_path):
    model, tokens = _mlp_model(), _tokens()
    train_saes(model, SPECS[:2], tokens, checkpoint_dir=tmp_path, **{**FAST, "checkpoint_every": 2,
                                                                       "training_tokens": 512})
    with pytest.raises(wb.errors.CheckpointError, match="another run"):
        train_saes(model, SPECS[1:], tokens, resume_from=tmp_path / "step-2", **FAST)


def test_specs_by_name_as_saelens_saes_mapping(tmp_path):
    model, tokens = _mlp_model(), _tokens()
    saes = train_saes(model, {"early": {"hook_name": "blocks.0.hook_resid_post", "d_sae": 16, "k": 2},
                              "late": SAESpec("blocks.1.hook_resid_post", "standard", d_sae=8)}, tokens,
                      out=tmp_path, **{**FAST, "training_tokens": 256})
    assert [sae.cfg.hook_name for sae in saes] == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["early", "late"]


@pytest.mark.parametrize("specs, named", [
    ([SAESpec("blocks.0.hook_resid_post", d_sae=8, k=2), SAESpec("blocks.1.hook_resid_post", d_sae=8, k=2, name="a"),
      SAESpec("blocks.0.hook_resid_post", d_sae=8, k=2)], "distinct name"),
    ([SAESpec("blocks.0.hook_resid_post", d_sae=8, k=2), SAESpec("blocks.9.hook_resid_post", d_sae=8, k=2)],
     "not a hook point"),
    ([SAESpec("blocks.0.hook_resid_post", d_sae=8, k=9)], "k must be"),
    ([{"hook_name": "blocks.0.hook_resid_post", "width": 8}], "unknown field"),
    ([SAESpec("blocks.0.hook_resid_post", d_sae=8, k=2, config={"train_batch_size_tokens": 64})], "config may set"),
    ([SAESpec("blocks.0.hook_resid_post", d_sae=8, k=2, name="../up")], "folder name"),
    ([], "non-empty"),
])
def test_bad_specs_are_a_clear_error_leaving_nothing_written_or_attached(specs, named, tmp_path):
    model = _mlp_model()
    with pytest.raises(InputError, match=named):
        train_saes(model, specs, _tokens(), out=tmp_path / "out", **FAST)
    assert not (tmp_path / "out").exists()
    assert not any(point._forward_hooks for point in model.hook_dict.values())
