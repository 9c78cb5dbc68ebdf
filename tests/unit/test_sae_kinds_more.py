"""SAEs in SAELens's deepseek_r1, qwen_scope, goodfire, connor_rob_hook_z and sparsify layouts, and any Hub repo's
folder (``wb.load_sae("org/repo", folder=...)``), served by the fake hub.

Expected values: tests/fixtures/sae_kinds/make_more.py, in which SAELens 6.54.12 reads the same tiny repos from the
fake hub (``SAE.from_pretrained`` of a test-only release) and writes its encode/decode outputs and ``cfg.to_dict()``;
for sparsify, whose file SAELens's own loader cannot build (it transposes ``W_dec``), sparsify's arithmetic by hand,
checked there against SAELens's top-k SAE; SAELens's config getters for the real registry's SAEs of three kinds;
the SAELens-layout folder is SAELens's own fixture (tests/fixtures/sae/jumprelu).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.hub_server import files_of, hub  # noqa: F401  (the fixture)
from workbench.hub import sae_releases
from workbench.sae.foreign.deepseek_qwen import deepseek_r1_config, qwen_scope_config
from workbench.sae.foreign.goodfire import goodfire_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae_kinds"
SAE_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sae"
RELEASE_CASES = ("ds_r1", "qwen_scope", "goodfire_l19", "hookz_connor_rob")
# The SAE files each case's load must fetch (and nothing else).
FETCHED = {"ds_r1": {"DeepSeek-R1-Distill-Llama-8B-SAE-l19.pt"}, "qwen_scope": {"layer3.sae.pt"},
           "goodfire_l19": {"Llama-3.1-8B-Instruct-SAE-l19.pth"},
           "hookz_connor_rob": {"gpt2-small_L0_Hcat_z_lr1.20e-03_l11.80e+00_tiny_v9.pt",
                                "gpt2-small_L0_Hcat_z_lr1.20e-03_l11.80e+00_tiny_v9_cfg.json"}}
SPARSIFY = json.loads((FIXTURES / "sparsify_layers" / "case.json").read_text())


def record(case: str) -> dict:
    return json.loads((FIXTURES / case / "case.json").read_text())


@pytest.fixture
def kinds_hub(hub, monkeypatch):  # noqa: F811
    """Each case's tiny repo on the fake hub, its release in a test-only registry."""
    table = {}
    for case in RELEASE_CASES:
        row = record(case)["row"]
        hub.add(row["repo_id"], files_of(FIXTURES / case / "repo"))
        table[record(case)["release"]] = row
    hub.add(SPARSIFY["repo_id"], files_of(FIXTURES / "sparsify_layers" / "repo"))
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    return hub


def fetched_files(fake) -> set[str]:
    return {r.path.split("/resolve/main/", 1)[-1] for r in fake.file_requests("GET")}


def assert_matches_saelens(sae: wb.SAE, case: str, saelens_cfg: dict) -> None:
    expected = load_file(str(FIXTURES / case / "expected.safetensors"))
    with torch.no_grad():
        features = sae.encode(expected["x"])
        torch.testing.assert_close(features, expected["encode"], atol=1e-5, rtol=0)
        torch.testing.assert_close(sae.decode(features), expected["decode"], atol=1e-5, rtol=0)
    ours = sae.cfg.to_dict()
    for name in ("architecture", "d_in", "d_sae", "dtype", "device", "apply_b_dec_to_input", "normalize_activations",
                 "reshape_activations", "k", "rescale_acts_by_decoder_norm"):
        assert ours.get(name) == saelens_cfg.get(name), name
    for key, value in saelens_cfg["metadata"].items():
        if key != "sae_lens_version":  # SAELens stamps its own version on every config it builds
            assert sae.cfg.metadata[key] == value, key


@pytest.mark.parametrize("case", RELEASE_CASES)
def test_each_kind_loads_from_its_release_as_saelens_reads_it(kinds_hub, case):
    saved = record(case)
    sae = wb.load_sae(saved["release"], saved["sae_id"])
    assert_matches_saelens(sae, case, saved["saelens_cfg"])
    assert fetched_files(kinds_hub) == FETCHED[case]


def test_qwen_scopes_width_and_k_come_from_the_repo_id(kinds_hub):
    sae = wb.SAE.from_pretrained("tiny-qwen_scope", "layer3")  # Qwen/SAE-Res-Qwen3-1.7B-Base-W1K-L0_4
    assert (sae.cfg.architecture(), sae.cfg.d_sae, sae.cfg.k, sae.cfg.d_in) == ("topk", 1024, 4, 8)
    assert sae.cfg.metadata.hf_hook_name == "model.layers.3"


def test_a_hook_z_sae_reads_heads_and_writes_them_back(kinds_hub):
    sae = wb.load_sae("tiny-hookz_connor_rob", "blocks.0.hook_z")
    x = load_file(str(FIXTURES / "hookz_connor_rob" / "expected.safetensors"))["x"]  # [batch, heads, d_head]
    with torch.no_grad():
        assert sae(x).shape == x.shape
    assert sae.cfg.metadata.hook_name == "blocks.0.attn.hook_z" and sae.cfg.reshape_activations == "hook_z"


@pytest.mark.parametrize("case, ours", [("ds_r1", lambda row: deepseek_r1_config(row["path"])),
                                        ("qwen_scope", lambda row: qwen_scope_config(row["repo_id"], row["path"])),
                                        ("goodfire_l19", lambda row: goodfire_config(row["repo_id"], row["path"]))])
def test_the_registrys_saes_get_saelens_configs_from_their_names(case, ours):
    rows = json.loads((FIXTURES / case / "configs.json").read_text())
    assert rows
    for row in rows:
        assert ours(row) == row["cfg"], (row["release"], row["sae_id"])
        release, entry = sae_releases.lookup(row["release"], row["sae_id"])  # the packaged registry agrees
        assert (release["repo_id"], entry["path"]) == (row["repo_id"], row["path"])


def test_a_sparsify_folder_loads_with_sparsifys_arithmetic(kinds_hub):
    sae = wb.load_sae(SPARSIFY["repo_id"], folder=SPARSIFY["folder"])
    assert_matches_saelens(sae, "sparsify_layers", SPARSIFY["saelens_cfg"])
    # SAELens's loader config differs only where sparsify centres every input (SAELens: not normalize_decoder)
    loader = SPARSIFY["saelens_loader_cfg"]
    assert {**loader, "apply_b_dec_to_input": True, "metadata": None} == \
           {**{k: v for k, v in SPARSIFY["saelens_cfg"].items() if k in loader}, "metadata": None}
    assert "size mismatch for W_dec" in SPARSIFY["saelens_from_pretrained_error"]
    assert fetched_files(kinds_hub) == {"layers.1/cfg.json", "layers.1/sae.safetensors", "config.json"}


def test_a_cached_folder_loads_offline(kinds_hub, monkeypatch):
    online = wb.load_sae(SPARSIFY["repo_id"], folder="layers.1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = wb.load_sae(SPARSIFY["repo_id"], folder="layers.1/")
    assert torch.equal(offline.W_dec, online.W_dec) and offline.cfg.metadata.model_name == "EleutherAI/pythia-70m"


def test_a_saelens_folder_of_any_repo_loads_as_the_local_directory(hub):  # noqa: F811
    hub.add("someone/saes", {f"runs/l0/{name}": data for name, data in files_of(SAE_FIXTURES / "jumprelu").items()
                             if name in ("cfg.json", "sae_weights.safetensors")} | {"README.md": b"#"})
    sae = wb.load_sae("someone/saes", folder="runs/l0", revision="main")
    local = wb.load_sae(SAE_FIXTURES / "jumprelu")
    expected = load_file(str(SAE_FIXTURES / "jumprelu" / "expected.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(expected["x"]), expected["encode"], atol=1e-5, rtol=0)
    assert torch.equal(sae.W_enc, local.W_enc) and sae.cfg.to_dict() == local.cfg.to_dict()


def test_a_folder_with_neither_layout_names_the_repo_folder_and_contents(hub):  # noqa: F811
    hub.add("someone/mixed", {"l0/params.npz": b"x", "l0/notes.txt": b"y", "l1/cfg.json": b"{}"})
    with pytest.raises(wb.CheckpointError, match=r"someone/mixed \(revision 'main'\): folder 'l0' holds neither a "
                                                 r"SAELens SAE .* nor a sparsify SAE .*\['notes.txt', 'params.npz'\]"):
        wb.load_sae("someone/mixed", folder="l0")
    with pytest.raises(wb.CheckpointError, match="folder 'l1' holds neither"):  # cfg.json without weights
        wb.load_sae("someone/mixed", folder="l1")
    assert hub.file_requests("GET") == []


@pytest.mark.parametrize("k", [0, 17, "4", None])
def test_a_sparsify_config_with_a_bad_k_is_refused_naming_it(hub, k):  # noqa: F811
    files = files_of(FIXTURES / "sparsify_layers" / "repo")
    cfg = json.loads(files["layers.1/cfg.json"])
    cfg["k"] = k
    hub.add("someone/sparsify", files | {"layers.1/cfg.json": json.dumps(cfg).encode()})
    with pytest.raises(wb.ConfigError, match=rf"layers.1/cfg.json: field 'k' must be an integer from 1 to "
                                             rf"num_latents=16, got {k!r}"):
        wb.load_sae("someone/sparsify", folder="layers.1")


@pytest.mark.parametrize("field, value", [("signed", True), ("transcode", True), ("activation", "groupmax")])
def test_a_sparsify_coder_that_is_not_a_plain_top_k_sae_is_refused(hub, field, value):  # noqa: F811
    files = files_of(FIXTURES / "sparsify_layers" / "repo")
    cfg = json.loads(files["layers.1/cfg.json"]) | {field: value}
    hub.add("someone/sparsify", files | {"layers.1/cfg.json": json.dumps(cfg).encode()})
    with pytest.raises(wb.ConfigError, match=f"field '{field}' is {value!r}; only a plain top-k SAE is loaded"):
        wb.load_sae("someone/sparsify", folder="layers.1")


def test_a_sparsify_folder_that_names_no_residual_hook_is_refused(hub):  # noqa: F811
    files = {name.replace("layers.1", "layers.1.mlp"): data
             for name, data in files_of(FIXTURES / "sparsify_layers" / "repo").items()}
    hub.add("someone/sparsify", files)
    with pytest.raises(wb.ConfigError, match="named layers.<N> .* or embed_tokens, got 'layers.1.mlp'"):
        wb.load_sae("someone/sparsify", folder="layers.1.mlp")


class _Touch:
    """Unpickled, it would create ``path`` (a harmless stand-in for code run by a hostile pickle)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_hostile_pt_file_is_refused_unrun(kinds_hub, tmp_path):
    sentinel = tmp_path / "ran"
    hostile = tmp_path / "hostile.pt"
    torch.save({"encoder.weight": _Touch(sentinel)}, hostile)
    row = record("ds_r1")["row"]
    kinds_hub.add(row["repo_id"], {row["saes"][0]["path"]: hostile.read_bytes()})
    with pytest.raises(wb.CheckpointError, match="not a readable weights-only torch file"):
        wb.load_sae("tiny-ds_r1", "blocks.19.hook_resid_post")
    assert not sentinel.exists()


def test_a_pt_file_missing_a_tensor_names_it(kinds_hub, tmp_path):
    row = record("goodfire_l19")["row"]
    path = tmp_path / "partial.pt"
    torch.save({"encoder_linear.weight": torch.ones(16, 8)}, path)
    kinds_hub.add(row["repo_id"], {row["saes"][0]["path"]: path.read_bytes()})
    with pytest.raises(wb.CheckpointError, match="missing 'encoder_linear.bias', 'decoder_linear.weight'"):
        wb.load_sae("tiny-goodfire_l19", "layer_19")


def test_a_goodfire_repo_saelens_does_not_know_is_refused_before_any_download(kinds_hub, monkeypatch):
    table = dict(sae_releases.releases())
    table["tiny-other-goodfire"] = {"repo_id": "Goodfire/Other-SAE", "model": "x", "conversion": "goodfire",
                                    "saes": [{"id": "l0", "path": "other.pt"}]}
    monkeypatch.setattr(sae_releases, "_RELEASES", table)
    with pytest.raises(wb.ConfigError, match="Goodfire/Other-SAE/other.pt: not a Goodfire SAE SAELens knows"):
        wb.load_sae("tiny-other-goodfire", "l0")
    assert kinds_hub.file_requests("GET") == []


def test_folder_arguments_are_checked_before_the_hub_is_asked(hub):  # noqa: F811
    with pytest.raises(wb.InputError, match="sae_id or a repo's folder=, not both"):
        wb.load_sae("someone/saes", "l0", folder="l0")
    with pytest.raises(wb.InputError, match="revision= is for a Hub repo's folder"):
        wb.load_sae("someone/saes", revision="main")
    with pytest.raises(wb.InputError, match="no '..', not absolute"):
        wb.load_sae("someone/saes", folder="../up")
    assert hub.requests == []


def test_a_missing_repo_is_an_error_naming_it(hub):  # noqa: F811
    with pytest.raises(wb.CheckpointError, match="someone/no-such-repo"):
        wb.load_sae("someone/no-such-repo", folder="layers.1")


def test_sparsify_names_embed_tokens_and_a_zero_num_latents_as_sparsify_does():
    from workbench.sae.foreign.sparsify import sparsify_config

    cfg = sparsify_config({"d_in": 8, "num_latents": 0, "expansion_factor": 2, "k": 3}, {}, "org/sae-tiny",
                          "embed_tokens", "cfg.json")
    # hand-worked: num_latents 0 means d_in * expansion_factor (sparsify's SparseCoder); no run config: the repo name
    assert (cfg["hook_name"], cfg["d_sae"], cfg["model_name"], cfg["context_size"]) == ("hook_embed", 16, "sae-tiny", 2048)
    nested = sparsify_config({"d_in": 8, "num_latents": 16, "k": 3}, {}, "org/sae-tiny", "run-a/layers_7", "cfg.json")
    assert (nested["hook_name"], nested["model_name"]) == ("blocks.7.hook_resid_post", "run-a")
