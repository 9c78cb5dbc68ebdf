"""Shared plumbing of the ``python -m experiments.<name>`` commands: arguments, model loading, outputs.

Each command's own arguments and steps are ``experiments.cli.<name>.main``; ``run_command`` runs it.

Every command takes ``--model NAME_OR_PATH`` (default: ``workbench.default_model_name()``) and ``--out DIR``, and writes ``<stem>.csv``, ``<stem>.json`` and
``<stem>.html`` (a standalone plotly figure) there.

``--workers N`` (default 1: everything in this process) and ``--ray-address ADDR`` run a command's
per-prompt work on Ray workers through ``experiments.distributed`` (``worker_pool``), writing the
same outputs; a command without per-prompt work (``make_parser(..., per_prompt=False)``) refuses them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch

import workbench as wb

DEFAULT_PROMPT = ("When Mary and John went to the store, John gave a drink to Mary. "
                  "The cat sat on the mat. The cat sat on the mat.")


class _Parser(argparse.ArgumentParser):
    """Checks ``--workers`` / ``--ray-address`` once the command line is parsed."""

    def __init__(self, *args, command: Optional[str], per_prompt: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.command, self.per_prompt = command, per_prompt

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        if parsed.workers < 1:
            self.error(f"--workers must be at least 1, got {parsed.workers}")
        if sharded(parsed) and not self.per_prompt:
            self.error(f"{self.prog} has no per-prompt work to share between Ray workers; "
                       f"run it without --workers / --ray-address")
        return parsed


def make_parser(description: str, command: Optional[str] = None, per_prompt: bool = False) -> argparse.ArgumentParser:
    """The arguments every experiment command shares; each module adds its own.

    ``command`` names it (``python -m experiments.<command>`` in usage and errors); ``per_prompt``
    says it can run its per-prompt work on Ray workers (``--workers``, ``--ray-address``); a
    command that cannot exits with an error naming it when they are given.

    Example:
        >>> make_parser("demo").parse_args(["--model", "m", "--out", "o"]).model
        'm'
    """
    prog = f"python -m experiments.{command}" if command else None
    parser = _Parser(prog=prog, description=description, command=command, per_prompt=per_prompt)
    parser.add_argument("--model", default=None,
                        help="registered name, HF directory, .gguf file or saved model (default: the workbench default)")
    parser.add_argument("--out", required=True, help="directory for the CSV, JSON and HTML outputs")
    parser.add_argument("--attn-impl", default="sdpa", choices=wb.ATTN_IMPLS)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--workers", type=int, default=1,
                        help="Ray workers for the per-prompt work (default 1: in this process, no Ray)")
    parser.add_argument("--ray-address", default=None,
                        help="an existing Ray cluster to run the workers on (default: a local Ray when --workers > 1)")
    return parser


def sharded(args: argparse.Namespace) -> bool:
    """Whether the command runs its per-prompt work on Ray workers (``--workers`` > 1 or ``--ray-address``).

    Example:
        >>> sharded(make_parser("demo", per_prompt=True).parse_args(["--out", "o", "--workers", "2"]))
        True
    """
    return args.workers > 1 or bool(args.ray_address)


@contextmanager
def worker_pool(args: argparse.Namespace) -> Iterator:
    """An ``experiments.distributed.WorkerPool`` of ``--workers`` workers that load ``--model`` with ``--attn-impl``.

    Example (starts Ray workers):
        >>> from experiments.ioi import ioi_per_prompt
        >>> args = make_parser("demo", per_prompt=True).parse_args(["--out", "o", "--workers", "2"])
        >>> with worker_pool(args) as pool:                                  # doctest: +SKIP
        ...     rows = pool.run(ioi_per_prompt, data, progress=not args.no_progress)
    """
    from experiments.distributed import WorkerPool

    with WorkerPool(args.model or wb.default_model_name(), workers=args.workers, address=args.ray_address,
                    load_kwargs={"attn_impl": args.attn_impl}) as pool:
        yield pool


def load(args: argparse.Namespace):
    """Loads ``--model`` (or ``wb.default_model_name()``) with ``--attn-impl``, in eval mode.

    Nothing is fetched from a hub: every loader reads local files only.

    Example:
        >>> load(make_parser("demo").parse_args(["--model", "toy-attn-2l", "--out", "o"])).cfg.n_layers
        2
    """
    return wb.load_model(args.model or wb.default_model_name(), attn_impl=args.attn_impl).eval()


def prompt_tokens(model, prompt: Optional[str]) -> torch.Tensor:
    """[1, pos] ids of ``prompt`` (or a default text); a fixed random sequence for a model without a tokenizer.

    Example:
        >>> model.to_str_tokens(prompt_tokens(model, "The cat")[0]), prompt_tokens(model, None).shape
        (['<|endoftext|>', 'The', ' c', 'at'], torch.Size([1, 54]))
    """
    if model.tokenizer is not None:
        return model.to_tokens(prompt or DEFAULT_PROMPT)
    if prompt:
        raise SystemExit("this model has no tokenizer, so --prompt cannot be tokenized")
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.cfg.d_vocab, (1, min(32, model.cfg.n_ctx)), generator=generator)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return _jsonable(value.item())
    return value


def write_outputs(out_dir: str | Path, stem: str, table: pd.DataFrame, figure: go.Figure,
                  summary: dict[str, Any]) -> dict[str, Path]:
    """Writes ``stem``.csv (the table), .json (summary plus the table's rows) and .html (the figure).

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> paths = write_outputs(out, "demo", pd.DataFrame({"x": [1.5]}), go.Figure(), {"model": "m"})
        wrote .../demo.csv
        wrote .../demo.json
        wrote .../demo.html
        >>> json.loads(paths["json"].read_text())
        {'model': 'm', 'columns': ['x'], 'rows': [{'x': 1.5}]}
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{stem}.{kind}" for kind in ("csv", "json", "html")}
    table.to_csv(paths["csv"], index=False)
    payload = {**summary, "columns": list(table.columns), "rows": json.loads(table.to_json(orient="records"))}
    paths["json"].write_text(json.dumps(_jsonable(payload), indent=1))
    figure.write_html(paths["html"], include_plotlyjs=True, full_html=True)
    for path in paths.values():
        print(f"wrote {path}")
    return paths


def run_main(main, argv: Optional[Sequence[str]] = None) -> None:
    """Calls ``main(argv)`` with torch's gradient tracking off (commands never need it).

    Example:
        >>> run_main(lambda argv: print(argv, torch.is_grad_enabled()), ["--out", "o"])
        ['--out', 'o'] False
    """
    with torch.no_grad():
        main(argv)


def run_command(name: str, argv: Optional[Sequence[str]] = None, gradients: bool = False) -> None:
    """``python -m experiments.<name>``: runs ``experiments.cli.<name>.main(argv)``, through ``run_main``
    (gradients off) unless the command needs ``gradients`` (training).

    The compute module calls it under ``if __name__ == "__main__"``, so it imports its command line
    (argparse, plotly) only when run as a command.

    Example:
        >>> import tempfile
        >>> run_command("attention", ["--model", "toy-attn-2l", "--out", tempfile.mkdtemp(), "--no-progress"])
        wrote .../attention.csv
        wrote .../attention.json
        wrote .../attention.html
    """
    main = importlib.import_module(f"experiments.cli.{name}").main
    if gradients:
        main(argv)
    else:
        run_main(main, argv)
