"""`eaglectl deploy render`: KubeRay manifests from the serve config (the renderer is deploy/kuberay.py)."""
from __future__ import annotations

from pathlib import Path

import click


@click.group("deploy")
def deploy() -> None:
    """Kubernetes (KubeRay) manifests from the serve config."""


@deploy.command("render")
@click.option("--config", "config", required=True, type=click.Path(exists=True, dir_okay=False),
              help="serve.yaml: a ServeConfig, or `serve:` + `kubernetes:` sections.")
@click.option("--job", "job", type=click.Path(exists=True, dir_okay=False), help="job.yaml: a batch RayJob.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder for the manifests.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if --out differs from a fresh render.")
def render_cmd(config, job, out, check) -> None:
    """Write rayservice.yaml, pdb.yaml, raycluster.yaml, raycluster-http.yaml (and rayjob.yaml)."""
    from cluster.config import ConfigError
    from deploy.kuberay import render_files

    try:
        files = render_files(config, job)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    out = Path(out)
    if check:
        stale = sorted(n for n, text in files.items() if not (out / n).is_file() or (out / n).read_text() != text)
        extra = sorted(p.name for p in out.glob("*.yaml") if p.name not in files) if out.is_dir() else []
        if stale or extra:
            raise click.ClickException(f"{out} is not up to date: stale {stale}, not rendered {extra}")
        click.echo(f"{out}: up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
        click.echo(str(out / name))
