"""``python -m experiments.patching``: runs ``experiments.cli.patching.main``."""

if __name__ == "__main__":
    from experiments._cli import run_main
    from experiments.cli.patching import main

    run_main(main)
