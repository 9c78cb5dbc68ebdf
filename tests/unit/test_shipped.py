"""The one table of shipped artifacts (``wb.shipped``): what it lists, that each row opens by its name or path,
and that a lookup never leaves the zoo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.errors import CheckpointError, InputError
from workbench.loading.registry import REGISTRY, ZOO
from workbench.shipped import artifacts, find_shipped


def _card_title(folder: Path) -> str:
    return (folder / "CARD.md").read_text().splitlines()[0].split(":", 1)[1].strip()


def test_the_table_lists_every_registered_model_and_every_zoo_folder_with_its_card():
    table = wb.shipped()
    assert list(table.columns[:5]) == ["name", "kind", "model", "description", "path"]
    models = table[table.kind == "model"]
    assert models.name.tolist() == list(REGISTRY)
    assert models.description.tolist() == [entry.description for entry in REGISTRY.values()]
    on_disk = sorted((folder.parents[1].name, folder.parent.name, folder.name)
                     for sub in ("saes", "transcoders", "lenses") for folder in ZOO.glob(f"*/{sub}/*/"))
    rows = table[table.kind != "model"]
    assert sorted(zip(rows.model, rows.kind.map({"sae": "saes", "transcoders": "transcoders", "lens": "lenses"}), rows.name)) == on_disk
    for row in rows.itertuples():
        assert row.description == _card_title(Path(row.path)) and row.description
        assert Path(row.path).resolve().is_relative_to(ZOO.resolve())


def test_the_table_filters_by_kind_and_model():
    assert wb.shipped(kind="sae", model="toy-attn-2l").name.tolist() == ["toy-attn-2l-resid1-topk"]
    assert wb.shipped(kind="transcoders").name.tolist() == ["smollm2-135m-skip-transcoders", "toy-moe-2l-clt",
                                                            "toy-moe-2l-skip-transcoders"]
    assert wb.shipped(model="no-such-model").empty
    assert wb.shipped(kind="lens").name.tolist() == ["gemma-3-270m-tuned-lens", "smollm2-135m-tuned-lens"]  # tuned-lens 0.2's
    with pytest.raises(InputError, match="kind must be one of"):
        wb.shipped(kind="saes")


def test_each_kind_with_a_loader_opens_a_row_by_its_name_or_path():
    for row in wb.shipped(kind="model").itertuples():
        if row.path and row.name.startswith("toy-"):
            assert wb.load_model(row.name, progress=False).cfg.model_name == row.name
    for row in wb.shipped(kind="sae").itertuples():
        sae = wb.load_sae(row.name)
        assert (sae.cfg.hook_name, sae.cfg.d_sae) == (row.hook_name, row.d_sae)
        assert find_shipped(row.name) == Path(row.path)
    for row in wb.shipped(kind="transcoders").itertuples():
        assert wb.load_transcoders(row.path).n_layers == wb.loading.model_config(row.model).n_layers
        assert find_shipped(row.name, "transcoders") == Path(row.path)


def test_shipped_saes_is_the_tables_dictionary_rows():
    old = wb.shipped_saes()
    table = wb.shipped()
    dictionaries = table[table.kind.isin(["sae", "transcoders"])]
    assert old.name.tolist() == dictionaries.name.tolist()
    assert old.columns.tolist() == ["name", "kind", "model", "hook_name", "architecture", "d_sae", "path"]


@pytest.mark.parametrize("name", ["../toy-attn-2l", "saes/toy-attn-2l-resid1-topk", "..", "a\\b", "", "*", None, 3])
def test_a_name_that_is_not_plain_is_refused(name):
    with pytest.raises(CheckpointError, match="not the name of a shipped artifact"):
        find_shipped(name)


def _sae_folder(folder: Path, hook: str = "blocks.0.hook_resid_post") -> Path:
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(json.dumps({"architecture": "standard", "d_in": 4, "d_sae": 8,
                                                 "metadata": {"hook_name": hook}}))
    (folder / "CARD.md").write_text(f"# {folder.name}: a test SAE\n\nmore\n")
    return folder


def test_an_entry_linked_out_of_the_zoo_is_left_out_of_the_table_and_refused_by_name(tmp_path):
    zoo = tmp_path / "zoo"
    inside_zoo = _sae_folder(zoo / "m" / "saes" / "kept")
    outside = _sae_folder(tmp_path / "elsewhere" / "linked")
    (zoo / "m" / "saes" / "linked").symlink_to(outside, target_is_directory=True)
    assert [(row.name, row.description, row.hook_name, row.d_sae) for row in artifacts(zoo)] == \
        [("kept", "a test SAE", "blocks.0.hook_resid_post", 8)]
    assert find_shipped("kept", "sae", zoo) == inside_zoo
    with pytest.raises(CheckpointError, match="resolves outside the zoo"):
        find_shipped("linked", "sae", zoo)


def test_a_card_or_config_linked_out_of_its_folder_is_not_read(tmp_path):
    zoo = tmp_path / "zoo"
    folder = _sae_folder(zoo / "m" / "saes" / "s")
    (folder / "CARD.md").unlink()
    secret = tmp_path / "secret.md"
    secret.write_text("# s: read through a link\n")
    (folder / "CARD.md").symlink_to(secret)
    assert [row.description for row in artifacts(zoo)] == [""]


def test_a_shipped_transcoder_set_loads_by_its_name_as_by_its_path():
    for row in wb.shipped(kind="transcoders").itertuples():
        by_name, by_path = wb.load_transcoders(row.name), wb.load_transcoders(row.path)
        assert by_name.n_layers == by_path.n_layers and by_name.d_transcoder == by_path.d_transcoder
        assert all(torch.equal(a, b) for a, b in zip(by_name.state_dict().values(), by_path.state_dict().values()))
    with pytest.raises(CheckpointError, match="no such file"):
        wb.load_transcoders("no-such-transcoders")
