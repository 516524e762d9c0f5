"""`eaglectl deploy render`: KubeRay manifests from the serve config (the renderer is deploy/kuberay.py)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import click

from eaglectl.common import fail


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
    """Write rayservice.yaml, pdb.yaml, raycluster.yaml, raycluster-http.yaml (and rayjob.yaml).

    All or nothing: every manifest is rendered and every target checked before the first is written.
    A manifest rendered earlier and not now (rayjob.yaml without --job) is removed, so `kubectl apply
    -f OUT` never applies a stale one; other files in OUT are left alone (--check reports other YAML).
    """
    from cluster.config_base import ConfigError
    from deploy.kuberay import FILE_NAMES, render_files
    from eaglectl.jobs import submit_job_refusal

    try:   # the RayJob's entrypoint is checked by submit-job itself: parsed and validated, not run
        files = render_files(config, job, check_job_args=submit_job_refusal)
    except ConfigError as e:     # exit 2, as bad input everywhere: --check's 1 means "not up to date"
        fail(str(e))
    out = Path(out)
    if check:
        try:
            stale = sorted(n for n, text in files.items() if not (out / n).is_file() or (out / n).read_text() != text)
            extra = sorted(p.name for p in out.glob("*.yaml") if p.name not in files) if out.is_dir() else []
        except OSError as e:
            raise click.BadParameter(f"cannot read {out}: {e.strerror or e}", param_hint="--out") from None
        if stale or extra:
            raise click.ClickException(f"{out} is not up to date: stale {stale}, not rendered {extra}")
        click.echo(f"{out}: up to date")
        return
    gone = [n for n in FILE_NAMES if n not in files and (out / n).is_file()]
    _check_out(out, [*files, *gone])
    _write_all(out, files)
    for name in gone:
        (out / name).unlink()
        click.echo(f"removed {out / name} (not rendered now)")
    others = sorted(p.name for p in out.glob("*.yaml") if p.name not in files)
    if others:
        click.echo(f"note: left {', '.join(others)} in {out}: not written by this renderer (--check reports them)",
                   err=True)


def _check_out(out: Path, names: list[str]) -> None:
    """Refuse before writing anything: --out under a file or where it cannot be created, or a target
    that is a folder (a half-written set of manifests is worse than none)."""
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise click.BadParameter(f"{out}: {base} is a file, not a folder", param_hint="--out")
    if not os.access(base, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{out}: cannot write in {base} (permission denied)", param_hint="--out")
    blocked = [n for n in names if (out / n).exists() and not (out / n).is_file()]
    if blocked:
        raise click.BadParameter(f"{out / blocked[0]} is in the way: not a file", param_hint="--out")


def _write_all(out: Path, files: dict[str, str]) -> None:
    """Each manifest to a temporary file first, then all renamed into place: a failed write leaves
    the old set as it was."""
    temps = {name: out / f".{name}.tmp" for name in files}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            temps[name].write_text(text)
    except OSError as e:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise click.BadParameter(f"cannot write to {out}: {e.strerror or e}", param_hint="--out") from None
    for name, tmp in temps.items():
        os.replace(tmp, out / name)
        click.echo(str(out / name))
