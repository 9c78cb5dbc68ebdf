"""Tiny checkpoints written by ``transformers`` (and a GGUF written as llama.cpp writes one) as the fake hub
serves them, each with the ``transformers`` model that reads the same files, for expected logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tests.hub_server import files_of
from tests.integration.hf_tiny import FACTORIES, randomize, word_tokenizer

# A file a repo may hold that a load must never fetch: remote code, other frameworks, duplicates, docs.
NEVER_FETCHED = ("README.md", "modeling_evil.py", "flax_model.msgpack", "consolidated.safetensors")
EVIL_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("remote code ran")
"""


@dataclass
class TinyRepo:
    directory: Path
    reference: torch.nn.Module  # transformers' model read from the same files
    gguf_file: Optional[str] = None

    def files(self) -> dict[str, bytes]:
        return files_of(self.directory)


def hf_repo(directory: Path, family: str, seed: int, shard: Optional[str] = None, pickled: bool = False,
            extras: Optional[dict[str, str]] = None, config_changes: Optional[dict] = None) -> TinyRepo:
    """A randomised tiny ``family`` model saved by transformers (sharded at ``shard``, or as a pickle only)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = randomize(FACTORIES[family](), seed=seed).eval()
    if pickled:
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    else:
        model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    word_tokenizer().save_pretrained(directory)
    for name, text in (extras or {}).items():
        (directory / name).write_text(text)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if config_changes:
        import json
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
    return TinyRepo(directory, reference)


def gguf_repo(directory: Path) -> TinyRepo:
    from transformers import AutoModelForCausalLM

    from tests.integration.gguf_tiny import tiny_llama, write_gguf

    path = write_gguf(tiny_llama(seed=3), directory / "tiny-q8_0.gguf")
    (directory / "README.md").write_text("a GGUF repo")
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=path.name, dtype=torch.float32).eval()
    return TinyRepo(directory, reference, gguf_file=path.name)


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
