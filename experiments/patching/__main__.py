"""``python -m experiments.patching``: runs ``experiments.cli.patching.main``."""

if __name__ == "__main__":
    from experiments._cli import run_command

    run_command("patching")
