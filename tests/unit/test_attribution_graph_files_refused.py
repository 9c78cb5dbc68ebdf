"""Saved attribution graphs and viewer files are written atomically inside their folder and read only after what
they declare is checked: a tampered graph.json or graph.safetensors (sizes, indices, links out of the folder) is a
``CheckpointError`` naming the file and the field, before anything is allocated or indexed."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import experiments.attribution.graph as graph_module
from experiments.attribution import AttributionGraph, write_graph_files
from workbench.errors import CheckpointError, InputError
from tests.unit.tensor_reads import count_tensor_reads


def small_graph(n_active: int = 2, n_logits: int = 1) -> AttributionGraph:
    """Two layers, two positions, ``n_active`` features all selected, ``n_logits`` logits; adjacency values by hand,
    lower-triangular (acyclic: every source before its target)."""
    n_nodes = n_active + (2 + 1) * 2 + n_logits
    active = torch.tensor([[0, 0, 5], [1, 1, 7]][:n_active], dtype=torch.long).reshape(n_active, 3)
    return AttributionGraph("a b", torch.tensor([1, 2]), active, torch.ones(n_active),
                            torch.arange(n_active), torch.arange(float(n_nodes ** 2)).reshape(n_nodes, n_nodes).tril(-1),
                            torch.tensor([3, 0][:n_logits]), torch.full((n_logits,), 0.5), n_layers=2, vocab_size=4,
                            logit_token_strings=["c"] * n_logits, input_token_strings=["a", "b"], scan="mine")


@pytest.fixture
def saved(tmp_path):
    return small_graph().save(tmp_path / "graph")


def edit_meta(folder, edit):
    meta = json.loads((folder / "graph.json").read_text())
    edit(meta)
    (folder / "graph.json").write_text(json.dumps(meta))


def edit_tensors(folder, edit):
    tensors = load_file(str(folder / "graph.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "graph.safetensors"))


@pytest.fixture
def tensor_reads(monkeypatch):
    return count_tensor_reads(monkeypatch, graph_module)


def test_a_saved_graph_loads_back_field_for_field(saved):
    graph, back = small_graph(), AttributionGraph.load(saved)
    for name in graph_module.TENSORS:
        assert torch.equal(getattr(back, name), getattr(graph, name)), name
    assert (back.n_layers, back.vocab_size, back.scan, back.input_token_strings) == (2, 4, "mine", ["a", "b"])


@pytest.mark.parametrize("n_layers", [10**12, 3, 1])
def test_a_tampered_n_layers_is_refused_against_the_adjacency_before_reading_tensors(saved, tensor_reads, n_layers):
    edit_meta(saved, lambda meta: meta.update(n_layers=n_layers))
    with pytest.raises(CheckpointError, match=rf"graph\.json: n_layers={n_layers} with 2 positions.*needs a"):
        AttributionGraph.load(saved)
    assert tensor_reads == []


@pytest.mark.parametrize("field, value, expected", [
    ("n_layers", "2", "a positive integer"), ("n_layers", 0, "a positive integer"),
    ("vocab_size", 4.0, "a positive integer"), ("vocab_size", True, "a positive integer"),
    ("input_string", ["a"], "a string"), ("logit_token_strings", "c", "a list of strings"),
    ("scan", {"a": 1}, "a string, a list of strings or null"), ("sizes", {"n_pos": "2"}, "an object of integers"),
])
def test_a_field_of_the_wrong_type_names_the_file_and_the_field(saved, field, value, expected):
    edit_meta(saved, lambda meta: meta.update({field: value}))
    with pytest.raises(CheckpointError, match=rf"graph\.json: field '{field}' must be {expected}"):
        AttributionGraph.load(saved)


def test_a_missing_field_is_named(saved):
    edit_meta(saved, lambda meta: meta.pop("vocab_size"))
    with pytest.raises(CheckpointError, match=r"graph\.json: not a saved attribution graph \(missing \['vocab_size'\]"):
        AttributionGraph.load(saved)


def test_a_graph_json_nested_100k_deep_is_a_checkpoint_error(saved):
    (saved / "graph.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"graph\.json: not a readable JSON file \(nested too deeply"):
        AttributionGraph.load(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(selected_features=torch.tensor([0, 2])), r"selected_features must be in \[0, n_active=2\)"),
    (lambda t: t["active_features"].__setitem__((1, 0), 2), r"active_features' layers must be in \[0, n_layers=2\)"),
    (lambda t: t["active_features"].__setitem__((0, 1), -1), r"active_features' positions must be in \[0, the prompt"),
    (lambda t: t["active_features"].__setitem__((0, 2), -3), r"active_features' features must be non-negative"),
    (lambda t: t.update(input_tokens=torch.tensor([1, 4])), r"input_tokens must be in \[0, vocab_size=4\)"),
    (lambda t: t.update(logit_token_ids=torch.tensor([-1])), r"logit_token_ids must be in \[0, vocab_size=4\)"),
])
def test_an_index_out_of_range_is_refused_before_indexing(saved, edit, message):
    edit_tensors(saved, edit)
    with pytest.raises(CheckpointError, match=rf"graph\.safetensors: {message}"):
        AttributionGraph.load(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(adjacency_matrix=torch.zeros(81)), r"'adjacency_matrix' must be a 2-D floating-point"),
    (lambda t: t.update(input_tokens=torch.tensor([1.0, 2.0])), r"'input_tokens' must be a 1-D integer"),
    (lambda t: t.update(extra=torch.zeros(3)), r"unexpected \['extra'\]"),
    (lambda t: t.pop("logit_probabilities"), r"missing \['logit_probabilities'\]"),
    (lambda t: t.update(active_features=torch.zeros(2, 4, dtype=torch.long)), r"'active_features' must be \[n_active, 3\]"),
    (lambda t: t.update(activation_values=torch.ones(5)), r"'activation_values' has 5 entries, n_active is 2"),
])
def test_wrong_tensors_are_refused_from_the_header_before_any_is_read(saved, tensor_reads, edit, message):
    edit_tensors(saved, edit)
    with pytest.raises(CheckpointError, match=rf"graph\.safetensors: .*{message}"):
        AttributionGraph.load(saved)
    assert tensor_reads == []


def test_files_from_two_different_saves_are_refused(tmp_path):
    """Same adjacency size, different feature counts: only the recorded sizes tell the pair apart."""
    first = small_graph(n_active=2, n_logits=1).save(tmp_path / "first")
    second = small_graph(n_active=1, n_logits=2).save(tmp_path / "second")
    (first / "graph.json").write_text((second / "graph.json").read_text())
    with pytest.raises(CheckpointError, match="from different saves"):
        AttributionGraph.load(first)


@pytest.mark.parametrize("name", ["graph.json", "graph.safetensors"])
def test_a_file_linked_from_outside_the_folder_is_refused(saved, tmp_path, name):
    outside = tmp_path / f"outside-{name}"
    (saved / name).rename(outside)
    (saved / name).symlink_to(outside)
    with pytest.raises(CheckpointError, match="resolves outside the graph folder"):
        AttributionGraph.load(saved)


def test_a_failed_save_leaves_the_previous_graph_loadable(saved, monkeypatch):
    def failing_save(tensors, path):
        open(path, "wb").write(b"half a file")
        raise OSError("disk full")
    monkeypatch.setattr(graph_module, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        small_graph(n_active=1).save(saved)
    assert sorted(p.name for p in saved.iterdir()) == ["graph.json", "graph.safetensors"]
    assert torch.equal(AttributionGraph.load(saved).adjacency_matrix, small_graph().adjacency_matrix)


def test_a_save_never_writes_through_a_link_out_of_its_folder(saved, tmp_path):
    outside = tmp_path / "precious.json"
    outside.write_text("keep me")
    (saved / "graph.json").unlink()
    (saved / "graph.json").symlink_to(outside)
    with pytest.raises(CheckpointError):
        small_graph().save(saved)
    assert outside.read_text() == "keep me"


def test_write_graph_files_cannot_overwrite_the_viewers_index(tmp_path):
    write_graph_files(small_graph(), "first", tmp_path)
    before = (tmp_path / "graph-metadata.json").read_text()
    with pytest.raises(InputError, match="would write over the viewer's index graph-metadata.json"):
        write_graph_files(small_graph(), "graph-metadata", tmp_path)
    assert (tmp_path / "graph-metadata.json").read_text() == before
    assert [g["slug"] for g in json.loads(before)["graphs"]] == ["first"]


def test_write_graph_files_never_writes_through_a_linked_index(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"graphs": []}))
    folder = tmp_path / "viewer"
    folder.mkdir()
    (folder / "graph-metadata.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="resolves outside the graph files folder"):
        write_graph_files(small_graph(), "demo", folder)
    assert json.loads(outside.read_text()) == {"graphs": []} and not (folder / "demo.json").exists()


@pytest.mark.parametrize("index", ["[1, 2]", '{"graphs": 3}', "{broken"])
def test_write_graph_files_names_a_malformed_index_and_leaves_it(tmp_path, index):
    (tmp_path / "graph-metadata.json").write_text(index)
    with pytest.raises(InputError, match="graph-metadata.json: not a"):
        write_graph_files(small_graph(), "demo", tmp_path)
    assert (tmp_path / "graph-metadata.json").read_text() == index and not (tmp_path / "demo.json").exists()
