"""A `tokenizers` byte-level BPE built from a GGUF file's own vocabulary and merges.

A GGUF carries no tokenizer.json, only llama.cpp's metadata: ``tokenizer.ggml.tokens``,
``merges``, ``token_type``, the special token ids, ``add_bos_token`` and ``pre`` (the name
of the pre-tokenizer the merges were learned with). We rebuild what transformers 5.23 builds
from the same fields (``integrations/gguf/gguf_tokenizer_mapping.py``), so ids agree exactly:

- tokens spelled outside GPT-2's byte alphabet are re-spelled as their UTF-8 bytes;
- CONTROL tokens (type 3) become special added tokens, USER_DEFINED (type 4) plain added ones;
- the split regex is the one the ``pre`` name stands for (Llama-3, Qwen2 ...), else GPT-2's own
  (``ByteLevel(use_regex=True)``), which is what SmolLM2's ``pre = "smollm"`` gets.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

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
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: field 'tokenizer.ggml.model' = {kind!r}: only byte-level BPE ('gpt2') tokenizers are supported")
    merges = field("tokenizer.ggml.merges", None)
    if merges is None:
        raise CheckpointError(f"{source}: field 'tokenizer.ggml.merges' is missing (a BPE vocabulary needs its merges)")
    token_types = field("tokenizer.ggml.token_type", None) or []
    backend = _byte_level_bpe(tokens, merges, token_types, field("tokenizer.ggml.pre", None))

    def token(key: str) -> Optional[str]:
        index = field(f"tokenizer.ggml.{key}", None)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    specials = SpecialTokens(bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                             pad_token=token("padding_token_id"),
                             prepend_bos=bool(field("tokenizer.ggml.add_bos_token", False)) and token("bos_token_id") is not None)
    return WorkbenchTokenizer(backend, specials)


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], pre: Optional[str]) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, text in enumerate(tokens):
        spelled = text if set(text) <= alphabet else "".join(spelling[b] for b in text.encode("utf-8"))
        vocab.setdefault(spelled, index)
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it too.
    backend.add_special_tokens([AddedToken(text, normalized=False, special=True)
                                for text, kind in zip(tokens, token_types)
                                if kind == CONTROL and set(text) <= alphabet])
    backend.add_tokens([AddedToken(text, normalized=False, special=False)
                        for text, kind in zip(tokens, token_types) if kind == USER_DEFINED and text in vocab])
    return backend
