"""``python -m experiments.circuits``: runs ``experiments.cli.circuits.main``."""

if __name__ == "__main__":
    from experiments._cli import run_command

    run_command("circuits")
