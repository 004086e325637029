"""``python -m qdebug`` runs the command line."""

from qdebug.cli import main

if __name__ == "__main__":
    main()
