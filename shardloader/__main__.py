"""``python -m shardloader`` runs the CLI."""

from shardloader.cli import main

if __name__ == "__main__":
    main()
