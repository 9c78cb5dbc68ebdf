"""A device map across the GPU and the CPU (skipped without CUDA).

SmolLM2-135M with its first 15 blocks, the embedding and the unembedding tied to it on the GPU, and the last 15
blocks and the final norm on the CPU, against the model whole on the CPU: logits and every cached activation
agree, each hook receives its block's activation on that block's device, and patterns are hooked under flash
attention on the GPU blocks.
Run in its own pytest process (``pytest tests/gpu``), as the kernel tests beside it.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

import workbench as wb  # noqa: E402

SPLIT = 15
TOL = 1e-4  # the GPU's float32 matmuls (TF32 off) against the CPU's


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    # SmolLM2 ties its unembedding to the embedding: one tensor, on one device (a split is refused). The
    # residual goes GPU -> CPU after block 14 and back to the GPU for the unembedding.
    device_map = {"embed": 0, **{f"blocks.{layer}": 0 for layer in range(SPLIT)}, "blocks": "cpu",
                  "ln_final": "cpu", "unembed": 0}
    split = wb.load_model("smollm2-135m", attn_impl="flash", device_map=device_map, progress=False)
    whole = wb.load_model("smollm2-135m", attn_impl="eager", progress=False)
    return split, whole


def test_blocks_are_where_the_map_says(models):
    split, _ = models
    assert split.device_map["blocks.0"] == "cuda:0" and split.device_map[f"blocks.{SPLIT}"] == "cpu"
    assert split.blocks[0].attn.W_Q.device.type == "cuda" and split.blocks[SPLIT].attn.W_Q.device.type == "cpu"
    assert split.device_map["unembed"] == "cuda:0" and split.unembed.W_U.device.type == "cuda"


def test_logits_and_cache_equal_the_cpu_model_and_hooks_see_their_block_device(models):
    split, whole = models
    tokens = whole.to_tokens("When Mary and John went to the store, John gave a drink to")
    expected_logits, expected = whole.run_with_cache(tokens)
    devices = {}

    def where(activation, hook):
        devices[hook.name] = activation.device.type

    split.run_with_hooks(tokens, fwd_hooks=[(lambda name: name.endswith("hook_pattern"), where)])
    assert all(devices[f"blocks.{layer}.attn.hook_pattern"] == ("cuda" if layer < SPLIT else "cpu")
               for layer in range(30))
    logits, cache = split.run_with_cache(tokens, device="cpu")
    # The unembedding runs on the GPU here: SmolLM2's logits reach tens, and the GPU's float32 sum over d_model
    # in another order moves them by up to ~1e-5 of their size (1.2e-4 seen on an H200).
    torch.testing.assert_close(logits.cpu(), expected_logits, atol=TOL, rtol=1e-5)
    for layer in (0, SPLIT - 1, SPLIT, 29):  # patterns hooked under flash on the GPU blocks, eager reference
        name = f"blocks.{layer}.attn.hook_pattern"
        torch.testing.assert_close(cache[name], expected[name], atol=TOL, rtol=0, msg=name)
    assert split.attached_hooks() == {}


def test_generation_equals_the_cpu_model(models):
    split, whole = models
    tokens = whole.to_tokens("The capital of France is")
    assert torch.equal(split.generate(tokens, max_new_tokens=10, verbose=False).cpu(),
                       whole.generate(tokens, max_new_tokens=10, verbose=False))
