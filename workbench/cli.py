"""The ``workbench`` console script: ``train``, ``run`` (the dashboard) and ``models``.

``train`` and ``run`` start the layers above the library in their own process
(``python -m experiments.zoo``, ``streamlit run app/Home.py``): the library never imports them.

Example:
    workbench models
    workbench models --architectures
    workbench train --recipe toy-attn-2l --out runs/toy-attn-2l
    workbench run --port 8502
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = REPO_ROOT / "app" / "Home.py"


def dashboard_command(port: int = 8501, address: str = "127.0.0.1") -> list[str]:
    """The command that serves the Streamlit dashboard (headless, local address only).

    Example:
        >>> dashboard_command(8502)[:4] == [sys.executable, "-m", "streamlit", "run"]
        True
    """
    return [sys.executable, "-m", "streamlit", "run", str(DASHBOARD), "--server.address", address,
            "--server.port", str(port), "--server.headless", "true"]


def train_command(arguments: Sequence[str]) -> list[str]:
    """The command that trains (and measures, and writes the card of) a zoo model.

    Example:
        >>> train_command(["--recipe", "toy-attn-2l"])[1:4]
        ['-m', 'experiments.zoo', '--recipe']
    """
    return [sys.executable, "-m", "experiments.zoo", *arguments]


def _models(args: argparse.Namespace) -> int:
    from workbench.loading import registry, supported_architectures

    if args.architectures:
        print(supported_architectures().to_string(index=False))
        return 0
    table = registry.list_models()
    print(table.to_string(index=False))
    print(f"\ndefault: {registry.default_model_name()}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if not DASHBOARD.is_file():
        print(f"workbench run: the dashboard entry point {DASHBOARD} is missing", file=sys.stderr)
        return 2
    return subprocess.call(dashboard_command(args.port, args.address))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``workbench`` console script; returns the exit status.

    ``train`` hands every argument after it to ``python -m experiments.zoo``.

    Example:
        >>> main(["models"])   # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return subprocess.call(train_command(argv[1:]))
    parser = argparse.ArgumentParser(prog="workbench", description="mechanistic-interpretability workbench")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train a zoo recipe (see `workbench train --help`)")
    run = commands.add_parser("run", help="serve the dashboard")
    run.add_argument("--port", type=int, default=8501)
    run.add_argument("--address", default="127.0.0.1")
    run.set_defaults(handler=_run)
    models = commands.add_parser("models", help="list registered models and whether they are installed")
    models.add_argument("--architectures", action="store_true",
                        help="list the checkpoint architectures that load instead")
    models.set_defaults(handler=_models)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
