"""Subcommands of `mtjax`, one module each (see mtjax/cli.py)."""
