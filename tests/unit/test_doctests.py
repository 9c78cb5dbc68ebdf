"""Every docstring example in ``workbench``, ``experiments`` and ``app`` runs (those marked ``+SKIP`` are the
ones that cannot: a download, a GPU, a browser, minutes of compute).

Each example sees a fresh namespace: ``wb``, ``torch``, and the zoo's ``toy-attn-2l`` (a real two-layer
attention-only model with its own tokenizer, shipped in the package) as ``model``, with ``tokens`` (a short
prompt), ``logits`` and ``cache`` (its ``run_with_cache``). Writing an example: use those names, keep it
fast, and show output a reader can check.
"""

from __future__ import annotations

import copy
import doctest
import importlib
import pkgutil
from functools import lru_cache

import pytest
import torch

PACKAGES = ("workbench", "experiments", "app")
# Imported for their side effects or only under a running Streamlit script: no examples to collect.
NOT_COLLECTED = ("app.Home", "app.pages", "workbench.kernels.triton_flash", "experiments.__main__")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            if not info.name.startswith(NOT_COLLECTED):
                names.append(info.name)
    return names


@lru_cache(maxsize=1)
def _toy_model():
    import workbench as wb

    return wb.load_model("toy-attn-2l", progress=False).eval()


def _namespace(module) -> dict:
    import workbench as wb

    model = copy.deepcopy(_toy_model())  # an example may switch kernels or process weights
    tokens = model.to_tokens("The cat sat on the mat. The cat")
    logits, cache = model.run_with_cache(tokens)
    return {**vars(module), "wb": wb, "torch": torch, "model": model, "tokens": tokens, "logits": logits,
            "cache": cache}


@pytest.mark.parametrize("module_name", _module_names())
def test_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    examples = [test for test in doctest.DocTestFinder(exclude_empty=True).find(module, module_name)
                if test.examples and test.filename and test.filename.endswith(".py")]
    failures = []
    for example in examples:
        example.globs = _namespace(module)
        runner = doctest.DocTestRunner(optionflags=FLAGS)
        result = runner.run(example, out=failures.append)
        example.globs.clear()
        assert result.failed == 0 or failures, example.name
    assert not failures, "".join(failures)
