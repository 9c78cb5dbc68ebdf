"""``python -m experiments.ablation``: runs ``experiments.cli.ablation.main``."""

if __name__ == "__main__":
    from experiments._cli import run_main
    from experiments.cli.ablation import main

    run_main(main)
