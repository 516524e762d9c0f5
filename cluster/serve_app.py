"""The Ray Serve application: an OpenAI-compatible FastAPI ingress in front of engine replicas.

Two deployments: `OpenAIIngress` (cluster/ingress.py: HTTP, validation, auth, chat templating and
tokenization, SSE, metrics; it loads the tokenizer, not the weights) and
`LLMServer` (cluster/replica.py: one engine per replica, TP ranks in the replica's placement
group). The ingress reaches replicas through a DeploymentHandle whose routing is
`cluster.router.LoadAwareRouter`; Serve autoscales `LLMServer` on ongoing requests. An app with one
engine replica is one deployment instead (`ColocatedServer`, cluster/colocated.py, named `LLMServer`):
the same ingress with the engine in its process (`ServeConfig.colocated`).

Entry points: `app_builder(args)` (`cluster.serve_app:app_builder` in Serve config files and
KubeRay RayService specs; args are a ServeConfig dict), `build_app(config)` and
`run_serve(config, address, blocking)` (what `eaglectl serve` calls).
"""

import logging
import os
import re
import threading
import time
from typing import Any

from ray import serve

from cluster.colocated import ColocatedServer
from cluster.config import ServeConfig
from cluster.config_base import ConfigError
from cluster.cpu_threads import engine_env, serve_env
from cluster.ingress import OpenAIIngress
from cluster.placement import check_fits
from cluster.ray_address import check_listening, check_speaks_grpc
from cluster.replica import EngineReplica
from cluster.router import router_config
from cluster.signals import on_stop_signals, restore_signals
from cluster.tp_group import free_port

logger = logging.getLogger(__name__)


def engine_deployment_options(config: ServeConfig) -> dict[str, Any]:
    """Serve options of the engine deployment: replica count/autoscaling, resources, routing, caps."""
    bundle = config.resources_per_rank.bundle()
    opts: dict[str, Any] = dict(
        name="LLMServer",
        max_ongoing_requests=config.llm_server_max_ongoing,
        max_queued_requests=-1,   # the ingress's Admission bounds what waits (see cluster/admission.py)
        request_router_config=router_config(prefix_aware=config.enable_prefix_caching),
        health_check_period_s=2.0,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=30.0,
        max_constructor_retry_count=3,  # a model that fails to load fails the deploy, not 20 reloads
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0),
                           "runtime_env": {"env_vars": {**serve_env(), **engine_env()}}},
        **config.replica_count_options(),
    )
    if config.tp_size > 1:  # rank 0 is the replica actor in bundle 0; ranks 1.. go in the other bundles
        opts["placement_group_bundles"] = [dict(bundle) for _ in range(config.tp_size)]
        opts["placement_group_strategy"] = config.placement_strategy.value
    return opts


def build_app(config: ServeConfig):
    """The bound Serve application for `config`."""
    if config.ingress.direct and os.environ.get(DIRECT_INGRESS) != "1":
        raise ConfigError(f"ingress.direct: Serve's controller must start with {DIRECT_INGRESS}=1 "
                          "(`eaglectl serve` without --address sets it; on another cluster set it on every node)")
    cfg = config.model_dump(mode="json")
    if config.colocated:
        return serve.deployment(ColocatedServer).options(**engine_deployment_options(config)).bind(cfg)
    llm = serve.deployment(EngineReplica).options(**engine_deployment_options(config))
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=config.ingress.num_replicas, max_constructor_retry_count=3,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.ingress.num_cpus, "runtime_env": {"env_vars": serve_env()}})
    return ingress.bind(cfg, llm.bind(cfg))


def app_builder(args: dict[str, Any]):
    """`import_path: cluster.serve_app:app_builder` for Serve config files and KubeRay; args = ServeConfig."""
    return build_app(ServeConfig.from_dict(dict(args or {}), source="serve app args"))


def deploy_app(config: ServeConfig, route_prefix: str = "/") -> None:
    """Deploy (or update) the app on the running Serve instance; a failed deploy raises with the
    replicas' own errors (a model that does not load, a missing API-key variable), not just "failed".
    A config the cluster can never schedule raises InsufficientResourcesError first (cluster/placement.py)."""
    if config.ingress.direct and route_prefix != "/":
        raise ConfigError(f"ingress.direct serves the app at / on its own port, not at {route_prefix!r}")
    check_fits(config)
    try:
        serve.run(build_app(config), name=config.app_name, route_prefix=route_prefix)
    except RuntimeError as e:
        details = []
        try:
            for name, dep in serve.status().applications[config.app_name].deployments.items():
                if dep.message:
                    details.append(f"{name}: {_last_error(dep.message)}")
        except Exception:  # status unavailable: keep Serve's own message
            pass
        raise RuntimeError("\n".join([str(e), *details])) from e


def _last_error(message: str) -> str:
    """A failed replica's own words: the last `SomeError: ...` line of the tracebacks Serve reports
    (the whole message where it has none; the tracebacks stay in the controller's log)."""
    errors = re.findall(r"^\S*(?:Error|Exception)\w*: .+$", message, re.M)
    return errors[-1] if errors else message


DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


def direct_ingress_env(port: int) -> dict[str, str]:
    """Environment for a Ray whose Serve runs without a proxy: the ingress replica takes `port` (the
    range is that one port; Ray's maximum is exclusive) and gets it back at once after a restart
    (Serve holds a freed port back for HAProxy, which this setup does not run). A stopping ingress
    drains for 30 s by default, for a load balancer to take it out of rotation; with one ingress
    replica on one machine that only delayed Ctrl-C by 30 s, so it drains for as long as its
    requests take unless the environment sets the period."""
    drain = os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
    return {DIRECT_INGRESS: "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1), "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": drain}


def local_ray_env(config: ServeConfig) -> dict[str, str]:
    """Environment for a Ray started in this process to serve `config`: Serve's streaming settings,
    and direct ingress's switch and port when the config asks for it."""
    return {**serve_env(), **(direct_ingress_env(config.port) if config.ingress.direct else {})}


def _http_options(config: ServeConfig) -> dict[str, Any]:
    """Serve's HTTP options. Direct ingress still starts a proxy on the head node (Ray 2.60), which
    must not take the port the ingress replica serves: it listens on a free local port instead."""
    port = free_port("127.0.0.1") if config.ingress.direct else config.port
    return {"host": config.host, "port": port}


def run_serve(config: ServeConfig, address: str | None = None, blocking: bool = True) -> str:
    """Start (or join, with `address`) a Ray cluster, deploy the app, and return its base URL.

    `blocking=True` serves until interrupted (Ctrl-C / SIGINT, or SIGTERM as Kubernetes sends,
    also during startup), then deletes the app and returns.
    """
    import ray

    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}"
    previous = _stop_on_signals() if blocking else {}
    deployed = False          # only an app this call deployed is deleted on the way out
    try:
        if config.ingress.direct and address is not None:
            raise ConfigError("ingress.direct needs a Ray that `eaglectl serve` starts (no --address or "
                              "RAY_ADDRESS): Serve reads it when its controller starts")
        if not ray.is_initialized():
            check_listening(address)   # ray.init would retry for minutes where nothing listens
            check_speaks_grpc(address)   # or where something else does
            if address is None:   # a Ray started here: its Serve proxy takes the streaming fast path too
                os.environ.update(local_ray_env(config))
            ray.init(address=address, namespace="eagle-serve", ignore_reinit_error=True)
        serve.start(http_options=_http_options(config))
        _check_cluster_free(config)
        deployed = True
        deploy_app(config)
        if blocking:
            _stop_on_signals()      # again: ray.init installs a SIGTERM handler of its own
        print(f"eagle-serve: {config.model_name} at {url}/v1", flush=True)
        while blocking:
            time.sleep(1)
    except KeyboardInterrupt:
        if not blocking:
            raise
        logger.info("interrupted: shutting down %s", config.app_name)
    finally:
        if blocking and deployed and ray.is_initialized():
            _delete_app(config.app_name)
        restore_signals(previous)
    return url


def _check_cluster_free(config: ServeConfig) -> None:
    """ConfigError where deploying would take over what another server runs on this cluster: an app
    of the same name (Serve would redeploy it, and this process delete it on exit), another app on
    route / (where every app of ours is served), or a Serve whose proxy already listens on another
    port (Serve applies HTTP options only when it starts)."""
    try:
        details = serve.context._get_global_client().get_serve_details()
    except Exception:  # a Serve without the details API: deploy as before
        logger.debug("serve details unavailable", exc_info=True)
        return
    for name, app in (details.get("applications") or {}).items():
        if app.get("status") == "DELETING":
            continue
        if name == config.app_name:
            raise ConfigError(f"app_name: an app named {name!r} is already running on this cluster; stop it first, "
                              "or give this one another app_name")
        if app.get("route_prefix") == "/":
            raise ConfigError(f"app {name!r} already serves route / on this cluster; stop it first")
    port = (details.get("http_options") or {}).get("port")
    if port and not config.ingress.direct and port != config.port:
        raise ConfigError(f"port: Serve on this cluster already listens on port {port} (its HTTP options are "
                          f"set when it starts), not {config.port}; set port: {port}")


def _stop_on_signals() -> dict:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, whatever handler (or ignore)
    the process inherited or a library installed; returns the handlers replaced."""
    return on_stop_signals(_interrupt)


def _interrupt(name: str) -> None:
    raise KeyboardInterrupt(name)


def _delete_app(name: str, timeout_s: float = 60.0) -> None:
    """Delete the app, waiting at most `timeout_s`: an interrupted server must exit even when a
    replica is slow to stop (Ray tears down a cluster this process started when it exits)."""
    def delete() -> None:
        try:
            serve.delete(name)
        except Exception:  # nothing deployed yet, or Serve already gone
            logger.debug("serve.delete failed", exc_info=True)

    worker = threading.Thread(target=delete, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("app %s still deleting after %.0f s; exiting anyway", name, timeout_s)
