"""Which strings name a Hub repo, and TransformerLens's model names as the repo ids they stand for.

TransformerLens's official names and aliases ("gpt2-small", "pythia-70m", "gemma-2-2b") come from the
installed transformer-lens's own table (``transformer_lens.supported_models``), never a copy, so a
newer transformer-lens brings its new names. The workbench's registered names are looked up first, by
``load_model``: where a name is both, ours wins.
"""

from __future__ import annotations

import re

from transformer_lens import supported_models

# A repo id as the Hub accepts one: "name" or "org/name"; letters, digits, "-", "_", "."; no "--" or "..";
# at most 96 characters (huggingface_hub's validate_repo_id).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
_MAX_LENGTH = 96
# A string ending so names a local file, not a repo.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt")


def is_repo_id(text: str) -> bool:
    """``text`` has the shape of a Hub repo id ("gpt2", "org/name").

    Example:
        >>> is_repo_id("EleutherAI/pythia-70m"), is_repo_id("gpt2"), is_repo_id("./runs/x"), is_repo_id("a/b/c")
        (True, True, False, False)
    """
    return (isinstance(text, str) and len(text) <= _MAX_LENGTH and _REPO_ID.fullmatch(text) is not None
            and "--" not in text and ".." not in text and not text.endswith(".")
            and not text.lower().endswith(_FILE_SUFFIXES))


def repo_id_for(name: str) -> str:
    """The repo id TransformerLens's table gives ``name`` (an official name or alias, any case), else ``name``.

    Example:
        >>> repo_id_for("gpt2-small"), repo_id_for("pythia-70m"), repo_id_for("gemma-2-2b")
        ('gpt2', 'EleutherAI/pythia-70m', 'google/gemma-2-2b')
        >>> repo_id_for("my-org/my-model")   # not in the table: a repo id already
        'my-org/my-model'
    """
    try:
        return supported_models.get_official_model_name(name)
    except ValueError:
        return name


def transformer_lens_names() -> dict[str, str]:
    """Every TransformerLens official name and alias -> the repo id it resolves to.

    Example:
        >>> names = transformer_lens_names()
        >>> names["gpt2-small"], names["EleutherAI/pythia-70m"]
        ('gpt2', 'EleutherAI/pythia-70m')
    """
    out = {}
    for official in supported_models.OFFICIAL_MODEL_NAMES:
        out[official] = official
        for alias in supported_models.MODEL_ALIASES.get(official, []):
            out[alias] = official
    return out


def is_hub_name(text: str) -> bool:
    """``text`` is a TransformerLens model name or has the shape of a repo id.

    Example:
        >>> is_hub_name("gpt2-small"), is_hub_name("org/name"), is_hub_name("/abs/path")
        (True, True, False)
    """
    return isinstance(text, str) and (is_repo_id(text) or repo_id_for(text) != text)
