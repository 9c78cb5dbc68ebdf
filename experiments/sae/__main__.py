"""``python -m experiments.sae cache|train|evaluate|bench``: runs ``experiments.cli.sae.main`` (training needs gradients)."""

if __name__ == "__main__":
    from experiments._cli import run_command

    run_command("sae", gradients=True)
