"""Every docstring example in ``workbench``, ``experiments`` and ``app`` runs (those marked ``+SKIP`` are the
ones that cannot: a download, a GPU, a browser, minutes of compute), and every public module-level function has
one (``NO_EXAMPLE`` lists the few that cannot, with the reason).

Each example sees a fresh namespace: ``wb``, ``torch``, and the zoo's ``toy-attn-2l`` (a real two-layer
attention-only model with its own tokenizer, shipped in the package) as ``model``, with ``tokens`` (a short
prompt), ``logits`` and ``cache`` (its ``run_with_cache``). Writing an example: use those names, keep it
fast, and show output a reader can check.
"""

from __future__ import annotations

import ast
import copy
import doctest
import importlib
import pkgutil
from functools import lru_cache
from pathlib import Path

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


# Public module-level functions without a docstring example, and why: each is exercised by its own tests instead.
NO_EXAMPLE = {
    "main": "a command's entry point, run as `python -m ...` by its command-line tests",
    "app/feature_card.py:on_prompt": "draws into a running Streamlit page (tests/e2e, AppTest)",
    "app/feature_card.py:logit_effect": "draws into a running Streamlit page (tests/e2e, AppTest)",
    "app/feature_card.py:corpus": "draws into a running Streamlit page (tests/e2e, AppTest)",
    "experiments/lenses/checkpoints.py:save_checkpoint": "resume's example writes a checkpoint with it and reads it back",
    "workbench/loading/hf/opt_bloom.py:opt_tensors": "needs an OPT checkpoint (tests/integration family parity)",
    "workbench/loading/hf/opt_bloom.py:bloom_tensors": "needs a BLOOM checkpoint (tests/integration family parity)",
}


def test_every_public_function_has_an_example():
    root = Path(__file__).resolve().parents[2]
    missing = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.replace("/", ".").removesuffix(".py").startswith(NOT_COLLECTED) or path.name == "__main__.py":
                continue
            for node in ast.parse(path.read_text()).body:
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
                        and ">>>" not in (ast.get_docstring(node) or "")
                        and node.name not in NO_EXAMPLE and f"{relative}:{node.name}" not in NO_EXAMPLE):
                    missing.append(f"{relative}:{node.lineno} {node.name}")
    assert not missing, "public functions with no docstring example (add one, or a reason to NO_EXAMPLE):\n" + \
        "\n".join(missing)
