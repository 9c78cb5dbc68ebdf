"""A small byte-level BPE tokenizer for the zoo models, trained with `tokenizers`.

Byte-level (GPT-2 style) so any text, including the stdlib's odd bytes, round-trips without
an unknown token. One special token, ``<|endoftext|>``, is both BOS and EOS: documents are
joined with it, every training sequence starts with it, and ``to_tokens`` prepends it, so the
models always have the same first token to park attention on (as GPT-2-small does).

Example:
    >>> tok = train_bpe(["def f(x):\\n    return x\\n"] * 50, vocab_size=300)
    >>> tok.decode(tok.encode("def f(x):", prepend_bos=False))
    'def f(x):'
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from workbench.errors import InputError
from workbench.tokenizer import SpecialTokens, Tokenizer

BOUNDARY_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 2048


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, show_progress: bool = False) -> Tokenizer:
    """Trains a byte-level BPE of ``vocab_size`` ids (the special token is id 0) on ``texts``.

    Training is deterministic for a given list of texts (merges are ranked by count, ties by
    the pair itself), so a recipe retrains the very tokenizer that ships with the model.

    Example:
        >>> tok = train_bpe(["for i in range(10):\\n    pass\\n"] * 20, vocab_size=280)
        >>> tok.vocab_size <= 280, tok.bos_token_id
        (True, 0)
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise InputError(f"vocab_size={vocab_size} is below the {len(alphabet) + 1} ids a byte-level BPE "
                         "needs (256 bytes and the special token)")
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOUNDARY_TOKEN],
                                  initial_alphabet=alphabet, show_progress=show_progress)
    backend.train_from_iterator(texts, trainer=trainer)
    specials = SpecialTokens(bos_token=BOUNDARY_TOKEN, eos_token=BOUNDARY_TOKEN, pad_token=BOUNDARY_TOKEN,
                             prepend_bos=True)
    return Tokenizer(backend, specials)
