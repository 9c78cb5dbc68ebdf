"""Hook plumbing (TransformerLens's own), TL utilities on our model, and bad input."""

import pytest
import tokenizers
import torch
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformer_lens import ActivationCache
from transformer_lens.head_detector import detect_head
from transformer_lens.model_protocol import TransformerLensModel

from tests.unit.helpers import make_model
from workbench.errors import InputError
from workbench.tokenizer import SpecialTokens, Tokenizer

WORDS = ["<bos>", "<eos>"] + [f"w{i}" for i in range(59)]


def word_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, SpecialTokens(bos_token="<bos>", eos_token="<eos>", prepend_bos=True))


def no_live_hooks(model) -> bool:
    return all(not hp._forward_hooks and not hp._backward_hooks and not hp.fwd_hooks and not hp.bwd_hooks
               and hp.cache_into is None for hp in model.hook_dict.values())


def test_run_with_cache_returns_activation_cache_and_filters():
    model = make_model("gqa_rotary_rms_swiglu")
    _, cache = model.run_with_cache(torch.randint(0, 61, (1, 5)), names_filter=lambda n: n.endswith("hook_z"))
    assert isinstance(cache, ActivationCache)
    assert sorted(cache.keys()) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    assert cache["z", 1].shape == (1, 5, 4, 8)
    assert no_live_hooks(model)


def test_forward_hook_edits_and_backward_hook_sees_gradients():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (1, 6))
    zeroed = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda t, hook: t * 0)])
    _, cache = model.run_with_cache(tokens, names_filter=["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid"])
    assert not torch.allclose(zeroed, model(tokens))
    torch.testing.assert_close(cache["blocks.0.hook_resid_mid"] - cache["blocks.0.hook_resid_pre"],
                               model.run_with_cache(tokens, names_filter="blocks.0.hook_attn_out")[1]["attn_out", 0])
    grads = {}
    model.add_hook("blocks.1.hook_resid_pre", lambda g, hook: grads.setdefault("g", g.clone()), dir="bwd")
    model(tokens, return_type="loss").backward()
    model.reset_hooks()
    assert grads["g"].shape == (1, 6, 32) and grads["g"].abs().sum() > 0
    assert no_live_hooks(model)


def test_hook_that_raises_names_its_hook_point_and_leaves_nothing_attached():
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="flash")

    def broken(tensor, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        model.run_with_hooks(torch.randint(0, 61, (1, 4)), fwd_hooks=[("blocks.1.attn.hook_pattern", broken)])
    assert any("blocks.1.attn.hook_pattern" in note for note in info.value.__notes__)
    assert no_live_hooks(model)
    with pytest.raises(RuntimeError):  # hooks added by a name filter are removed too
        model.run_with_hooks(torch.randint(0, 61, (1, 4)), fwd_hooks=[(lambda n: n.endswith("hook_q"), broken)])
    assert no_live_hooks(model)


def test_model_satisfies_transformer_lens_protocol_and_detect_head_runs():
    model = make_model("gqa_rotary_rms_swiglu", attn_impl="flash")
    model.tokenizer = word_tokenizer()
    assert isinstance(model, TransformerLensModel)
    text = " ".join(f"w{i}" for i in range(1, 12))
    scores = detect_head(model, text, "previous_token_head")
    # detect_head's own "mul" metric, recomputed here from our cached patterns by hand
    tokens = model.to_tokens(text)
    _, cache = model.run_with_cache(tokens)
    for layer in range(2):
        pattern = cache["pattern", layer][0]
        prev = torch.zeros(tokens.shape[1], tokens.shape[1])
        prev[torch.arange(1, tokens.shape[1]), torch.arange(tokens.shape[1] - 1)] = 1
        expected = (pattern * prev).sum((-1, -2)) / pattern.sum((-1, -2))
        torch.testing.assert_close(scores[layer], expected, atol=1e-5, rtol=0)


def test_tokenizer_conveniences_and_bos():
    model = make_model("gqa_rotary_rms_swiglu")
    model.tokenizer = word_tokenizer()
    tokens = model.to_tokens("w3 w4")
    assert tokens.tolist() == [[0, 5, 6]]
    assert model.to_str_tokens("w3 w4") == ["<bos>", "w3", "w4"]
    assert model.to_string(tokens[0, 1:]) == "w3 w4"
    assert model.to_single_token("w7") == 9
    assert model("w1 w2 w3").shape == (1, 4, 61)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[1, 2, 61]]), "token id 61 is out of range"),
    (torch.tensor([[1, -1, 2]]), "token id -1 is out of range"),
    (torch.zeros(1, 65, dtype=torch.long), "longer than the model's context"),
    (torch.zeros(1, 0, dtype=torch.long), "empty input"),
    (torch.tensor([[1.0, 2.0]]), "integer tensor"),
    (torch.zeros(1, 2, 3, dtype=torch.long), r"\[batch, pos\]"),
])
def test_bad_tokens_are_named(bad, message):
    model = make_model("gqa_rotary_rms_swiglu")
    with pytest.raises(InputError, match=message):
        model(bad)


def test_text_without_tokenizer_and_empty_text():
    model = make_model("gqa_rotary_rms_swiglu")
    with pytest.raises(InputError, match="no tokenizer"):
        model("hello")
    model.tokenizer = word_tokenizer()
    with pytest.raises(InputError, match="empty"):
        model.tokenizer.to_tokens("", prepend_bos=False)
    # a batch gives one list per row, as TransformerLens (id 0 is WORDS[0], "<bos>")
    assert model.to_str_tokens(torch.zeros(2, 3, dtype=torch.long)) == [["<bos>"] * 3] * 2


def test_return_types():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (2, 7))
    logits, loss = model(tokens, return_type="both")
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert model(tokens, return_type="loss", loss_per_token=True).shape == (2, 6)
    assert model(tokens, return_type=None) is None
    with pytest.raises(InputError, match="return_type"):
        model(tokens, return_type="probs")


def test_start_and_stop_at_layer_compose_to_full_forward():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (2, 7))
    resid = model(tokens, stop_at_layer=1)
    torch.testing.assert_close(model(resid, start_at_layer=1), model(tokens))
    torch.testing.assert_close(model(resid, start_at_layer=1, tokens=tokens, return_type="loss"),
                               model(tokens, return_type="loss"))


def test_attached_hooks_counts_what_is_on_and_nothing_after_a_raising_hook():
    model = make_model("mha_learned_ln")
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 4))
    assert model.attached_hooks() == {}
    model.add_hook("blocks.0.hook_resid_pre", lambda x, hook: x)
    model.add_hook("blocks.0.hook_resid_pre", lambda x, hook: x)
    model.add_hook("blocks.1.attn.hook_z", lambda x, hook: x, dir="bwd")
    assert model.attached_hooks() == {"blocks.0.hook_resid_pre": 2, "blocks.1.attn.hook_z": 1}
    model.reset_hooks()

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_post", boom)])
    assert model.attached_hooks() == {}


def transformer_lens_cache(model, tokens, names_filter=None) -> dict:
    """TransformerLens's own run_with_cache (its caching hooks) on our model: the reference for the plain path."""
    from transformer_lens import HookedRootModule

    if names_filter is None:  # TransformerLens's "every hook that fires": hook_result and hook_mlp_in are opt-in
        names_filter = lambda name: not name.endswith(("attn.hook_result", "hook_mlp_in"))
    return HookedRootModule.run_with_cache(model, tokens, names_filter=names_filter)[1]


@pytest.mark.parametrize("names_filter", [None, "blocks.1.attn.hook_pattern",
                                          ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"],
                                          lambda name: name.endswith(("hook_z", "hook_scale"))])
def test_plain_cache_path_caches_what_transformer_lens_caches(names_filter):
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (2, 6))
    expected = transformer_lens_cache(model, tokens, names_filter)
    logits, cache = model.run_with_cache(tokens, names_filter=names_filter)
    assert list(cache.keys()) == list(expected)  # the same hooks, in the order they fire
    for name, tensor in expected.items():
        torch.testing.assert_close(cache[name], tensor, rtol=0, atol=0)
    torch.testing.assert_close(logits, model(tokens))
    assert no_live_hooks(model)


def test_plain_cache_path_sees_attached_hooks_edits_and_detaches():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (1, 5))
    zero = lambda t, hook: torch.zeros_like(t)
    with model.hooks(fwd_hooks=[("blocks.0.hook_attn_out", zero)]):
        expected = transformer_lens_cache(model, tokens)
        _, cache = model.run_with_cache(tokens)
        assert model.attached_hooks() == {"blocks.0.hook_attn_out": 1}  # the user's hook survives the cache's
    assert not cache["blocks.0.hook_attn_out"].any()
    for name, tensor in expected.items():
        torch.testing.assert_close(cache[name], tensor, rtol=0, atol=0)
    _, cache = model.run_with_cache(tokens)  # with grad on: stored detached, as TransformerLens does
    assert not any(t.requires_grad for t in cache.values())
    assert no_live_hooks(model)


def test_plain_cache_path_leaves_no_hook_when_the_forward_raises():
    model = make_model("gqa_rotary_rms_swiglu")
    with pytest.raises(InputError):
        model.run_with_cache(torch.tensor([[1, 2, 999]]))
    assert no_live_hooks(model)
    with pytest.raises(InputError, match="names_filter"):
        model.run_with_cache(torch.tensor([[1, 2]]), names_filter=3)


def test_plain_cache_path_inside_a_hook_of_another_keeps_the_outer_cache():
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (1, 5))
    inner, calls = {}, []

    def cache_again(resid, hook):  # a hook that runs a cached forward of its own (which calls it once more)
        calls.append(1)
        if len(calls) == 1:
            inner.update(model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")[1])

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", cache_again)]):
        _, outer = model.run_with_cache(tokens)
    assert list(inner) == ["blocks.1.hook_resid_post"]
    expected = transformer_lens_cache(model, tokens)
    assert sorted(outer) == sorted(expected)  # every point, the later ones included
    for name, tensor in expected.items():
        torch.testing.assert_close(outer[name], tensor, rtol=0, atol=0)
    assert no_live_hooks(model)


def test_hook_points_reach_torch_global_module_hooks_and_pass_input_on_unchanged():
    # A point with nothing attached skips torch's module call; one on every module (torch's global hooks,
    # as a profiler or a tracer registers them) must still see every point, and its return value count.
    model = make_model("gqa_rotary_rms_swiglu")
    tokens = torch.randint(0, 61, (1, 5))
    clean = model(tokens)
    point = model.hook_dict["blocks.0.hook_resid_post"]
    x = torch.randn(2)
    assert point(x) is x  # nothing attached: the input itself, as torch's call of the identity forward gives
    seen = []

    def every_module(module, inputs, output):
        if module is point:
            return torch.zeros_like(output)
        seen.append(module)

    handle = torch.nn.modules.module.register_module_forward_hook(every_module)
    try:
        edited = model(tokens)
    finally:
        handle.remove()
    # The points a plain forward passes: all but those only computed when asked for (patterns force eager).
    passed = lambda name: not name.endswith(("hook_attn_scores", "hook_pattern", "hook_result"))
    called = {model.hook_dict[name] for name in model.run_with_cache(tokens, names_filter=passed)[1]}
    assert called - {point} <= set(seen)
    zeroed_resid = torch.zeros(1, 5, model.cfg.d_model)
    expected = model(zeroed_resid, start_at_layer=1)  # layer 1 onwards from a zeroed residual stream
    torch.testing.assert_close(edited, expected)
    assert not torch.allclose(edited, clean)


@pytest.mark.parametrize("direction", ["fwd", "bwd", "both"])
@pytest.mark.parametrize("including_permanent", [False, True])
@pytest.mark.parametrize("level", [None, 1])
def test_removing_hooks_leaves_what_transformer_lens_leaves(direction, including_permanent, level):
    # Ours visits only the points holding a hook; TransformerLens's own method visits all. Both must leave the
    # same hooks, whatever mix of directions, permanence and context levels is attached.
    from transformer_lens import HookedRootModule

    model = make_model("gqa_rotary_rms_swiglu")
    keep = lambda x, hook: x  # noqa: E731

    def attach_and_remove(remove) -> dict[str, int]:
        model.add_hook("blocks.0.hook_resid_pre", keep)
        model.add_hook("blocks.0.hook_resid_pre", keep, is_permanent=True)
        model.add_hook("blocks.1.attn.hook_z", keep, dir="bwd")
        model.add_hook("blocks.1.hook_mlp_out", keep, level=1)
        model.hook_dict["blocks.1.hook_mlp_out"].ctx["note"] = 1
        remove(direction, including_permanent, level)
        left = model.attached_hooks()
        model.reset_hooks(including_permanent=True)
        assert model.attached_hooks() == {} and model.hook_dict["blocks.1.hook_mlp_out"].ctx == {}
        return left

    ours = attach_and_remove(model.remove_all_hook_fns)
    theirs = attach_and_remove(lambda *args: HookedRootModule.remove_all_hook_fns(model, *args))
    assert ours == theirs
