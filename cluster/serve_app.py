"""The Ray Serve application: an OpenAI-compatible FastAPI ingress in front of engine replicas.

Two deployments: `OpenAIIngress` (HTTP, validation, auth, chat templating and tokenization, SSE,
metrics; it loads the tokenizer, not the weights) and
`LLMServer` (cluster/replica.py: one engine per replica, TP ranks in the replica's placement
group). The ingress reaches replicas through a DeploymentHandle whose routing is
`cluster.router.LoadAwareRouter`; Serve autoscales `LLMServer` on ongoing requests. An app with one
engine replica is one deployment instead (`ColocatedServer`, named `LLMServer`): the same ingress
with the engine in its process (`ServeConfig.colocated`).

Entry points: `app_builder(args)` (`cluster.serve_app:app_builder` in Serve config files and
KubeRay RayService specs; args are a ServeConfig dict), `build_app(config)` and
`run_serve(config, address, blocking)` (what `eaglectl serve` calls).
"""

import asyncio
import logging
import os
import re
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import openai_api as oa
from cluster.config import ConfigError, ServeConfig
from cluster.cpu_threads import engine_env, serve_env
from cluster.ingress_prompts import IngressPrompts
from cluster.local_engine import LocalEngine
from cluster.metrics import ServeMetrics, StatusCounter, note_status, set_active
from cluster.openai_render import ChatRender, CompletionRender, all_or_none, merge_streams
from cluster.placement import check_fits
from cluster.replica import EngineReplica, Failed, Rejected, engine_config
from cluster.router import (
    Admission,
    OverloadedError,
    PoisonRequestError,
    ReplicaLostError,
    router_config,
    stream_outputs,
)
from cluster.router_state import live_replica_stats
from cluster.signals import on_stop_signals, restore_signals
from cluster.tp_group import free_port
from eagle_worker.engine_api import load_engine_module

logger = logging.getLogger(__name__)
api = FastAPI(title="eagle-serve", docs_url=None, redoc_url=None)


@api.exception_handler(oa.APIError)
async def _api_error(request: Request, exc: oa.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (unknown route 404, wrong method 405) in OpenAI's shape."""
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = oa.APIError(exc.status_code, message, type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    err = oa.APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def _unavailable(e: Exception) -> oa.APIError:
    """503s: a full system (retry later; the status middleware adds Retry-After) or a replica lost
    under the request; 500 for a request two replicas died under (not retried: it may be the cause)."""
    if isinstance(e, OverloadedError):
        return oa.APIError(503, str(e), type="overloaded_error", code="overloaded")
    if isinstance(e, PoisonRequestError):
        return oa.APIError(500, str(e), type="server_error", code="replicas_died")
    return oa.APIError(503, str(e), type="server_error", code="replica_lost")


def _unless_failed(out: Any) -> Any:
    """An output, or the 500 of a request the engine failed (its step raised; the replica lives on)."""
    if isinstance(out, Failed):
        raise oa.APIError(500, out.message, type="server_error")
    return out


# Counts every request by final status: keep this the last middleware added (the outermost), and
# above `serve.ingress(api)`, which freezes a copy of the app.
api.add_middleware(StatusCounter)


@serve.ingress(api)
class OpenAIIngress:
    engine_attempts = 6   # a request whose replica died goes to another (cluster/router.py)

    def __init__(self, config: dict, engine):
        self.config = ServeConfig.from_dict(config)
        self.engine = engine
        self.api_keys = self.config.resolve_api_keys()  # fails the deployment if a key source is missing
        self.metrics = ServeMetrics(self.config.model_name)
        set_active(self.metrics)
        self.admission = Admission(self.config.admission_limit)  # beyond it: 503 + Retry-After at once
        self.max_model_len: int | None = self.config.limits.max_model_len
        # tokenization and chat templating happen here, off the replicas' engine threads
        backend = load_engine_module(self.config.engine)
        self.prompts = IngressPrompts(backend.load_prompt_tokenizer(engine_config(self.config)))

    # ---- plumbing ----------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if key not in self.api_keys:
            raise oa.APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              type="authentication_error", code="invalid_api_key")

    async def _parse(self, request: Request, model_cls):
        self._check_auth(request)
        body = await oa.read_json_object(request, self.config.limits.max_request_body_bytes)
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise oa.validation_error(e) from None
        if req.model not in (self.config.model_name, self.config.model):
            raise oa.APIError(404, f"model {req.model!r} does not exist; this server serves "
                              f"{self.config.model_name!r}", param="model", code="model_not_found")
        return req

    def _max_tokens(self, requested: int | None, default: int) -> int:
        limit = self.config.limits.max_tokens
        if requested is not None and requested > limit:
            raise oa.APIError(400, f"max_tokens: {requested} exceeds this server's limit of {limit}",
                              param="max_tokens")
        return requested if requested is not None else min(default, limit)

    async def _first(self, it: AsyncIterator[Any]) -> Any:
        """The first output, with refusals and overload turned into HTTP errors before headers go out."""
        try:
            out = await it.__anext__()
        except StopAsyncIteration:
            raise oa.APIError(500, "the engine returned no output", type="server_error") from None
        except (OverloadedError, ReplicaLostError) as e:
            raise _unavailable(e) from None
        if isinstance(out, Rejected):
            raise oa.APIError(400, out.message, param=out.param)
        return _unless_failed(out)

    async def _firsts(self, its: list) -> list:
        """Every choice's first output (refusals and overload become HTTP errors before headers go out)."""
        return await all_or_none([self._first(it) for it in its])

    async def _last(self, it: AsyncIterator[Any], first: Any) -> tuple[Any, list | None]:
        """A non-streamed choice's final output, and its prompt logprobs (sent with the first output
        of each attempt, so kept from whichever came last)."""
        last, prompt_lps = first, getattr(first, "prompt_logprobs", None)
        try:
            async for out in it:
                last = _unless_failed(out)
                prompt_lps = getattr(out, "prompt_logprobs", None) or prompt_lps
        except (OverloadedError, ReplicaLostError) as e:
            raise _unavailable(e) from None
        return last, prompt_lps

    async def _run(self, endpoint: str, req, prompt_ids: list[int], max_tokens: int, render):
        """Shared body of both endpoints: `n` engine requests (`<id>-<i>`, seed + i) for one prompt of
        token ids; `render` builds the endpoint's responses/chunks."""
        t0 = time.monotonic()
        limit = self.admission.offline_limit if req.priority > 0 else self.admission.limit
        if req.n > limit:       # each sample is admitted as a request: more than fit at once would wait forever
            raise oa.APIError(400, f"n: {req.n} samples are more requests than this server admits at once "
                              f"({limit})", param="n")
        rid = oa.new_id(render.prefix)
        sub_ids = [rid] if req.n == 1 else [f"{rid}-{i}" for i in range(req.n)]
        its = [stream_outputs(self.engine, sub, prompt_ids, req.sampling_params(max_tokens, i), req.priority,
                              restartable=not req.stream, on_retry=self.metrics.retried, admission=self.admission,
                              max_attempts=self.engine_attempts,
                              group=rid if req.n > 1 else None,
                              stream_interval=self.config.ingress.stream_interval if req.stream else 0)
               for i, sub in enumerate(sub_ids)]
        self.metrics.inflight.labels(self.config.model_name).inc()
        status = 500
        try:
            firsts = await self._firsts(its)
            ttft = time.monotonic() - t0
            self.metrics.first_token(ttft)
            if not req.stream:
                done = await all_or_none([self._last(it, f) for it, f in zip(its, firsts)])
                for last, _ in done:
                    self._finish(last, t0, ttft)
                status = 200
                body = render.full(rid, [last for last, _ in done], done[0][1])
                return JSONResponse(body.model_dump(mode="json"))
            status = 200
            return StreamingResponse(self._sse(its, firsts, rid, req, render, t0, ttft), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        except oa.APIError as e:
            status = e.status
            raise
        finally:
            if not req.stream or status != 200:     # a started stream closes its readers in _sse
                self.metrics.inflight.labels(self.config.model_name).dec()
                for it in its:
                    await it.aclose()

    async def _sse(self, its: list, firsts: list, rid: str, req, render, t0: float, ttft: float) -> AsyncIterator[str]:
        lasts = list(firsts)
        outputs = merge_streams(its, firsts)
        try:
            for chunk in render.head(rid):
                yield oa.sse(chunk)
            async for i, out in outputs:
                lasts[i] = out = _unless_failed(out)
                self.metrics.tokens(len(out.new_token_ids))
                yield oa.sse(render.chunk(rid, i, out))
            if req.include_usage:
                yield oa.sse(render.usage_chunk(rid, lasts))
            for last in lasts:
                self._finish(last, t0, ttft, count_tokens=False)
        except (ReplicaLostError, OverloadedError) as e:
            err = _unavailable(e)
            note_status(err.status)
            yield oa.sse(err.body())
        except oa.APIError as e:
            note_status(e.status)
            yield oa.sse(e.body())
        except Exception as e:  # never end a stream silently
            logger.exception("stream %s failed", rid)
            note_status(500)
            yield oa.sse(oa.APIError(500, f"internal error: {e!r}", type="server_error").body())
        finally:
            self.metrics.inflight.labels(self.config.model_name).dec()
            await outputs.aclose()   # stops the choices' readers before their streams close
            for it in its:
                await it.aclose()
        yield "data: [DONE]\n\n"

    def _finish(self, out, t0: float, ttft: float, count_tokens: bool = True) -> None:
        if count_tokens:
            self.metrics.tokens(len(out.token_ids))
        self.metrics.finished(out, time.monotonic() - t0, ttft)

    # ---- routes ------------------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        req = await self._parse(request, oa.CompletionRequest)
        max_tokens = 1 if req.score_only else self._max_tokens(req.max_tokens, default=16)
        ids, text = await self.prompts.completion(req.prompt, self._context(), need_text=req.echo)
        self._fits_context(len(ids), None if req.score_only else req.max_tokens)
        render = CompletionRender(self.config.model_name, self.prompts, req, text, ids)
        return await self._run("completions", req, ids, max_tokens, render)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req = await self._parse(request, oa.ChatCompletionRequest)
        try:
            messages = req.template_messages()
        except ValueError as e:
            raise oa.APIError(400, f"messages: {e}", param="messages") from None
        max_tokens = self._max_tokens(req.requested_max_tokens, default=self.config.limits.max_tokens)
        ids = await self.prompts.chat(messages, self._context())
        self._fits_context(len(ids), req.requested_max_tokens)
        return await self._run("chat", req, ids, max_tokens, ChatRender(self.config.model_name, self.prompts, req))

    def _fits_context(self, prompt_tokens: int, requested: int | None) -> None:
        """A max_tokens the client asked for that cannot fit beside the prompt is a 400, as OpenAI and
        vLLM answer it (without one, generation stops at the context with finish_reason length)."""
        context = self._context()
        if requested and context and prompt_tokens + requested > context:
            raise oa.APIError(400, oa.context_error(prompt_tokens, requested, context), param="max_tokens",
                              code="context_length_exceeded")

    def _context(self) -> int | None:
        """max_model_len for the prompt-length check: configured, or as a live replica reported it."""
        if self.max_model_len is None:
            for st in live_replica_stats().values():
                self._saw_stats(st)
        return self.max_model_len

    async def _probe_stats(self, timeout: float) -> dict:
        """Stats of one replica (whichever the router picks; it also starts this process's router)."""
        st = await asyncio.wait_for(self.engine.stats.remote(), timeout=timeout)
        self._saw_stats(st)
        return st

    def _saw_stats(self, st: dict) -> None:
        if self.max_model_len is None and st.get("max_model_len"):
            self.max_model_len = int(st["max_model_len"])

    async def _live_replicas(self) -> dict[str, dict]:
        """Stats of every live engine replica (from the router's view, ~1 s old); before the router
        knows any, one probed replica's."""
        live = live_replica_stats()
        if not live:
            try:
                st = await self._probe_stats(timeout=2)
            except Exception:
                return {}
            live = live_replica_stats() or {str(st.get("replica_id", "unknown")): st}
        for st in live.values():
            self._saw_stats(st)
        return live

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._check_auth(request)
        if self.max_model_len is None:
            try:
                await self._probe_stats(timeout=2)
            except Exception:
                pass
        card = oa.ModelCard(id=self.config.model_name, root=self.config.model, max_model_len=self.max_model_len)
        return JSONResponse(oa.ModelList(data=[card]).model_dump(mode="json"))

    @api.get("/health")
    async def health(self):
        """200 while some replica answers; busy replicas (backpressure) still count as healthy."""
        if live_replica_stats():  # the router sees a replica with a live engine: no probe to queue
            return {"status": "ok", "model": self.config.model_name}
        try:
            await self._probe_stats(timeout=10)
        except BackPressureError:
            return {"status": "ok", "model": self.config.model_name, "load": "saturated"}
        except Exception as e:
            return JSONResponse({"status": "unhealthy", "error": repr(e)}, status_code=503)
        return {"status": "ok", "model": self.config.model_name}

    @api.get("/metrics")
    async def prometheus(self):
        replicas = await self._live_replicas()  # gauges of exactly the live replicas
        return Response(self.metrics.render(replicas), media_type="text/plain; version=0.0.4; charset=utf-8")


class ColocatedServer(OpenAIIngress):
    """The ingress with its engine in the same process, as the one deployment `LLMServer`
    (`ServeConfig.colocated`: one engine replica). The endpoints reach the engine through
    `LocalEngine`; a job's rows (cluster/app_client.py) and Serve's health and routing probes reach it
    through the methods below, as they reach a separate `LLMServer`."""

    engine_attempts = 1   # its engine is the only one: a crashed engine is a 503 at once, while Serve restarts it

    async def __init__(self, config: dict):
        self.replica = EngineReplica(config)
        await super().__init__(config, LocalEngine(self.replica))
        self._saw_stats({"max_model_len": self.replica.max_model_len})   # known here, not probed

    async def submit(self, *args, **kwargs) -> AsyncIterator[Any]:
        outputs = self.replica.submit(*args, **kwargs)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()   # now: the replica's stream aborts the request if it did not finish

    async def abort(self, request_id: str) -> None:
        await self.replica.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self.replica.stats()

    async def engine_info(self) -> dict[str, Any]:
        return await self.replica.engine_info()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.replica.record_routing_stats()

    def check_health(self) -> None:
        self.replica.check_health()

    async def __del__(self):  # Serve calls this when it stops the replica
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()
        await super().__del__()   # the ASGI app's lifespan


# ---- building and running ----------------------------------------------------------------------
def engine_deployment_options(config: ServeConfig) -> dict[str, Any]:
    """Serve options of the engine deployment: replica count/autoscaling, resources, routing, caps."""
    bundle = config.resources_per_rank.bundle()
    opts: dict[str, Any] = dict(
        name="LLMServer",
        max_ongoing_requests=config.llm_server_max_ongoing,
        max_queued_requests=-1,   # the ingress's Admission bounds what waits (see cluster/router.py)
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
