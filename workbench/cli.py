"""The ``workbench`` console script: ``train``, ``run`` (the dashboard), ``models`` and ``plan``.

``train`` and ``run`` start the layers above the library in their own process
(``python -m experiments.zoo``, ``python -m app.serve``: ``streamlit run app/Home.py`` with the default model
loading from launch): the library never imports them.

Example:
    workbench models
    workbench models --architectures
    workbench train --recipe toy-attn-2l --out runs/toy-attn-2l
    workbench run --port 8502
    workbench plan smollm2-135m --max-memory cpu=300MiB --batch 8 --pos 128
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
        >>> dashboard_command(8502)[:3] == [sys.executable, "-m", "app.serve"]
        True
    """
    return [sys.executable, "-m", "app.serve", "--server.address", address,
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


def parse_max_memory(items: Sequence[str]) -> Optional[dict]:
    """``["0=20GiB", "cpu=60GiB"]`` as ``{0: "20GiB", "cpu": "60GiB"}`` (None for no items).

    Example:
        >>> parse_max_memory(["0=20GiB", "cpu=1000"])
        {0: '20GiB', 'cpu': 1000}
    """
    if not items:
        return None
    out: dict = {}
    for item in items:
        device, separator, size = item.partition("=")
        if not separator or not device or not size:
            raise ValueError(f"--max-memory takes DEVICE=SIZE (e.g. 0=20GiB cpu=60GiB), got {item!r}")
        out[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return out


def _plan(args: argparse.Namespace) -> int:
    import torch

    from workbench.loading import plan_memory

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    try:  # ConfigError and CheckpointError are ValueErrors too
        table = plan_memory(args.source, dtype=dtype, device_map=args.device_map,
                            max_memory=parse_max_memory(args.max_memory), batch=args.batch, pos=args.pos)
    except (ImportError, ValueError) as error:
        print(f"workbench plan: {error}", file=sys.stderr)
        return 2
    print(f"{args.source}: {table.attrs['dtype']} weights; a cache of every hook for batch {table.attrs['batch']} "
          f"x {table.attrs['pos']} tokens")
    print(table[["device", "units", "weights", "cache", "cache_on"]].to_string(index=False))
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
        >>> main(["models"])   # prints the registered models, then the default; returns the exit status
        name ... toy-attn-2l ...
        default: ...
        0
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
    plan = commands.add_parser("plan", help="bytes per device of a model's weights and cache, before loading it")
    plan.add_argument("source", help="registered name, HF directory, .gguf file or saved model")
    plan.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="weights' dtype (default: what load_model would use)")
    plan.add_argument("--device-map", default="auto", choices=("auto", "sequential"))
    plan.add_argument("--max-memory", nargs="*", default=[], metavar="DEVICE=SIZE",
                      help="e.g. 0=20GiB cpu=60GiB (default: each device's free memory)")
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--pos", type=int, default=1024, help="tokens per row (capped at the model's context)")
    plan.set_defaults(handler=_plan)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
