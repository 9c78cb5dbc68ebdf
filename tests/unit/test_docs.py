"""The project's own docs stay true: the generated hook table, the shape legend, the API page, links, the
README and the guides.

docs/hooks.md must equal what ``workbench.hook_table`` prints now and list exactly the hook points
its models have; its shapes are spot-checked against hand knowledge and against models of other
sizes. Every ``Legend:`` line in the code must use entries of docs/shapes.md's list verbatim.
docs/api.md must name every public function (experiments' with each parameter) and command.
Every relative link of README.md and docs/**/*.md resolves to a file (and its #anchor to a heading); the
README stays under 200 lines and links every guide.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from tests.unit.helpers import BASE, VARIANTS, make_model
from workbench import hook_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CODE_DIRS = ("workbench", "experiments", "app")


# ---- helpers ---------------------------------------------------------------------------------------
def table_rows(markdown: str) -> dict[str, tuple[list[str], str]]:
    """docs/hooks.md's rows: hook name -> (shape as a list of dimension names, models column)."""
    rows = {}
    for line in markdown.splitlines():
        match = re.match(r"^\| `([^`]+)` \| \[([^\]]*)\] \| ([^|]+) \|", line)
        if match:
            rows[match[1]] = ([d.strip() for d in match[2].split(",")], match[3].strip())
    return rows


def shape_legend(markdown: str) -> list[str]:
    """The entries of the list under '## The legend' in docs/shapes.md (each a backticked bullet)."""
    section = markdown.split("## The legend", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([^`]+)`", section, flags=re.MULTILINE)


def legend_entries(lines: list[str], start: int) -> list[str]:
    """The comma-separated entries of the ``Legend:`` line at ``start`` and its continuation lines.

    The legend continues onto the next line while the text so far ends with a comma or the next
    line is indented deeper than the legend line; it ends at a blank line, a closing quote or a
    line that does neither. A final period is allowed.
    """
    first = lines[start]
    indent = len(first) - len(first.lstrip())
    text = first.strip().removeprefix("Legend:")
    for line in lines[start + 1:]:
        stripped = line.strip()
        if not stripped or stripped.startswith(('"""', "'''")):
            break
        if not (text.rstrip().endswith(",") or len(line) - len(line.lstrip()) > indent):
            break
        text += " " + stripped
    text = text.strip().removesuffix('"""').removesuffix("'''").strip().removesuffix(".")
    return [entry.strip() for entry in text.split(",")]


def legend_lines(path: Path) -> list[tuple[int, list[str]]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(i + 1, legend_entries(lines, i)) for i, line in enumerate(lines) if line.lstrip().startswith("Legend:")]


FILES_WITH_LEGENDS = sorted(
    path for d in CODE_DIRS for path in (ROOT / d).rglob("*.py") if legend_lines(path))


@pytest.fixture(scope="module")
def reference_models():
    return hook_table.reference_models()


@pytest.fixture(scope="module")
def committed_rows():
    return table_rows((DOCS / "hooks.md").read_text(encoding="utf-8"))


# ---- hooks.md ---------------------------------------------------------------------------------------
def test_hooks_md_is_what_the_generator_prints(reference_models):
    expected = hook_table.render_markdown(hook_table.hook_table(reference_models), reference_models)
    committed = (DOCS / "hooks.md").read_text(encoding="utf-8")
    assert committed == expected, "docs/hooks.md is stale: run `python -m workbench.hook_table > docs/hooks.md`"


def test_hooks_md_says_how_to_regenerate_it():
    head = "\n".join((DOCS / "hooks.md").read_text(encoding="utf-8").splitlines()[:5])
    assert "python -m workbench.hook_table > docs/hooks.md" in head


def test_table_lists_exactly_the_hook_points_of_the_reference_models(reference_models, committed_rows):
    hook_points = {hook_table.layer_pattern(name) for model in reference_models.values() for name in model.hook_dict}
    assert set(committed_rows) - hook_points == set(), "names in docs/hooks.md that no reference model has"
    assert hook_points - set(committed_rows) == set(), "hook points missing from docs/hooks.md"


def test_reference_models_cover_every_kind_of_block(reference_models):
    cfgs = [model.cfg for model in reference_models.values()]
    assert any(c.positional == "learned" and c.normalization == "LN" and c.attn_bias and c.mlp_bias for c in cfgs)
    assert any(c.positional == "rotary" and c.normalization == "RMS" and c.gated_mlp and not c.is_moe for c in cfgs)
    assert any(c.is_moe for c in cfgs)
    assert any(c.attn_only for c in cfgs)
    assert any(c.is_latent_attention for c in cfgs) and any(c.attn_sinks for c in cfgs)
    # GQA, so K/V heads are told apart; latent attention expands keys and values for every query head
    assert all(c.n_key_value_heads < c.n_heads for c in cfgs if not c.is_latent_attention)


def test_hook_table_imports_only_the_library():
    tree = ast.parse((ROOT / "workbench" / "hook_table.py").read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert "workbench.model" in imported
    assert [m for m in imported if m.split(".")[0] in ("experiments", "app", "streamlit")] == []


@pytest.mark.parametrize("name, shape", [
    ("hook_embed", ["batch", "pos", "d_model"]),
    ("blocks.{l}.hook_resid_pre", ["batch", "pos", "d_model"]),
    ("blocks.{l}.ln1.hook_scale", ["batch", "pos", "1"]),
    ("blocks.{l}.ln1.hook_normalized", ["batch", "pos", "d_model"]),
    ("blocks.{l}.attn.hook_q", ["batch", "pos", "n_heads", "d_head"]),
    ("blocks.{l}.attn.hook_k", ["batch", "pos", "n_key_value_heads", "d_head"]),
    ("blocks.{l}.attn.hook_v", ["batch", "pos", "n_key_value_heads", "d_head"]),
    ("blocks.{l}.attn.hook_rot_k", ["batch", "pos", "n_key_value_heads", "d_head"]),
    ("blocks.{l}.attn.hook_attn_scores", ["batch", "n_heads", "pos", "key_pos"]),
    ("blocks.{l}.attn.hook_pattern", ["batch", "n_heads", "pos", "key_pos"]),
    ("blocks.{l}.attn.hook_z", ["batch", "pos", "n_heads", "d_head"]),
    ("blocks.{l}.attn.hook_result", ["batch", "pos", "n_heads", "d_model"]),
    ("blocks.{l}.mlp.hook_pre", ["batch", "pos", "d_mlp"]),
    ("blocks.{l}.mlp.hook_post", ["batch", "pos", "d_mlp"]),
    ("blocks.{l}.mlp.hook_router_logits", ["batch", "pos", "num_experts"]),
    ("blocks.{l}.mlp.hook_expert_weights", ["batch", "pos", "experts_per_token"]),
    ("blocks.{l}.mlp.hook_expert_indices", ["batch", "pos", "experts_per_token"]),
    ("ln_final.hook_scale", ["batch", "pos", "1"]),
    ("blocks.{l}.attn.hook_q_latent", ["batch", "pos", "q_lora_rank"]),
    ("blocks.{l}.attn.hook_kv_latent", ["batch", "pos", "kv_lora_rank"]),
    ("blocks.{l}.attn.hook_k_rope", ["batch", "pos", "rotary_dim"]),
    ("blocks.{l}.attn.hook_sink_weight", ["batch", "n_heads", "pos"]),
    ("blocks.{l}.mlp.hook_shared_out", ["batch", "pos", "d_model"]),
    ("blocks.{l}.mlp.shared.hook_post", ["batch", "pos", "d_shared_expert"]),
])
def test_hook_shapes_match_hand_knowledge(committed_rows, name, shape):
    assert committed_rows[name][0] == shape


@pytest.mark.parametrize("name, models", [
    ("blocks.{l}.attn.hook_pattern", "all"),
    ("blocks.{l}.attn.hook_z", "standard attention (not latent)"),
    ("blocks.{l}.attn.hook_kv_latent", "latent attention (kv_lora_rank)"),
    ("blocks.{l}.attn.hook_q_latent", "latent attention with q_lora_rank"),
    ("blocks.{l}.attn.hook_sink_weight", "attn_sinks"),
    ("blocks.{l}.mlp.hook_shared_out", "MoE with a shared expert (d_shared_expert)"),
    ("hook_pos_embed", "learned or sinusoidal positions"),
    ("blocks.{l}.attn.hook_rot_q", "rotary"),
    ("blocks.{l}.mlp.hook_router_logits", "MoE"),
    ("blocks.{l}.mlp.hook_pre_linear", "gated dense MLP"),
    ("blocks.{l}.mlp.hook_post", "dense MLP"),
    ("blocks.{l}.hook_resid_mid", "sequential blocks with an MLP"),
    ("ln_final.hook_normalized", "with a final norm (not post-norm)"),
    ("blocks.{l}.ln1.hook_normalized", "with a norm before attention (not sublayer_output)"),
    ("blocks.{l}.ln2_post.hook_normalized", "sandwich or sublayer_output norms"),
    ("ln_embed.hook_normalized", "embed_norm"),
])
def test_which_models_have_a_hook_match_hand_knowledge(committed_rows, name, models):
    assert committed_rows[name][1] == models


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_table_shapes_hold_for_models_of_other_sizes(committed_rows, variant):
    """Every hook of the unit-test models (other sizes, no KV cache) has the shape the table gives."""
    model = make_model(variant)
    batch, pos = 2, 6
    sizes = {"batch": batch, "pos": pos, "key_pos": pos, "1": 1, "d_model": BASE["d_model"],
             "n_heads": model.cfg.n_heads, "n_key_value_heads": model.cfg.n_key_value_heads,
             "d_head": BASE["d_model"] // BASE["n_heads"], "d_mlp": 4 * BASE["d_model"],
             "num_experts": model.cfg.num_experts, "experts_per_token": model.cfg.experts_per_token}
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.randint(0, BASE["d_vocab"], (batch, pos)))
    assert len(cache) > 0
    for name, tensor in cache.items():
        dims = committed_rows[hook_table.layer_pattern(name)][0]
        assert tuple(tensor.shape) == tuple(sizes[d] for d in dims), name


# ---- shapes.md and the legends in the code ---------------------------------------------------------------
def test_shape_legend_is_one_letter_per_meaning():
    entries = shape_legend((DOCS / "shapes.md").read_text(encoding="utf-8"))
    letters = [entry.split(" ", 1)[0] for entry in entries]
    assert {"B batch", "P position", "S key position", "D d_model", "G n_key_value_heads", "k experts_per_token"} <= set(entries)
    assert len(entries) == 31  # 23, then X, W, Z for SAE features (experiments.features), O, I for circuits, i, o for SAE training, Y for probes
    assert len(letters) == len(set(letters))


def test_legend_parsing_follows_wraps_and_stops_at_prose():
    lines = ['"""Mixture of experts.', "", "Legend: B batch, P position, N flattened tokens,",
             "k experts_per_token.", "Then prose, which is not part of the legend.", '"""']
    assert legend_entries(lines, 2) == ["B batch", "P position", "N flattened tokens", "k experts_per_token"]
    indented = ["    Legend: B batch, P position", "        D d_model.", "    Other text."]
    assert legend_entries(indented, 0) == ["B batch", "P position D d_model"]  # no comma: a bad entry
    assert legend_entries(['Legend: D d_model."""'], 0) == ["D d_model"]


def test_some_files_carry_a_legend():
    assert len(FILES_WITH_LEGENDS) >= 5


@pytest.mark.parametrize("path", FILES_WITH_LEGENDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_legend_uses_only_entries_of_shapes_md(path):
    allowed = set(shape_legend((DOCS / "shapes.md").read_text(encoding="utf-8")))
    bad = [(line, entry) for line, entries in legend_lines(path) for entry in entries if entry not in allowed]
    assert bad == [], f"{path.relative_to(ROOT)}: Legend entries not in docs/shapes.md: {bad}"


# ---- api.md, links, README ---------------------------------------------------------------------------
def _public_function_nodes(path: Path) -> list[ast.FunctionDef]:
    return [node for node in ast.parse(path.read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.name != "main"]


def _experiment_sections() -> dict[Path, str]:
    """Every module that may hold public experiment functions, by the api.md section documenting them:
    ``experiments/x.py`` and a package's ``experiments/x/*.py`` in ``experiments.x``, ``experiments/plots/x.py``
    in ``experiments.plots.x`` (command lines, ``experiments/cli/``, are documented as commands)."""
    sections = {}
    for path in sorted((ROOT / "experiments").rglob("[!_]*.py")):
        parts = path.relative_to(ROOT / "experiments").with_suffix("").parts
        if parts[0] != "cli":
            sections[path] = ".".join(parts[:2]) if parts[0] == "plots" else parts[0]
    return sections


EXPERIMENT_SECTIONS = _experiment_sections()
EXPERIMENT_MODULES = list(EXPERIMENT_SECTIONS)


def _public_methods(path: Path, class_name: str) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    return [node.name for node in cls.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


def test_api_md_names_every_public_function():
    import workbench

    api = (DOCS / "api.md").read_text(encoding="utf-8")
    names = (list(workbench.__all__) + _public_methods(ROOT / "workbench" / "model.py", "Decoder")
             + _public_methods(ROOT / "workbench" / "readouts.py", "ReadoutMethods"))
    for path in EXPERIMENT_MODULES:
        names += [node.name for node in _public_function_nodes(path)]
    assert len(names) > 40
    missing = sorted({n for n in names if not re.search(rf"\b{re.escape(n)}\b", api)})
    assert missing == [], f"docs/api.md does not mention: {missing}"


def _api_sections(api: str) -> dict[str, str]:
    """api.md's '### `experiments.X`' sections by module name (``plots.x`` for a figures module)."""
    parts = re.split(r"^### `experiments\.([\w.]+)`.*$", api, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n## ", 1)[0] for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("path", [p for p in EXPERIMENT_MODULES if _public_function_nodes(p)],
                         ids=lambda p: str(p.relative_to(ROOT / "experiments")))
def test_api_md_gives_each_experiment_function_its_parameters(path):
    """One bullet per public function in its module's section, naming every parameter."""
    functions = _public_function_nodes(path)
    section = _api_sections((DOCS / "api.md").read_text(encoding="utf-8")).get(EXPERIMENT_SECTIONS[path], "")
    problems = []
    for fn in functions:
        bullet = re.search(rf"^- `{fn.name}\((.*)$", section, flags=re.MULTILINE)
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        if bullet is None:
            problems.append(f"{fn.name}: no '- `{fn.name}(' line")
        elif missing := [p for p in params if not re.search(rf"\b{p}\b", bullet[1].split("`")[0])]:
            problems.append(f"{fn.name}: parameters {missing} not in its signature line")
    assert problems == [], f"docs/api.md, experiments.{EXPERIMENT_SECTIONS[path]}: {problems}"


def test_api_md_lists_every_experiment_command():
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    modules = [p.stem for p in (ROOT / "experiments").glob("[!_]*.py")
               if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8")]
    modules += [p.parent.name for p in (ROOT / "experiments").glob("*/__main__.py")]  # packages
    assert "induction" in modules
    assert [m for m in modules if f"python -m experiments.{m}" not in api] == []


@pytest.mark.parametrize("page", ["index.md", "api.md", "hooks.md", "shapes.md", "architecture.md"])
def test_relative_links_in_docs_resolve(page):
    text = (DOCS / page).read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
               if not re.match(r"[a-z]+://", t) and not t.startswith("#")]
    assert [t for t in targets if not (DOCS / t).exists()] == []


def test_index_links_every_page():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in ("api.md", "hooks.md", "shapes.md", "architecture.md"):
        assert f"]({page})" in index
    for guide in GUIDES:
        assert f"](guides/{guide})" in index


# ---- README and the guides ---------------------------------------------------------------------------
GUIDES = ("models-and-hooks.md", "dictionaries.md", "graphs.md", "circuits.md", "dashboard.md",
          "coming-from-transformerlens.md", "performance.md")
MARKDOWN_PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def without_code(markdown: str) -> str:
    """The text outside fenced code blocks (a ``#`` or ``](`` inside code is neither a heading nor a link)."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation but '-' and '_' dropped, spaces
    as '-', a repeated anchor numbered -1, -2, ..."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_code(markdown), flags=re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(anchor, 0)
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return anchors


def test_heading_anchors_follow_githubs_rule():
    page = "# API\n## `experiments.sae` (training SAEs)\n### Coming from TransformerLens\n## API\n```\n# not one\n```"
    assert heading_anchors(page) == {"api", "experimentssae-training-saes", "coming-from-transformerlens", "api-1"}


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_anchor(page):
    """Every relative link (and image) of README.md and docs/**/*.md names an existing file, and its #anchor, if
    any, a heading of that file (a bare #anchor: of the page itself)."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and (linked.suffix != ".md" or anchor not in heading_anchors(linked.read_text(encoding="utf-8"))):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: links that do not resolve: {broken}"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 200


def test_readme_gives_the_two_commands_and_links_every_guide():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make run" in readme and "make test" in readme
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run:", makefile, flags=re.MULTILINE) and re.search(r"^test:", makefile, flags=re.MULTILINE)
    assert [g for g in GUIDES if f"](docs/guides/{g}" not in readme] == []
    assert "](docs/api.md)" in readme


@pytest.mark.parametrize("guide", GUIDES)
def test_each_guide_exists_and_links_the_reference(guide):
    text = (DOCS / "guides" / guide).read_text(encoding="utf-8")
    assert text.startswith("# ")
    assert "](../api.md" in text


def test_the_architecture_table_in_the_guide_is_the_supported_table_row_for_row():
    """The table of every architecture lives in the models guide (it left the README): the same rows, in order,
    as ``wb.supported_architectures()``."""
    import workbench as wb

    guide = (DOCS / "guides" / "models-and-hooks.md").read_text(encoding="utf-8")
    cells = [[cell.strip().strip("`") for cell in line.strip("|").split("|")]
             for line in guide.splitlines() if line.startswith(("| HF directory | `", "| GGUF | `"))]
    table = wb.supported_architectures()
    assert [tuple(row[:3]) for row in cells] == list(zip(table.format, table.architecture, table.model_type))


def test_readme_links_docs_and_not_the_shared_design_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/" in readme
    assert "../shared/DESIGN.md" not in readme
    assert "DESIGN.md" not in readme
