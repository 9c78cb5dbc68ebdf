"""The package structure: layers only look down, no import cycles, no import-time side effects.

Data flows one way: loading -> model -> experiments -> app. ``workbench`` never imports
``experiments`` or ``app``; ``experiments`` never imports ``app`` or Streamlit. Imports are read
from the source (every ``import`` statement, including those inside functions, which run just
as surely, only later); only imports under ``if TYPE_CHECKING:`` are left out, since they never run, and
those under ``if __name__ == "__main__":``, which run under another module name.

The model knows no dictionary: nothing ``workbench.model`` imports when it is loaded reaches ``workbench.sae`` or
``workbench.transcoders``; its SAELens methods (``workbench.sae_splicing``) import the dictionary package only when
called, and splicing itself (``workbench.sae.splicing``) works over the model's public hook surface.

Experiments and the app use the model's public surface only: no ``workbench.components`` import in
any form (anywhere, ``TYPE_CHECKING`` included: a type named after a component is still a dependency on
its internals) and no ``.blocks`` access (``model.blocks[0].mlp``, ``getattr(model, "blocks")``); what
they need of a layer the model offers (``workbench.readouts``, ``workbench.weights_api``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("workbench", "experiments", "app")
SURFACE_USERS = ("experiments", "app")  # the packages held to the model's public surface
COMPONENTS = "workbench.components"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _never_imported_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (never run) or ``if __name__ == "__main__":`` (run only when the file is
    the program, under the name ``__main__``: ``python -m experiments.lens`` importing ``experiments.cli.lens``,
    which imports ``experiments.lens``, is no cycle)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ("TYPE_CHECKING" in ast.unparse(node.test)
                                         or ast.unparse(node.test) == "__name__ == '__main__'"):
            inside |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
    return inside


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module name ``path`` imports (our modules by their full name, others by their top-level name)."""
    return imports_in(ast.parse(path.read_text()), modules)


def imports_in(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """``imports_of`` for a parsed module."""
    skip = _never_imported_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` imports the module
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
    return {name if name in modules or name.split(".")[0] in PACKAGES else name.split(".")[0] for name in found}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def test_the_reader_sees_imports_inside_functions_and_skips_type_checking_and_main_ones(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    import app.state\n"
                      "def f():\n    from experiments import ablation\n    import streamlit as st\n"
                      "if __name__ == '__main__':\n    from experiments.cli import lens\n")
    modules = {"experiments.ablation": Path("x"), "app.state": Path("y")}
    assert imports_of(source, modules) == {"typing", "os", "experiments.ablation", "streamlit"}


def test_layers_only_look_down(graph):
    forbidden = {"workbench": ("experiments", "app", "streamlit"), "experiments": ("app", "streamlit")}
    wrong = [(module, target) for module, targets in graph.items() for target in targets
             for layer, banned in forbidden.items()
             if module.split(".")[0] == layer and target.split(".")[0] in banned]
    assert not wrong, f"imports against the layering (module, what it imports): {wrong}"


# Imports inside a function, run when it is called, that close a loop on purpose; each with its reason.
CALL_TIME_IMPORTS = {
    # SAELens's constructor SAE.from_pretrained calls the reader, which builds SAEs of workbench.sae.model
    ("workbench.sae.model", "workbench.sae.files"),
    # SAELens's mwhanna and mntss-CLT kinds are circuit-tracer layer files, converted by the one converter from
    # circuit-tracer's layout (workbench.transcoders.layout), which builds SAEs of workbench.sae
    ("workbench.sae.foreign.transcoders", "workbench.transcoders.layout"),
}


def test_no_import_cycles(graph):
    ours = {name: {t for t in targets if t in graph and t != name and (name, t) not in CALL_TIME_IMPORTS}
            for name, targets in graph.items()}
    # A package's __init__ runs before its submodules, so "pkg.sub imports pkg" is no cycle of ours to
    # avoid; only edges between real modules count (an __init__ that imports a submodule is one).
    visiting, done, cycles = [], set(), []

    def visit(name: str) -> None:
        visiting.append(name)
        for target in sorted(ours[name]):
            if target in visiting:
                cycles.append(visiting[visiting.index(target):] + [target])
            elif target not in done:
                visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(ours):
        if name not in done:
            visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_importing_the_library_and_experiments_changes_no_global_state():
    probe = ("import json, os, sys, torch\n"
             "before = (dict(os.environ), torch.get_num_threads())\n"
             "import workbench, workbench.train, workbench.cli, workbench.kernels, workbench.hook_table\n"
             "import experiments.ablation, experiments.attention, experiments.detectors, experiments.heads\n"
             "import experiments.induction, experiments.lens, experiments.patching, experiments.router\n"
             "import experiments.zoo, experiments._cli\n"
             "after = (dict(os.environ), torch.get_num_threads())\n"
             "print(json.dumps({'environ': sorted(set(after[0].items()) ^ set(before[0].items())),"
             " 'threads': [before[1], after[1]]}))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    changes = json.loads(done.stdout.strip().splitlines()[-1])
    assert changes["environ"] == [] and changes["threads"][0] == changes["threads"][1], changes


DICTIONARIES = ("workbench.sae", "workbench.transcoders")


def load_time_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules ``path`` imports when it is loaded: ``imports_of`` less the imports inside functions."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # a function's imports run when it is called, not when the module loads
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = [ast.Pass()]
    return {name for name in imports_in(tree, modules) if name in modules}


def _is_dictionary(module: str) -> bool:
    return any(module == package or module.startswith(package + ".") for package in DICTIONARIES)


def test_the_model_knows_no_dictionary():
    modules = _modules()

    def closure(imports) -> set[str]:
        reached, todo = set(), ["workbench.model"]
        while todo:
            module = todo.pop()
            if module in reached or module == "workbench" or _is_dictionary(module):  # __init__ exports everything
                continue
            reached.add(module)
            todo.extend(name for name in imports(modules[module], modules) if name in modules)
        return reached

    loaded = closure(load_time_imports)
    assert not [m for m in loaded if any(_is_dictionary(t) for t in load_time_imports(modules[m], modules))], \
        "modules the model loads import a dictionary package when loaded"
    lazy = sorted(m for m in closure(imports_of) if any(_is_dictionary(t) for t in imports_of(modules[m], modules)))
    assert lazy == ["workbench.sae_splicing"], f"only the forwarding layer may import the dictionary package: {lazy}"


def _names_components(module: str) -> bool:
    return module == COMPONENTS or module.startswith(COMPONENTS + ".")


def _constant_arg(call: ast.Call, index: int):
    return call.args[index].value if len(call.args) > index and isinstance(call.args[index], ast.Constant) else None


def surface_breaches(path: Path) -> list[str]:
    """Where ``path`` imports ``workbench.components`` or reads ``.blocks``: "line N: what", in source order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        what = None
        if isinstance(node, ast.Import):
            what = next((f"import {a.name}" for a in node.names if _names_components(a.name)), None)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _names_components(node.module) or any(_names_components(f"{node.module}.{a.name}") for a in node.names):
                what = f"from {node.module} import ..."
        elif isinstance(node, ast.Attribute) and node.attr == "blocks":
            what = f"{ast.unparse(node)} (.blocks)"
        elif isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called == "getattr" and _constant_arg(node, 1) == "blocks":
                what = f"{ast.unparse(node)} (.blocks)"
            elif (called.endswith(("import_module", "__import__")) and isinstance(_constant_arg(node, 0), str)
                  and _names_components(_constant_arg(node, 0))):
                what = f"{called}({_constant_arg(node, 0)!r})"
        if what:
            found.append((node.lineno, what))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def _breaches_under(root: Path) -> dict[str, list[str]]:
    files = [path for package in SURFACE_USERS for path in sorted((root / package).rglob("*.py"))]
    return {str(path.relative_to(root)): found for path in files if (found := surface_breaches(path))}


def _assert_surface_only(root: Path) -> None:
    breaches = _breaches_under(root)
    assert not breaches, ("experiments and the app must use the model's public surface (workbench.readouts, "
                          "workbench.weights_api, hook points), not its components: " + json.dumps(breaches, indent=1))


def test_experiments_and_the_app_use_only_the_models_public_surface():
    _assert_surface_only(ROOT)


@pytest.mark.parametrize("planted, expected", [
    ("def width(model):\n    return model.blocks[0].mlp.W_out.shape[0]\n", "model.blocks (.blocks)"),
    ("def acts():\n    from workbench.components.mlp import ACTIVATIONS\n    return ACTIVATIONS\n",
     "from workbench.components.mlp import ..."),
    ("from workbench import components\n", "from workbench import ..."),
    ("import workbench.components.moe as moe\n", "import workbench.components.moe"),
    ("import importlib\nmoe = importlib.import_module('workbench.components.moe')\n",
     "importlib.import_module('workbench.components.moe')"),
    ("def layers(model):\n    return len(getattr(model, 'blocks'))\n", "getattr(model, 'blocks') (.blocks)"),
])
def test_the_surface_check_fails_on_a_planted_experiment(tmp_path, planted, expected):
    for package in SURFACE_USERS:
        (tmp_path / package).mkdir()
    (tmp_path / "experiments" / "fine.py").write_text("def n_layers(model):\n    return model.cfg.n_layers\n"
                                                      "NAME = 'blocks.0.mlp.hook_post'\n")
    _assert_surface_only(tmp_path)  # a module that keeps to the surface passes (hook names are strings)
    module = tmp_path / "experiments" / "planted.py"
    module.write_text(planted)
    with pytest.raises(AssertionError) as failure:
        _assert_surface_only(tmp_path)
    assert "experiments/planted.py" in str(failure.value) and expected in str(failure.value)
    module.unlink()
    assert not module.exists()
    _assert_surface_only(tmp_path)  # and once it is removed, the check passes again
