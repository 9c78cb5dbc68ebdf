"""TransformerLens's token helpers and hook habits on our model, with TransformerLens's semantics.

Expected values come from hand reasoning: a word-level tokenizer whose ids are known by
construction (``w<i>`` is id i + 2, ``<bos>`` 0, ``<eos>`` 1), the raw ``encode`` of a BPE, and
TransformerLens's documented behaviour (``prepend_bos`` defaults to True for a model with a BOS
token; ``to_str_tokens`` of a [1, pos] tensor is one list; ``to_string`` of one id is one string).
"""

from __future__ import annotations

import json
import re

import pytest
import tokenizers
import torch
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformer_lens.utilities import test_prompt as tl_test_prompt

import workbench as wb
from tests.unit.helpers import make_model
from workbench.bpe import train_bpe
from workbench.errors import InputError
from workbench.loading.gguf.tokenizer import tokenizer_from_gguf
from workbench.loading.hf.tokenizer import tokenizer_from_hf_directory
from workbench.tokenizer import SpecialTokens, Tokenizer

WORDS = ["<bos>", "<eos>"] + [f"w{i}" for i in range(59)]  # 61 ids: w<i> is i + 2
BOS, EOS = 0, 1


def w(i: int) -> int:
    return i + 2


def word_backend() -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<eos>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return backend


def word_model(bos: bool = True, checkpoint_prepends_bos: bool = False) -> wb.Decoder:
    """A 2-layer model with the word-level tokenizer; ``checkpoint_prepends_bos`` is the file's own convention."""
    specials = SpecialTokens(bos_token="<bos>" if bos else None, eos_token="<eos>", prepend_bos=checkpoint_prepends_bos)
    model = make_model("gqa_rotary_rms_swiglu")
    model.tokenizer = Tokenizer(word_backend(), specials)
    return model


def hooks_left(model: wb.Decoder) -> list[str]:
    return [name for name, hp in model.hook_dict.items()
            if hp._forward_hooks or hp._backward_hooks or hp.fwd_hooks or hp.bwd_hooks]


# ---- prepend_bos: TransformerLens's default ---------------------------------------------------------------
def test_prepend_bos_defaults_to_true_when_there_is_a_bos_even_if_the_checkpoint_does_not_prepend():
    model = word_model(bos=True, checkpoint_prepends_bos=False)  # GPT-2 / SmolLM2's case
    assert model.tokenizer.default_prepend_bos
    assert model.to_tokens("w3 w4").tolist() == [[BOS, w(3), w(4)]]
    assert model.to_tokens("w3 w4", prepend_bos=False).tolist() == [[w(3), w(4)]]
    assert model.tokenizer.encode("w3") == [BOS, w(3)]
    assert model.to_str_tokens("w3 w4") == ["<bos>", "w3", "w4"]
    assert model.to_str_tokens("w3 w4", prepend_bos=False) == ["w3", "w4"]


def test_prepend_bos_defaults_to_false_without_a_bos_and_true_is_refused():
    model = word_model(bos=False)
    assert not model.tokenizer.default_prepend_bos
    assert model.to_tokens("w3 w4").tolist() == [[w(3), w(4)]]
    with pytest.raises(InputError, match="no BOS"):
        model.to_tokens("w3", prepend_bos=True)


def test_text_given_to_forward_run_with_cache_and_generate_gets_the_bos():
    model = word_model(bos=True, checkpoint_prepends_bos=False)
    assert model("w1 w2").shape == (1, 3, 61)
    assert model("w1 w2", prepend_bos=False).shape == (1, 2, 61)
    _, cache = model.run_with_cache("w1 w2", names_filter="hook_embed")
    torch.testing.assert_close(cache["hook_embed"][0, 0], model.embed.W_E[BOS])
    _, cache = model.run_with_cache("w1 w2", names_filter="hook_embed", prepend_bos=False)
    torch.testing.assert_close(cache["hook_embed"][0, 0], model.embed.W_E[w(1)])
    lengths = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: lengths.append(x.shape[1]))]):
        model.generate("w1 w2", max_new_tokens=2)
    assert lengths[0] == 3  # the prompt's first forward: BOS, w1, w2


def test_loaded_tokenizers_record_the_checkpoint_convention_but_default_to_bos(tmp_path):
    backend = word_backend()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "add_bos_token": False}))
    hf = tokenizer_from_hf_directory(tmp_path, {})
    assert hf.specials.prepend_bos is False
    assert hf.encode("w5") == [BOS, w(5)] and hf.encode("w5", prepend_bos=False) == [w(5)]

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["<|endoftext|>", "a", "b", "Ġ", "ab", "Ġab"],
            "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.add_bos_token": False}
    gguf = tokenizer_from_gguf(lambda key, default: meta.get(key, default), "tiny.gguf")
    assert gguf.specials.prepend_bos is False
    assert gguf.encode("ab ab") == [0, 4, 5] and gguf.encode("ab ab", prepend_bos=False) == [4, 5]


def test_bpe_default_is_bos_plus_the_raw_encoding():
    tok = train_bpe(["The cat sat on the mat. When Mary and John went to the store."] * 20, vocab_size=300)
    model = wb.Decoder(wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=tok.vocab_size, n_ctx=32), tokenizer=tok)
    raw = tok.backend.encode("The cat sat", add_special_tokens=False).ids
    assert model.to_tokens("The cat sat")[0].tolist() == [tok.bos_token_id] + raw
    assert model.to_tokens("The cat sat", prepend_bos=False)[0].tolist() == raw


# ---- to_str_tokens / to_string / single tokens ---------------------------------------------------------------
def test_to_str_tokens_on_every_kind_of_input():
    model = word_model()
    assert model.to_str_tokens(["w1 w2", "w3"]) == [["<bos>", "w1", "w2"], ["<bos>", "w3"]]
    assert model.to_str_tokens(["w1 w2", "w3"], prepend_bos=False) == [["w1", "w2"], ["w3"]]
    assert model.to_str_tokens(torch.tensor([w(1), w(2)])) == ["w1", "w2"]
    assert model.to_str_tokens([w(1), w(2)]) == ["w1", "w2"]
    assert model.to_str_tokens(torch.tensor([[BOS, w(7)]])) == ["<bos>", "w7"]  # batch 1 -> one list, as TL
    assert model.to_str_tokens(torch.tensor([[w(1), w(2)], [w(3), w(4)]])) == [["w1", "w2"], ["w3", "w4"]]
    assert model.to_str_tokens([[w(1)], [w(2), w(3)]]) == [["w1"], ["w2", "w3"]]
    assert model.to_str_tokens(w(5)) == ["w5"]
    assert model.to_str_tokens(torch.tensor(w(5))) == ["w5"]
    with pytest.raises(InputError, match="integers"):
        model.to_str_tokens(torch.tensor([1.0, 2.0]))
    with pytest.raises(InputError, match=r"\[batch, pos\]"):
        model.to_str_tokens(torch.zeros(1, 2, 3, dtype=torch.long))


def test_to_string_on_ints_tensors_and_lists():
    model = word_model()
    assert model.to_string(torch.tensor(w(5))) == "w5"  # 0-d, as test_prompt passes it
    assert model.to_string(w(5)) == "w5"
    assert model.to_string(torch.tensor([w(1), w(2)])) == "w1 w2"
    assert model.to_string([w(1), w(2)]) == "w1 w2"
    assert model.to_string(torch.tensor([[w(1), w(2)], [w(3), w(4)]])) == ["w1 w2", "w3 w4"]
    assert model.to_string([[w(1)], [w(3), w(4)]]) == ["w1", "w3 w4"]
    assert model.to_string(model.to_tokens("w8 w9", prepend_bos=False)[0]) == "w8 w9"


def test_single_token_round_trip():
    model = word_model()
    assert model.to_single_token("w7") == w(7)
    assert model.to_single_str_token(w(7)) == "w7"
    assert model.to_single_str_token(BOS) == "<bos>"
    with pytest.raises(InputError, match="2 tokens"):
        model.to_single_token("w7 w8")
    with pytest.raises(InputError, match="int"):
        model.to_single_str_token("w7")


# ---- get_token_position ---------------------------------------------------------------------------------------
def test_get_token_position_counts_the_bos_and_finds_first_and_last():
    model = word_model()
    text = "w5 w6 w5 w7"  # with BOS: positions 0 <bos>, 1 w5, 2 w6, 3 w5, 4 w7
    assert model.get_token_position("w5", text) == 1
    assert model.get_token_position("w5", text, mode="last") == 3
    assert model.get_token_position("w5", text, prepend_bos=False) == 0
    assert model.get_token_position("w5", text, mode="last", prepend_bos=False) == 2
    assert model.get_token_position(w(7), text) == 4
    ids = torch.tensor([[BOS, w(9), w(8), w(9)]])
    assert model.get_token_position("w9", ids) == 1 and model.get_token_position("w9", ids[0], mode="last") == 3
    assert model.get_token_position(torch.tensor(w(8)), [BOS, w(9), w(8)]) == 2


def test_get_token_position_errors_are_clear():
    model = word_model()
    with pytest.raises(InputError, match="'w4' does not occur"):
        model.get_token_position("w4", "w5 w6")
    with pytest.raises(InputError, match="mode must be 'first' or 'last'"):
        model.get_token_position("w5", "w5", mode="middle")
    with pytest.raises(InputError, match="one sequence"):
        model.get_token_position("w5", torch.full((2, 3), w(5)))
    with pytest.raises(InputError, match="2 tokens"):
        model.get_token_position("w5 w6", "w5 w6")


# ---- TransformerLens utilities ------------------------------------------------------------------------------
def test_transformer_lens_test_prompt_prints_the_answers_rank(capsys):
    torch.manual_seed(0)
    tok = train_bpe(["The cat sat on the mat. When Mary and John went to the store, John gave a drink to Mary."] * 20,
                    vocab_size=300)
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=tok.vocab_size, n_ctx=64,
                         positional="rotary", attn_only=True)
    model = wb.Decoder(cfg, tokenizer=tok).eval()
    prompt, answer = "When Mary and John went to the store, John gave a drink to", " Mary"
    answer_ids = tok.backend.encode(answer, add_special_tokens=False).ids
    assert len(answer_ids) == 1  # a one-token answer, so test_prompt prints one rank
    prompt_ids = [tok.bos_token_id] + tok.backend.encode(prompt, add_special_tokens=False).ids
    with torch.no_grad():
        probs = model(torch.tensor([prompt_ids + answer_ids]))[0, len(prompt_ids) - 1].softmax(-1)
    rank = int((probs > probs[answer_ids[0]]).sum())

    tl_test_prompt(prompt, "Mary", model)
    out = capsys.readouterr().out
    assert "Tokenized prompt: ['<|endoftext|>'," in out  # TransformerLens's default: BOS first
    assert re.search(rf"Rank: {rank}\b", out)
    assert f"Ranks of the answer tokens: [(' Mary', {rank})]" in out


# ---- hook names ---------------------------------------------------------------------------------------------
def test_unknown_hook_names_are_input_errors_suggesting_the_nearest():
    model = word_model()
    tokens = torch.tensor([[BOS, w(1), w(2)]])
    nothing = lambda x, hook: None  # noqa: E731
    with pytest.raises(InputError, match=r"'blocks\.0\.attn\.hook_zz'.*did you mean 'blocks\.0\.attn\.hook_z'"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_zz", nothing)])
    with pytest.raises(InputError, match=r"'blocks\.1\.hook_resid_pr'.*did you mean 'blocks\.1\.hook_resid_pre'"):
        with model.hooks(bwd_hooks=[("blocks.1.hook_resid_pr", nothing)]):
            pass
    with pytest.raises(InputError, match=r"'blocks\.0\.mlp\.hook_psot'.*'blocks\.0\.mlp\.hook_post'"):
        model.add_hook("blocks.0.mlp.hook_psot", nothing)
    with pytest.raises(InputError, match=r"'blocks\.0\.attn'"):  # a module, not a hook point
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn", nothing)])
    with pytest.raises(InputError, match="list of \\(name, hook\\) pairs"):
        model.run_with_hooks(tokens, fwd_hooks=("blocks.0.attn.hook_z", nothing))
    assert hooks_left(model) == []


def test_names_filter_typos_are_errors_but_functions_are_left_alone():
    model = word_model()
    tokens = torch.tensor([[BOS, w(1), w(2)]])
    with pytest.raises(InputError, match=r"'blocks\.0\.attn\.hook_zz'.*did you mean 'blocks\.0\.attn\.hook_z'"):
        model.run_with_cache(tokens, names_filter="blocks.0.attn.hook_zz")
    with pytest.raises(InputError, match=r"'blocks\.1\.hook_resid_psot'") as info:
        model.run_with_cache(tokens, names_filter=["blocks.0.hook_resid_pre", "blocks.1.hook_resid_psot"])
    assert "'blocks.0.hook_resid_pre'" not in str(info.value).split("did you mean")[0]  # only the bad name is named
    assert hooks_left(model) == []
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name == "blocks.0.attn.hook_zz")
    assert len(cache) == 0  # a function is the user's own: no check
    _, cache = model.run_with_cache(tokens, names_filter=("blocks.0.attn.hook_z", "hook_embed"))
    assert sorted(cache.keys()) == ["blocks.0.attn.hook_z", "hook_embed"]


def test_callable_hook_names_still_work():
    model = word_model()
    seen = []
    model.run_with_hooks(torch.tensor([[BOS, w(1)]]), fwd_hooks=[(lambda n: n.endswith("attn.hook_z"),
                                                                  lambda x, hook: seen.append(hook.name))])
    assert seen == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    assert hooks_left(model) == []


# ---- what hooks return -----------------------------------------------------------------------------------------
def test_hook_returning_a_wrong_shape_names_the_hook_and_both_shapes_and_is_removed():
    model = word_model()
    tokens = torch.tensor([[BOS, w(1), w(2), w(3)]])  # resid_pre is [1, 4, 32]
    name = "blocks.1.hook_resid_pre"
    with pytest.raises(InputError) as info:
        model.run_with_hooks(tokens, fwd_hooks=[(name, lambda x, hook: x[:, :-1])])
    message = str(info.value)
    assert name in message and "(1, 3, 32)" in message and "(1, 4, 32)" in message
    assert not model.hook_dict[name]._forward_hooks and not model.hook_dict[name].fwd_hooks
    assert hooks_left(model) == []


def test_hook_returning_a_wrong_dtype_or_a_non_tensor_is_an_error():
    model = word_model()
    tokens = torch.tensor([[BOS, w(1), w(2)]])
    with pytest.raises(InputError, match=r"blocks\.0\.attn\.hook_z.*torch\.float64.*torch\.float32"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", lambda x, hook: x.double())])
    with pytest.raises(InputError, match=r"hook_embed.*returned a float"):
        model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", lambda x, hook: x.norm().item())])
    assert hooks_left(model) == []


def test_hooks_returning_none_or_a_same_shape_edit_work():
    model = word_model()
    tokens = torch.tensor([[BOS, w(1), w(2)]])
    plain = model(tokens)
    torch.testing.assert_close(model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", lambda x, hook: None)]), plain)
    edited = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda x, hook: x * 0)])
    assert edited.shape == plain.shape and not torch.allclose(edited, plain)


def test_backward_hook_of_a_wrong_shape_is_an_error_and_the_context_removes_it():
    model = word_model()
    tokens = torch.tensor([[BOS, w(1), w(2)]])
    name = "blocks.1.hook_resid_pre"
    with pytest.raises(InputError, match=rf"{re.escape(name)}.*\(1, 2, 32\).*\(1, 3, 32\)"):
        with model.hooks(bwd_hooks=[(name, lambda g, hook: g[:, 1:])]):
            model(tokens, return_type="loss").backward()
    assert not model.hook_dict[name]._backward_hooks and hooks_left(model) == []


def test_add_hook_checks_the_result_and_reset_hooks_removes_it():
    model = word_model()
    model.add_hook("hook_embed", lambda x, hook: x[..., :-1])
    with pytest.raises(InputError, match=r"hook_embed.*\(1, 2, 31\).*\(1, 2, 32\)"):
        model(torch.tensor([[BOS, w(1)]]))
    model.reset_hooks()
    assert hooks_left(model) == []


def test_an_exception_inside_a_hook_still_names_the_hook_point():
    model = word_model()

    def broken(x, hook):
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError) as info:
        model.run_with_hooks(torch.tensor([[BOS, w(1)]]), fwd_hooks=[("blocks.0.attn.hook_pattern", broken)])
    assert any("blocks.0.attn.hook_pattern" in note and "broken" in note for note in info.value.__notes__)
    assert hooks_left(model) == []


def test_layer_of_suggests_the_nearest_name():
    model = word_model()
    with pytest.raises(InputError, match=r"did you mean 'blocks\.1\.attn\.hook_pattern'"):
        model.layer_of("blocks.1.attn.hook_patern")
    assert model.layer_of("blocks.1.attn.hook_pattern") == 1


def test_cfg_default_prepend_bos_is_transformer_lens_switch():
    model = make_model("mha_learned_ln")
    model.tokenizer = Tokenizer(word_backend(), SpecialTokens(bos_token="<bos>", eos_token="<eos>"))
    assert model.cfg.default_prepend_bos and model.to_tokens("w3 w4")[0].tolist() == [BOS, w(3), w(4)]
    model.cfg.default_prepend_bos = False  # TransformerLens's way: sets the model's option
    assert model.to_tokens("w3 w4")[0].tolist() == [w(3), w(4)]
    assert model.to_tokens("w3 w4", prepend_bos=True)[0].tolist() == [BOS, w(3), w(4)]


def test_transformer_lens_evals_accept_the_model():
    from transformer_lens import evals

    torch.manual_seed(0)
    cfg = wb.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=20_001, n_ctx=64, positional="rotary")
    model = wb.Decoder(cfg, tokenizer=Tokenizer(word_backend(), SpecialTokens(bos_token="<bos>"))).eval()
    torch.manual_seed(1)
    loss = evals.induction_loss(model, batch_size=2, subseq_len=20, device="cpu")
    torch.manual_seed(1)  # the same draw, scored by hand from the raw logits
    tokens = torch.randint(100, 20_000, (2, 20)).repeat(1, 2)
    tokens[:, 0] = BOS
    logits = model(tokens)
    per_token = -logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    assert loss.item() == pytest.approx(per_token[:, 21:].mean().item(), abs=1e-5)
