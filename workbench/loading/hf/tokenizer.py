"""The tokenizer of an HF directory: ``tokenizer.json`` plus the special tokens it does not state.

``tokenizer.json`` holds the vocabulary, merges, pre-tokenizer and decoder; which token is
BOS/EOS/padding and whether the checkpoint prepends BOS live in ``tokenizer_config.json`` /
``special_tokens_map.json`` (or, failing those, as ids in ``config.json``). Older configs have no
``add_bos_token``; then the tokenizer's own post-processor tells us (Llama's adds BOS). That
convention is recorded in ``SpecialTokens.prepend_bos``; ``prepend_bos=None`` is TransformerLens's
default (BOS whenever there is a BOS token), see ``workbench.tokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import tokenizers

from workbench.errors import CheckpointError
from workbench.tokenizer import SpecialTokens, Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_from_hf_directory(directory: Path, model_config: dict[str, Any]) -> Optional[Tokenizer]:
    """The directory's tokenizer, or None when it has no ``tokenizer.json``.

    Example:
        >>> tok = tokenizer_from_hf_directory(Path("hf-dir"), json.load(open("hf-dir/config.json")))  # doctest: +SKIP
        >>> tok.encode("hello")                                                                        # doctest: +SKIP
    """
    path = directory / TOKENIZER_FILE
    if not path.exists():
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for malformed JSON
        raise CheckpointError(f"{path}: unreadable tokenizer ({error})") from error
    settings = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    tokens = {}
    for role in ("bos", "eos", "pad"):
        token = _token_text(settings.get(f"{role}_token"))
        if token is None and isinstance(model_config.get(f"{role}_token_id"), int):
            token = backend.id_to_token(model_config[f"{role}_token_id"])
        tokens[f"{role}_token"] = token if token is not None and backend.token_to_id(token) is not None else None
    prepend_bos = settings.get("add_bos_token")
    if prepend_bos is None:
        prepend_bos = _post_processor_adds(backend, tokens["bos_token"])
    return Tokenizer(backend, SpecialTokens(**tokens, prepend_bos=bool(prepend_bos and tokens["bos_token"])))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable JSON ({error})") from error
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> Optional[str]:
    """A special token as configs spell it: a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _post_processor_adds(backend: tokenizers.Tokenizer, bos_token: Optional[str]) -> bool:
    """True when the tokenizer itself puts BOS first (what transformers would do by default)."""
    if bos_token is None:
        return False
    bos_id = backend.token_to_id(bos_token)
    with_specials = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return with_specials[:1] == [bos_id] and without[:1] != [bos_id]
