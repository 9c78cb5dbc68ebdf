"""A thin wrapper over a `tokenizers.Tokenizer` that knows the model's special tokens.

It carries what `tokenizer.json` alone does not: which token is BOS/EOS/padding and whether
this model expects BOS prepended (GPT-2 and SmolLM2 do not by default; Llama does).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import tokenizers
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.errors import InputError

SPECIALS_FILE = "special_tokens.json"


@dataclass(frozen=True)
class SpecialTokens:
    """Special-token strings and the BOS policy, saved beside tokenizer.json by ``Decoder.save``."""

    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    pad_token: Optional[str] = None
    prepend_bos: bool = False


class Tokenizer:
    """Text <-> token ids for one model.

    Example:
        >>> tok = Tokenizer.from_directory("path/to/saved/model")   # doctest: +SKIP
        >>> tok.to_tokens(["a b", "c"]).shape                       # doctest: +SKIP
        torch.Size([2, 2])
    """

    def __init__(self, backend: tokenizers.Tokenizer, specials: SpecialTokens = SpecialTokens()):
        self.backend = backend
        self.specials = specials
        self.bos_token_id = self._id_of(specials.bos_token)
        self.eos_token_id = self._id_of(specials.eos_token)
        pad_id = self._id_of(specials.pad_token)
        self.pad_token_id = pad_id if pad_id is not None else (self.eos_token_id or 0)

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise InputError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @classmethod
    def from_directory(cls, directory: Union[str, Path]) -> "Tokenizer":
        """Reads ``tokenizer.json`` and, if present, ``special_tokens.json`` from a saved model."""
        directory = Path(directory)
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        specials_path = directory / SPECIALS_FILE
        specials = SpecialTokens(**json.loads(specials_path.read_text())) if specials_path.exists() else SpecialTokens()
        return cls(backend, specials)

    def save(self, directory: Union[str, Path]) -> None:
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        (directory / SPECIALS_FILE).write_text(json.dumps(asdict(self.specials), indent=2))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str, prepend_bos: Optional[bool] = None) -> list[int]:
        """Token ids of one string, BOS first where the model (or ``prepend_bos``) asks for it."""
        if not isinstance(text, str):
            raise InputError(f"expected a string to tokenize, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        use_bos = self.specials.prepend_bos if prepend_bos is None else prepend_bos
        if use_bos:
            if self.bos_token_id is None:
                raise InputError("prepend_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id] + ids
        return ids

    def to_tokens(self, text: Union[str, list[str]], prepend_bos: Optional[bool] = None) -> Int[Tensor, "batch pos"]:
        """[batch, pos] ids; a list of strings is right-padded with the pad token."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise InputError("no text given: an empty list has nothing to tokenize")
        rows = [self.encode(t, prepend_bos) for t in texts]
        width = max(len(r) for r in rows)
        if width == 0:
            raise InputError("the text is empty: it tokenizes to zero tokens")
        return torch.tensor([r + [self.pad_token_id] * (width - len(r)) for r in rows], dtype=torch.long)

    def decode(self, ids: Union[list[int], Tensor]) -> str:
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self.backend.decode(ids, skip_special_tokens=False)

    def to_str_tokens(self, ids: Union[list[int], Tensor]) -> list[str]:
        """Each id decoded on its own (what TransformerLens shows as string tokens)."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return [self.backend.decode([i], skip_special_tokens=False) for i in ids]
