"""Command-line entry points; `cli/main.py` parses argv."""
