"""What every command module shares (its own module, so that a command module imports it without
importing eaglectl.main, which imports every command module)."""
from __future__ import annotations

import sys

import click

EXIT_USAGE = 2


def fail(msg: str, code: int = EXIT_USAGE):
    """Print `error: msg` to stderr and exit with `code` (2: bad input or settings)."""
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)
