"""`eaglectl serve`: the OpenAI-compatible HTTP API on Ray Serve (cluster/serve_app.py)."""
from __future__ import annotations

import click

from eaglectl.common import fail


@click.command("serve")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="serve.yaml (a ServeConfig, or a deploy file with a `serve:` section).")
@click.option("--host", default=None, help="Bind address [default: the config's, 127.0.0.1].")
@click.option("--port", default=None, type=int, help="HTTP port [default: the config's, 8000].")
@click.option("--address", default=None, help="Ray cluster to join [default: RAY_ADDRESS, else a local Ray].")
def serve(config_path, host, port, address):
    """Serve the OpenAI-compatible HTTP API on Ray Serve (default model when no config: one replica on
    every core of this machine)."""
    import os

    from cluster.config import ServeConfig
    from cluster.serve_app import run_serve

    try:
        cfg = ServeConfig.from_yaml(config_path) if config_path else ServeConfig()
        overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        if overrides:            # validated as if the file had them (a copy with updates skips validation)
            cfg = ServeConfig.from_dict({**cfg.model_dump(exclude_unset=True), **overrides}, source="--host/--port")
        address = address or os.environ.get("RAY_ADDRESS")
        if not address:              # the replicas (and the ingress) run on this machine: head and keys are here
            try:
                cfg.check_draft_here()
                cfg.resolve_api_keys()   # a missing, empty or unreadable key source fails now, not in the ingress
            except ValueError as e:
                raise ValueError(f"{config_path}: {e}" if config_path else str(e)) from None
    except ValueError as e:
        fail(str(e))
    from cluster.config_base import ConfigError
    from cluster.placement import InsufficientResourcesError
    from cluster.ray_address import ClusterUnreachable

    try:
        run_serve(cfg, address=address, blocking=True)
    except (InsufficientResourcesError, ConfigError) as e:   # a config this cluster cannot run: say why
        fail(str(e))
    except ClusterUnreachable as e:
        fail(f"cannot reach the Ray cluster at {address!r}: {e}; --address / RAY_ADDRESS takes host:GCS-port "
             "(head:6379), ray://head:10001 or auto, and the cluster must be running")
    except RuntimeError as e:    # the app failed to deploy: deploy_app's message carries the replicas' reasons
        fail(f"the app failed to start: {e}")
