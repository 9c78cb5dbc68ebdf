"""The one artifact picker (``app.artifact_picker``) and holder (``app.results.artifacts``): what it offers for
the open model (the shipped rows of ``wb.shipped``), that a path from a link is read only after a click, that a
load error is quoted, and that an artifact is loaded once per process and again when its files change."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import workbench as wb
from app.artifact_picker import A_PATH, PICKERS, Pick, picked_path
from app.results.artifacts import artifact_choices, files_stamp, load_artifact
from app.state import LoadedModel

SHIPPED = {"toy-attn-2l-resid1-topk (blocks.1.hook_resid_post)": Path("/zoo/toy-attn-2l/saes/toy-attn-2l-resid1-topk")}


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel(wb.load_model("toy-attn-2l", progress=False).eval(), "toy-attn-2l|sdpa")


def test_a_shipped_choice_opens_its_folder_and_a_path_waits_for_the_click_that_opened_it():
    label = next(iter(SHIPPED))
    assert picked_path(SHIPPED, label, "/typed/but/ignored", None) == Pick(str(SHIPPED[label]), "shipped")
    assert picked_path(SHIPPED, A_PATH, "", None) == Pick(None, "enter")
    assert picked_path(SHIPPED, A_PATH, "/from/a/link", None) == Pick(None, "confirm")
    assert picked_path(SHIPPED, A_PATH, "/from/a/link", "/another/path") == Pick(None, "confirm")
    assert picked_path(SHIPPED, A_PATH, " /opened ", "/opened") == Pick("/opened", "open")


def test_the_choices_are_the_tables_rows_for_the_open_model(loaded):
    saes = wb.shipped(kind="sae", model="toy-attn-2l")
    assert artifact_choices(loaded, "sae") == {f"{row.name} ({row.hook_name})": Path(row.path)
                                               for row in saes.itertuples()}
    moe = LoadedModel(wb.load_model("toy-moe-2l", progress=False).eval(), "toy-moe-2l|sdpa")
    transcoders = wb.shipped(kind="transcoders", model="toy-moe-2l")
    assert artifact_choices(moe, "transcoders") == {row.name: Path(row.path) for row in transcoders.itertuples()}
    # A tuned lens is an artifact too: SmolLM2's, by the name the model was opened by (a toy model stands in).
    smol_named = LoadedModel(loaded.model, "smollm2-135m|sdpa")
    lenses = wb.shipped(kind="lens", model="smollm2-135m")
    assert artifact_choices(smol_named, "lens") == {row.name: Path(row.path) for row in lenses.itertuples()}
    assert artifact_choices(loaded, "lens") == {}
    with pytest.raises(wb.InputError, match="kind must be one of"):
        artifact_choices(loaded, "model")


def test_an_artifact_is_loaded_once_and_again_when_its_files_change(loaded, tmp_path):
    folder = tmp_path / "sae"
    wb.load_sae("toy-attn-2l-resid1-topk").save(folder)
    first = load_artifact(loaded, "sae", str(folder))
    assert load_artifact(loaded, "sae", str(folder)) is first
    assert first.artifact.cfg.hook_name == "blocks.1.hook_resid_post"
    stamp = files_stamp(str(folder))
    (folder / "cfg.json").write_text((folder / "cfg.json").read_text() + " ")
    assert files_stamp(str(folder)) != stamp
    again = load_artifact(loaded, "sae", str(folder))
    assert again is not first and again.key != first.key


def _picker_page(kind: str) -> None:
    import streamlit as st

    from app.artifact_picker import open_artifact
    from app.results import load_model

    held = open_artifact(load_model("toy-attn-2l", "sdpa"), kind)
    st.write(f"opened {held.kind} {held.path}" if held is not None else "nothing opened")


def _run(kind: str, **params: str) -> AppTest:
    at = AppTest.from_function(_picker_page, args=(kind,), default_timeout=120)
    for key, value in params.items():
        at.query_params[key] = value
    return at.run()


def test_the_picker_offers_the_shipped_sae_first_and_opens_it():
    at = _run("sae")
    text = PICKERS["sae"]
    box = at.selectbox(key=text.key)
    assert box.label == "SAE" and box.options == ["toy-attn-2l-resid1-topk (blocks.1.hook_resid_post)", A_PATH]
    assert [m.value for m in at.markdown] == [f"opened sae {wb.shipped(kind='sae', model='toy-attn-2l').path[0]}"]


def test_a_path_from_a_link_is_read_only_after_the_click_and_its_error_is_quoted(tmp_path):
    missing = str(tmp_path / "missing")
    at = _run("transcoders", attribution_tc_source=A_PATH, attribution_tc_path=missing)
    assert any("are read only when you open them" in info.value for info in at.info)
    assert [m.value for m in at.markdown] == ["nothing opened"] and not at.error
    at.button(key="attribution_open_tc").click().run()
    assert [e.value for e in at.error] and at.error[0].value.startswith("Could not load the transcoders at ")
    assert "no such file or directory" in at.error[0].value
    empty = _run("sae", features_sae_source=A_PATH)
    assert any("Enter the directory of an SAE" in info.value for info in empty.info)
