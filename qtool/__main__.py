"""Entry point for ``python -m qtool``."""

from qtool.cli import main

if __name__ == "__main__":
    main()
