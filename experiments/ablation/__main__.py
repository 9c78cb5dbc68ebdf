"""``python -m experiments.ablation``: runs ``experiments.cli.ablation.main``."""

if __name__ == "__main__":
    from experiments._cli import run_command

    run_command("ablation")
