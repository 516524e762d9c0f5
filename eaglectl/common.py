"""What every command module shares (its own module, so that a command module imports it without
importing eaglectl.main, which imports every command module)."""
from __future__ import annotations

import math
import sys

import click

EXIT_USAGE = 2


def given_flags(ctx: click.Context, *names: str) -> list[str]:
    """The `--flags` among parameters `names` that the user gave (not left at their defaults): the
    ones a command refuses where they would be ignored."""
    return [f"--{n.replace('_', '-')}" for n in names if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT]


def fail(msg: str, code: int = EXIT_USAGE):
    """Print `error: msg` to stderr and exit with `code` (2: bad input or settings)."""
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


class FiniteFloat(click.FloatRange):
    """A FloatRange that refuses nan and inf too (nan passes every bound comparison, and no count of
    epochs or seconds, temperature or learning rate is infinite)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


POSITIVE = click.IntRange(min=1)       # counts that must be at least one
COUNT = click.IntRange(min=0)          # counts where 0 means none
