"""``python -m shardloader`` runs the CLI, under the console script's name (the same usage
lines, messages and ``--version``)."""

from shardloader.cli import main

if __name__ == "__main__":
    main(prog_name="shardloader")
