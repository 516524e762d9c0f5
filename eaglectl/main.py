"""`eaglectl`: the command line. One module a command group (table in eaglectl/README.md), each a
thin layer over the package that does the work; heavy imports happen inside commands so `--help`
stays fast."""
from __future__ import annotations

import click

from eaglectl.bench import bench
from eaglectl.deploy import deploy
from eaglectl.generate import generate
from eaglectl.jobs import job, submit_job
from eaglectl.serve import serve
from eaglectl.train import train_head


@click.group()
@click.version_option(package_name="eagle-serve")
def main() -> None:
    """Serve and batch-run LLMs with EAGLE speculative decoding."""


for _command in (generate, serve, bench, train_head, submit_job, job, deploy):
    main.add_command(_command)

if __name__ == "__main__":
    main()
