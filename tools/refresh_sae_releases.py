"""Regenerate ``workbench/hub/sae_releases.json`` from SAELens's ``pretrained_saes.yaml``.

Usage: python tools/refresh_sae_releases.py path/to/sae_lens/pretrained_saes.yaml [--version 6.54.12] [--out FILE]

The YAML ships inside the sae-lens wheel (``sae_lens/pretrained_saes.yaml``; ``pip download --no-deps
sae-lens==X`` and unzip it). SAELens is MIT-licensed (Copyright (c) 2023 Joseph Bloom); the JSON keeps that
notice. Only what loading and listing read is kept, read as SAELens's ``get_pretrained_saes_directory`` reads it:
per release its repo id, model, conversion kind (``conversion_func``; none means ``sae_lens``) and
``config_overrides``; per SAE its id, path (an int path as a string), Neuronpedia id and
``norm_scaling_factor``. A repeated SAE id keeps its last entry, as SAELens's id -> path map does.
Needs only the standard library and PyYAML (no sae-lens import).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "workbench" / "hub" / "sae_releases.json"
LICENCE = ("SAELens (https://github.com/decoderesearch/SAELens). MIT License. Copyright (c) 2023 Joseph Bloom. "
           "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
           "associated documentation files (the \"Software\"), to deal in the Software without restriction, including "
           "without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell "
           "copies of the Software, and to permit persons to whom the Software is furnished to do so, subject to the "
           "following conditions: The above copyright notice and this permission notice shall be included in all "
           "copies or substantial portions of the Software. THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF "
           "ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR "
           "A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR "
           "ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, "
           "OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.")


def convert(data: dict, version: str) -> dict:
    """The compact registry for SAELens ``version``'s parsed ``pretrained_saes.yaml``."""
    releases = {}
    for release, value in data.items():
        if "saes" not in value:
            raise SystemExit(f"{release}: no 'saes' key (SAELens refuses such a file too)")
        saes = {}
        for entry in value["saes"]:
            sae = {"id": entry["id"], "path": str(entry["path"])}
            if entry.get("neuronpedia") is not None:
                sae["neuronpedia"] = entry["neuronpedia"]
            if "norm_scaling_factor" in entry:
                sae["norm_scaling_factor"] = entry["norm_scaling_factor"]
            saes.pop(entry["id"], None)  # the last entry wins and takes the last place
            saes[entry["id"]] = sae
        row = {"repo_id": value["repo_id"], "model": value["model"],
               "conversion": value.get("conversion_func") or "sae_lens"}
        if value.get("config_overrides"):
            row["config_overrides"] = value["config_overrides"]
        row["saes"] = list(saes.values())
        releases[release] = row
    return {"source": f"sae_lens/pretrained_saes.yaml of sae-lens {version}", "sae_lens_version": version,
            "licence": LICENCE, "releases": releases}


def write(registry: dict, out: Path) -> None:
    """One release per line: small diffs when SAELens adds or changes a release."""
    head = {key: value for key, value in registry.items() if key != "releases"}
    lines = ["{" + json.dumps(head, ensure_ascii=False)[1:-1] + ',"releases":{']
    rows = [json.dumps(name) + ":" + json.dumps(row, ensure_ascii=False, separators=(",", ":"))
            for name, row in registry["releases"].items()]
    lines.append(",\n".join(rows))
    lines.append("}}")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("yaml_file", type=Path)
    parser.add_argument("--version", default="6.54.12", help="the sae-lens version the YAML came from")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    data = yaml.safe_load(args.yaml_file.read_text(encoding="utf-8"))
    registry = convert(data, args.version)
    write(registry, args.out)
    n_saes = sum(len(row["saes"]) for row in registry["releases"].values())
    print(f"{args.out}: {len(registry['releases'])} releases, {n_saes} SAEs")


if __name__ == "__main__":
    main()
