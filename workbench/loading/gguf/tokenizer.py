"""A `tokenizers` BPE built from a GGUF file's own vocabulary and merges.

A GGUF carries no tokenizer.json, only llama.cpp's metadata: ``tokenizer.ggml.model``,
``tokens``, ``merges`` (or ``scores``), ``token_type``, the special token ids,
``add_bos_token`` and ``pre`` (the pre-tokenizer the merges were learned with). We rebuild
what transformers 5.23 builds from the same fields (``integrations/gguf/gguf_tokenizer_mapping.py``),
so ids agree exactly. Two tokenizer models:

- ``gpt2`` (byte-level BPE; SmolLM2, Llama 3, Qwen2): tokens spelled outside GPT-2's byte
  alphabet are re-spelled as their UTF-8 bytes; the split regex is the one ``pre`` names
  (Llama-3, Qwen2 ...), else GPT-2's own, which is what SmolLM2's ``pre = "smollm"`` gets.
- ``llama`` (sentencepiece-style BPE; Llama 2, Mistral 7B): "▁" marks spaces, unknown bytes
  fall back to ``<0xNN>`` tokens, and merges missing from the file are rebuilt from the token
  scores; the file's BOS convention is "prepend" unless it says otherwise.

Two architectures spell a sentencepiece vocabulary their own way (``SENTENCEPIECE_STYLES``, as
transformers' ``GGUF_SENTENCEPIECE_BUILDERS``): Gemma's files store runs of spaces as real spaces
(respelled "▁"), list no merges and order them by position in the file rather than by score, and
split on spaces without a prefix space (``GemmaTokenizer``'s backend); Phi-3 adds its prefix space
with a normalizer instead of ``Metaspace``.

In both, CONTROL tokens (type 3) and the BOS/EOS/UNK/PAD tokens become special added tokens,
USER_DEFINED ones (type 4) plain added tokens, so they are matched whole in text.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from workbench.errors import CheckpointError
from workbench.tokenizer import SpecialTokens
from workbench.tokenizer import Tokenizer as WorkbenchTokenizer

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# general.architecture -> how its sentencepiece vocabulary is built (others: "llama").
SENTENCEPIECE_STYLES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
# tokenizer.ggml.pre -> split regex; names not listed use GPT-2's byte-level regex.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE's alphabet).

    Example:
        >>> bytes_to_unicode()[ord(" ")]
        'Ġ'
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def tokenizer_from_gguf(field: Callable[[str, Any], Any], source: str) -> Optional[WorkbenchTokenizer]:
    """The workbench ``Tokenizer`` a GGUF's metadata describes (None when it has no vocabulary).

    Args:
        field: ``field(key, default)`` reads one metadata value (e.g. ``"tokenizer.ggml.tokens"``).
        source: the file, for error messages.

    Example:
        >>> tok = tokenizer_from_gguf(reader_field, "model.gguf")   # doctest: +SKIP
        >>> tok.encode("The capital of France is")                 # doctest: +SKIP
    """
    tokens: Optional[list[str]] = field("tokenizer.ggml.tokens", None)
    if tokens is None:
        return None
    kind = field("tokenizer.ggml.model", None)
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{source}: field 'tokenizer.ggml.model' = {kind!r}: supported tokenizer models "
                              "are 'gpt2' (byte-level BPE) and 'llama' (sentencepiece-style BPE)")
    merges = field("tokenizer.ggml.merges", None)
    token_types = field("tokenizer.ggml.token_type", None) or []

    def token(key: str) -> Optional[str]:
        index = field(f"tokenizer.ggml.{key}", None)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    if kind == "gpt2":
        if merges is None:
            raise CheckpointError(f"{source}: field 'tokenizer.ggml.merges' is missing (a byte-level BPE needs its merges)")
        backend, alphabet = _byte_level_bpe(tokens, merges, field("tokenizer.ggml.pre", None)), set(bytes_to_unicode().values())
    else:
        scores = field("tokenizer.ggml.scores", None)
        if merges is None and scores is None:
            raise CheckpointError(f"{source}: fields 'tokenizer.ggml.merges' and 'tokenizer.ggml.scores' are both "
                                  "missing (one is needed to know the merges)")
        style = SENTENCEPIECE_STYLES.get(field("general.architecture", None), "llama")
        backend, alphabet = _sentencepiece_bpe(tokens, merges, scores, style), None
    specials = {role: token(f"{key}_token_id") for role, key in
                (("bos_token", "bos"), ("eos_token", "eos"), ("unk", "unknown"), ("pad_token", "padding"))}
    _add_special_tokens(backend, tokens, token_types, alphabet, [t for t in specials.values() if t is not None])
    # llama.cpp prepends BOS to a sentencepiece vocabulary unless the file says not to (so does transformers).
    # Recorded as the file's own convention; ``prepend_bos=None`` is TransformerLens's default (BOS when there is one).
    prepend_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama")) and specials["bos_token"] is not None
    return WorkbenchTokenizer(backend, SpecialTokens(bos_token=specials["bos_token"], eos_token=specials["eos_token"],
                                                     pad_token=specials["pad_token"], prepend_bos=prepend_bos))


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A dict comprehension as transformers writes it: a later duplicate spelling wins.
    vocab = {text if set(text) <= alphabet else "".join(spelling[b] for b in text.encode("utf-8")): index
             for index, text in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], merges: Optional[list[str]], scores: Optional[list[float]],
                       style: str = "llama") -> Tokenizer:
    if style == "gemma":  # runs of spaces respelled; merges ranked by position in the file, not by score
        tokens = ["▁" * len(text) if " " in text and not text.strip() else text for text in tokens]
        scores = [-float(index) for index in range(len(tokens))]
    vocab = {text: index for index, text in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges] if merges is not None else merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk = {"unk_token": "<unk>"} if style == "gemma" and "<unk>" in vocab else {}  # GemmaTokenizer's default
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None, **unk))
    strip = [decoders.Strip(content=" ", left=1)]
    if style == "gemma":  # GemmaTokenizer: spaces as "▁", split after each, no prefix space
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        strip = []
    elif style == "phi3":  # the prefix space from a normalizer, no pre-tokenizer
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="▁"), normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens, best score first.

    The order (ties broken by the pieces' lengths, then ids) is transformers' ``generate_merges``.

    Example:
        >>> merges_from_scores({"a": 0, "b": 1, "ab": 2}, {"a": 0.0, "b": 0.0, "ab": -1.0})
        [('a', 'b')]
    """
    merges = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: Tokenizer, tokens: list[str], token_types: list[int], alphabet: Optional[set[str]],
                        named_specials: list[str]) -> None:
    """CONTROL tokens and the named specials as special added tokens; USER_DEFINED as plain added ones.

    A byte-level CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel;
    transformers skips it, and so do we.
    """
    control = [text for text, kind in zip(tokens, token_types)
               if kind == CONTROL and (alphabet is None or set(text) <= alphabet)]
    specials = list(dict.fromkeys(control + named_specials))
    backend.add_special_tokens([AddedToken(text, normalized=False, special=True) for text in specials])
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(text, normalized=False, special=False)
                        for text, kind in zip(tokens, token_types) if kind == USER_DEFINED and text in vocab])
