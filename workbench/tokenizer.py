"""A thin wrapper over a `tokenizers.Tokenizer` that knows the model's special tokens.

It carries what `tokenizer.json` alone does not: which token is BOS/EOS/padding, and whether the
checkpoint's own tokenizer puts BOS first (Llama's does; GPT-2's and SmolLM2's do not).

``prepend_bos=None`` means TransformerLens's default, the same for every model: prepend BOS when
the tokenizer has a BOS token (``Tokenizer.default_prepend_bos``), as ``HookedTransformer`` does
for GPT-2. ``prepend_bos=False``/``True`` overrides it; ``SpecialTokens.prepend_bos`` records the
checkpoint's own convention (pass it to reproduce `transformers`' or llama.cpp's ids exactly).
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
    """Special-token strings, saved beside tokenizer.json by ``Decoder.save``.

    ``prepend_bos`` records whether the checkpoint's own tokenizer puts BOS first (`transformers`'
    ``add_special_tokens=True``, llama.cpp's ``add_bos_token``). It is not the workbench's default,
    which is TransformerLens's (``Tokenizer.default_prepend_bos``); pass it as ``prepend_bos=`` to
    get the ids those libraries give.

    Example:
        >>> model.tokenizer.specials
        SpecialTokens(bos_token='<|endoftext|>', eos_token='<|endoftext|>', pad_token='<|endoftext|>', prepend_bos=True)
    """

    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    pad_token: Optional[str] = None
    prepend_bos: bool = False


class Tokenizer:
    """Text <-> token ids for one model.

    Example:
        >>> tok = model.tokenizer
        >>> tok.to_tokens(["a b", "c"])               # BOS first; "c" padded on the right
        tensor([[  0,  65, 303],
                [  0,  67,   0]])
        >>> tok.decode(tok.encode("def f(x):"))
        '<|endoftext|>def f(x):'
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
        """Reads ``tokenizer.json`` and, if present, ``special_tokens.json`` from a saved model.

        Example:
            >>> import shutil, tempfile
            >>> directory = tempfile.mkdtemp()
            >>> model.tokenizer.save(directory)
            >>> Tokenizer.from_directory(directory).encode("import os") == model.tokenizer.encode("import os")
            True
            >>> shutil.rmtree(directory)
        """
        directory = Path(directory)
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        specials_path = directory / SPECIALS_FILE
        specials = SpecialTokens(**json.loads(specials_path.read_text())) if specials_path.exists() else SpecialTokens()
        return cls(backend, specials)

    def save(self, directory: Union[str, Path]) -> None:
        """Writes ``tokenizer.json`` and ``special_tokens.json`` into an existing ``directory``.

        Example:
            >>> import shutil, tempfile
            >>> directory = Path(tempfile.mkdtemp())
            >>> model.tokenizer.save(directory)
            >>> sorted(path.name for path in directory.iterdir())
            ['special_tokens.json', 'tokenizer.json']
            >>> shutil.rmtree(directory)
        """
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        (directory / SPECIALS_FILE).write_text(json.dumps(asdict(self.specials), indent=2))

    @property
    def vocab_size(self) -> int:
        """The number of ids, special tokens included.

        Example:
            >>> model.tokenizer.vocab_size
            2048
        """
        return self.backend.get_vocab_size()

    @property
    def default_prepend_bos(self) -> bool:
        """What ``prepend_bos=None`` means: TransformerLens's default, True when there is a BOS token.

        Example:
            >>> tok = model.tokenizer
            >>> tok.default_prepend_bos, tok.encode("a")[0] == tok.bos_token_id
            (True, True)
        """
        return self.bos_token_id is not None

    def encode(self, text: str, prepend_bos: Optional[bool] = None) -> list[int]:
        """Token ids of one string, BOS first when ``prepend_bos`` (default: ``default_prepend_bos``).

        Example:
            >>> tok = model.tokenizer
            >>> tok.encode("a b", prepend_bos=False), tok.encode("a b")
            ([65, 303], [0, 65, 303])
        """
        if not isinstance(text, str):
            raise InputError(f"expected a string to tokenize, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        use_bos = self.default_prepend_bos if prepend_bos is None else prepend_bos
        if use_bos:
            if self.bos_token_id is None:
                raise InputError("prepend_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id] + ids
        return ids

    def to_tokens(self, text: Union[str, list[str]], prepend_bos: Optional[bool] = None,
                  padding_side: str = "right") -> Int[Tensor, "batch pos"]:
        """[batch, pos] ids; a list of strings is padded with the pad token on ``padding_side``.

        Example:
            >>> model.tokenizer.to_tokens(["a b", "a"], prepend_bos=False, padding_side="left")
            tensor([[ 65, 303],
                    [  0,  65]])
        """
        return self.to_tokens_and_mask(text, prepend_bos, padding_side)[0]

    def to_tokens_and_mask(self, text: Union[str, list[str]], prepend_bos: Optional[bool] = None,
                           padding_side: str = "right") -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """Ids [batch, pos] padded on ``padding_side`` ("right" or "left"), and the attention mask
        [batch, pos] (1 = a real token, 0 = padding).

        Example:
            >>> model.tokenizer.to_tokens_and_mask(["a b", "a"], prepend_bos=False, padding_side="left")[1].tolist()
            [[1, 1], [0, 1]]
        """
        if padding_side not in ("right", "left"):
            raise InputError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise InputError("no text given: an empty list has nothing to tokenize")
        rows = [self.encode(t, prepend_bos) for t in texts]
        width = max(len(r) for r in rows)
        if width == 0:
            raise InputError("the text is empty: it tokenizes to zero tokens")
        empty = [index for index, row in enumerate(rows) if not row]
        if empty:
            raise InputError(f"text(s) {empty} tokenize to zero tokens: a row would be all padding")
        pads = [[self.pad_token_id] * (width - len(r)) for r in rows]
        masks = [[1] * len(r) for r in rows]
        zeros = [[0] * (width - len(r)) for r in rows]
        if padding_side == "right":
            ids, mask = [r + p for r, p in zip(rows, pads)], [m + z for m, z in zip(masks, zeros)]
        else:
            ids, mask = [p + r for r, p in zip(rows, pads)], [z + m for m, z in zip(masks, zeros)]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def decode(self, ids: Union[list[int], Tensor]) -> str:
        """The text of a list (or 1-D tensor) of ids, special tokens kept.

        Example:
            >>> model.tokenizer.decode(tokens[0])
            '<|endoftext|>The cat sat on the mat. The cat'
        """
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self.backend.decode(ids, skip_special_tokens=False)

    def to_str_tokens(self, ids: Union[list[int], Tensor]) -> list[str]:
        """Each id decoded on its own (what TransformerLens shows as string tokens).

        Example:
            >>> model.tokenizer.to_str_tokens([0, 65, 303])
            ['<|endoftext|>', 'a', ' b']
        """
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return [self.backend.decode([i], skip_special_tokens=False) for i in ids]
