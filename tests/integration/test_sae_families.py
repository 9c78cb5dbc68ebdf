"""SAEs splice into every kind of block the decoder builds (each variant of ``tests.unit.helpers``) and into a
real model with its tokenizer (the zoo's ``toy-attn-2l``): text in, text out, ``generate`` included."""

import pytest
import torch

import workbench as wb
from tests.unit.helpers import VARIANTS, make_model
from tests.unit.test_sae_splicing import by_hand, random_sae


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_block_kind(variant):
    model = make_model(variant)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    resid = random_sae("standard", "blocks.1.hook_resid_post", model.cfg.d_model, seed=1)
    heads = random_sae("jumprelu", "blocks.0.attn.hook_z", model.cfg.n_heads * model.cfg.d_head, seed=2,
                       reshape_activations="hook_z")
    hand = [("blocks.1.hook_resid_post", lambda x, hook: by_hand(resid, x)),
            ("blocks.0.attn.hook_z", lambda z, hook: by_hand(heads, z.flatten(-2)).unflatten(-1, z.shape[-2:]))]
    with torch.no_grad():
        clean = model(tokens)
        assert torch.equal(model.run_with_saes(tokens, saes=[resid, heads], use_error_term=True), clean)
        torch.testing.assert_close(model.run_with_saes(tokens, saes=[resid, heads]),
                                   model.run_with_hooks(tokens, fwd_hooks=hand), atol=1e-5, rtol=0)
    assert model.attached_hooks() == {}


def test_a_real_model_with_text_and_generate(tmp_path):
    model = wb.load_model("toy-attn-2l", progress=False).eval()
    sae = random_sae("topk", "blocks.1.hook_resid_pre", model.cfg.d_model, k=8)
    loaded = wb.load_sae(sae.save(tmp_path / "sae"))
    prompts = ["def main(", "import os\nimport sys\n"]
    with torch.no_grad():
        clean = model(prompts)
        unchanged = model.run_with_saes(prompts, saes=[loaded], use_error_term=True)
        _, cache = model.run_with_cache_with_saes(prompts, saes=[loaded])
        with model.saes(saes=[loaded]):
            text = model.generate("def main(", max_new_tokens=5)
        # The splice's wiring against a plain hook doing the same (the SAE's arithmetic is SAELens-checked).
        with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: loaded.reconstruct(x).detach())]):
            by_hook = model.generate("def main(", max_new_tokens=5)
    assert torch.equal(unchanged, clean)
    features = cache["blocks.1.hook_resid_pre.hook_sae_acts_post"]
    assert features.shape[-1] == sae.cfg.d_sae and int((features != 0).sum(-1).max()) <= 8
    assert text == by_hook and text.startswith("def main(")
    assert model.attached_hooks() == {}
