"""Our induction and detector scores against TransformerLens on the same HF model.

A tiny random ``LlamaForCausalLM`` (large attention weights, so patterns are peaked rather than
uniform) is saved with a word-level tokenizer and loaded twice: by ``wb.load_model`` and by
``TransformerBridge.boot_transformers``. Scores computed here directly from the patterns the
bridge caches, and ``transformer_lens.head_detector.detect_head`` run on our model, must equal ours.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens import head_detector as tl_detector

import workbench as wb
from experiments.detectors import duplicate_token_scores, induction_head_scores, previous_token_scores
from experiments.induction import induction_scores, repeated_random_tokens

transformers = pytest.importorskip("transformers")

VOCAB, SEQ_LEN, BATCH = 64, 12, 3
DETECTORS = {"previous_token_head": previous_token_scores, "duplicate_token_head": duplicate_token_scores,
             "induction_head": induction_head_scores}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # peaked, varied attention instead of near-uniform
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.5)
            layer.self_attn.k_proj.weight.normal_(0, 0.5)
    model.save_pretrained(directory)
    backend = tokenizers.Tokenizer(WordLevel({"<s>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="<s>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<s>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def ours(hf_dir):
    return wb.load_model(str(hf_dir), attn_impl="sdpa").eval()


@pytest.fixture(scope="module")
def bridge_patterns(hf_dir, ours):
    """The bridge's cached patterns [layer][batch, head, q, k] on our repeated random tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    bridge = TransformerBridge.boot_transformers(str(hf_dir), hf_model=hf_model, tokenizer=tokenizer, device="cpu")
    tokens = repeated_random_tokens(ours, SEQ_LEN, BATCH)
    with torch.no_grad():
        torch.testing.assert_close(bridge(tokens), ours(tokens), rtol=1e-4, atol=1e-4)  # same weights
        _, cache = bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    return tokens, [cache[f"blocks.{l}.attn.hook_pattern"].float() for l in range(ours.cfg.n_layers)]


def test_induction_scores_equal_the_bridge_patterns_stripe(ours, bridge_patterns):
    tokens, patterns = bridge_patterns
    assert (tokens[:, 0] == ours.tokenizer.bos_token_id).all()
    expected = torch.zeros(ours.cfg.n_layers, ours.cfg.n_heads)
    for layer, pattern in enumerate(patterns):
        for q in range(SEQ_LEN + 1, 2 * SEQ_LEN + 1):  # every token of the second copy
            expected[layer] += pattern[:, :, q, q - SEQ_LEN + 1].mean(0) / SEQ_LEN
    ours_scores = induction_scores(ours, SEQ_LEN, BATCH)
    torch.testing.assert_close(ours_scores, expected, rtol=0, atol=1e-4)
    assert expected.max() - expected.min() > 0.05  # the heads differ, so the comparison means something


@pytest.mark.parametrize("head_name", list(DETECTORS))
@pytest.mark.parametrize("exclude_bos, exclude_current_token", [(False, False), (True, True)])
def test_detector_scores_equal_transformer_lens_scoring_of_the_bridge_patterns(
        ours, bridge_patterns, head_name, exclude_bos, exclude_current_token):
    tokens, patterns = bridge_patterns
    make_detection = getattr(tl_detector, f"get_{head_name}_detection_pattern")
    expected = torch.zeros(ours.cfg.n_layers, ours.cfg.n_heads)
    for b in range(BATCH):  # detect_head's semantics for several prompts: score each, then average
        detection = make_detection(tokens[b:b + 1].cpu()).float()
        for layer, pattern in enumerate(patterns):
            for head in range(ours.cfg.n_heads):
                expected[layer, head] += tl_detector.compute_head_attention_similarity_score(
                    pattern[b, head], detection, exclude_bos=exclude_bos,
                    exclude_current_token=exclude_current_token, error_measure="mul") / BATCH
    ours_scores = DETECTORS[head_name](ours, tokens, exclude_bos, exclude_current_token)
    torch.testing.assert_close(ours_scores, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("head_name", list(DETECTORS))
def test_detect_head_on_our_model_agrees_with_ours(ours, head_name):
    words = [f"w{i}" for i in torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(5))[:10].add(1).tolist()]
    texts = [" ".join(words + words), " ".join(words[:6] * 3)]
    for options in (dict(), dict(exclude_bos=True, exclude_current_token=True)):
        theirs = tl_detector.detect_head(ours, texts, head_name, **options)
        mine = torch.stack([DETECTORS[head_name](ours, ours.to_tokens(text), **options) for text in texts]).mean(0)
        torch.testing.assert_close(mine, theirs.float(), rtol=0, atol=1e-5)
