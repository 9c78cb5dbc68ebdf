"""``python -m experiments.lenses``: runs ``experiments.cli.lenses.main`` (KL and cross-entropy by layer, logit lens
against a tuned lens, on held-out text)."""

if __name__ == "__main__":
    from experiments._cli import run_command

    run_command("lenses")
