"""The OpenAI-compatible FastAPI ingress deployment (`OpenAIIngress`): auth, validation, chat templating
and tokenization, the engine requests of a completion (n choices, retries), SSE, /health, /models and
/metrics; errors in OpenAI's shape."""

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.admission import Admission, OverloadedError
from cluster.config import ServeConfig
from cluster.engine_settings import engine_config
from cluster.ingress_prompts import IngressPrompts
from cluster.metrics import CLIENT_CLOSED, ServeMetrics, StatusCounter, note_status, set_active
from cluster.openai_body import read_json_object
from cluster.openai_errors import APIError, context_error, prompt_context_error, validation_error
from cluster.openai_render import ChatRender, CompletionRender, all_or_none, merge_streams
from cluster.openai_requests import ChatCompletionRequest, CompletionRequest
from cluster.openai_responses import ModelCard, ModelList, new_id, sse
from cluster.replica_errors import Failed, Rejected
from cluster.request_retry import PoisonRequestError, ReplicaLostError, stream_outputs
from cluster.router_state import live_replica_stats
from cluster.stream_response import Release, ReleasingStream
from eagle_worker.engine_api import kept_prompt_tokens, load_engine_module

logger = logging.getLogger(__name__)
api = FastAPI(title="eagle-serve", docs_url=None, redoc_url=None)


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (unknown route 404, wrong method 405) in OpenAI's shape."""
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = APIError(exc.status_code, message, type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, (TaskCancelledError, RequestCancelledError, ClientDisconnect)):   # the client went away: not a bug
        logger.info("request on %s cancelled: the client disconnected", request.url.path)
        return JSONResponse(APIError(CLIENT_CLOSED, "client closed the request", code="client_closed").body(),
                            status_code=CLIENT_CLOSED)
    logger.exception("unhandled error on %s", request.url.path)
    err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def _unavailable(e: Exception) -> APIError:
    """503s: a full system (retry later; the status middleware adds Retry-After) or a replica lost
    under the request; 500 for a request two replicas died under (not retried: it may be the cause)."""
    if isinstance(e, OverloadedError):
        return APIError(503, str(e), type="overloaded_error", code="overloaded")
    if isinstance(e, PoisonRequestError):
        return APIError(500, str(e), type="server_error", code="replicas_died")
    return APIError(503, str(e), type="server_error", code="replica_lost")


async def _within(when: float | None, limit: float | None, aw):
    """`await aw` before the loop time `when` (None: no deadline); past it, the 504 of
    `limits.request_timeout_s` (the caller's `finally` closes the choices: the engine aborts them).
    wait_for, not asyncio.timeout: Python 3.10 has no asyncio.timeout."""
    if when is None:
        return await aw
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(aw, timeout=max(0.0, when - loop.time()))
    except asyncio.TimeoutError:
        if loop.time() < when:      # raised inside `aw`, not our deadline
            raise
        raise APIError(504, f"the request did not finish within limits.request_timeout_s ({limit:g} s)",
                       type="timeout_error", code="request_timeout") from None


def _accepted(out: Any) -> Any:
    """A request's first output, or the 400 of one the engine refused (bad input)."""
    if isinstance(out, Rejected):
        raise APIError(400, out.message, param=out.param, code=out.code)
    return _unless_failed(out)


def _as_asked(e: APIError, req) -> APIError:
    """A replica refuses a format (a grammar that compiles but can produce nothing) in the engine's
    words: the error names the field the client sent, as the ingress's own refusals do."""
    if e.param == "structured_outputs":
        e.param, e.message = req.structured_field, req.as_asked(e.message)
    return e


def _unless_failed(out: Any) -> Any:
    """An output, or the 500 of a request the engine failed (its step raised; the replica lives on)."""
    if isinstance(out, Failed):
        raise APIError(500, out.message, type="server_error")
    return out


# Counts every request by final status: keep this the last middleware added (the outermost), and
# above `serve.ingress(api)`, which freezes a copy of the app.
api.add_middleware(StatusCounter)


@serve.ingress(api)
class OpenAIIngress:
    engine_attempts = 6   # a request whose replica died goes to another (cluster/request_retry.py)

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
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              type="authentication_error", code="invalid_api_key")

    async def _parse(self, request: Request, model_cls):
        self._check_auth(request)
        body = await read_json_object(request, self.config.limits.max_request_body_bytes,
                                         self.config.limits.request_body_timeout_s)
        try:
            if "structured_outputs" in body or "response_format" in body:   # compiles a grammar: off the event loop
                req = await asyncio.to_thread(model_cls.model_validate, body)
            else:
                req = model_cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        self._known_model(req.model)
        return req

    def _known_model(self, name: str) -> None:
        """The served name, or the model's path or id as the config gives it (vLLM's default name)."""
        if name not in (self.config.model_name, self.config.model):
            shown = repr(name) if len(name) <= 200 else f"{name[:200]!r}... ({len(name)} characters)"
            raise APIError(404, f"model {shown} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    def _max_tokens(self, requested: int | None, default: int, field: str = "max_tokens") -> int:
        limit = self.config.limits.max_tokens
        if requested is not None and requested > limit:
            raise APIError(400, f"{field}: {requested} exceeds this server's limit of {limit}", param=field)
        return requested if requested is not None else min(default, limit)

    async def _first(self, it: AsyncIterator[Any]) -> Any:
        """The first output, with refusals and overload turned into HTTP errors before headers go out."""
        try:
            out = await it.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the engine returned no output", type="server_error") from None
        except (OverloadedError, ReplicaLostError) as e:
            raise _unavailable(e) from None
        return _accepted(out)

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

    def _check_count(self, req, num_prompts: int) -> None:
        """Each choice (n per prompt) is admitted as a request: more than fit at once would wait forever."""
        limit = self.admission.offline_limit if req.priority > 0 else self.admission.limit
        if num_prompts * req.n > limit:
            what = f"{num_prompts} prompts x n {req.n}" if num_prompts > 1 else f"{req.n} samples"
            raise APIError(400, f"{'prompt' if num_prompts > 1 else 'n'}: {what} are more requests than this "
                           f"server admits at once ({limit})", param="prompt" if num_prompts > 1 else "n")

    async def _run(self, endpoint: str, req, prompts: list[list[int]], max_tokens: int, render):
        """Shared body of both endpoints: `n` engine requests per prompt of token ids (choice i =
        prompt * n + sample is `<id>-<i>`, with seed + sample); `render` builds the responses/chunks."""
        t0 = time.monotonic()
        timeout = self.config.limits.request_timeout_s
        when = None if timeout is None else asyncio.get_running_loop().time() + timeout
        count = len(prompts) * req.n      # checked against what the server admits (_check_count) by the caller
        rid = new_id(render.prefix)
        sub_ids = [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]
        its = [stream_outputs(self.engine, sub, prompts[i // req.n],
                              req.sampling_params(max_tokens, i % req.n, i // req.n),
                              req.priority, restartable=not req.stream, on_retry=self.metrics.retried,
                              max_attempts=self.engine_attempts,
                              group=f"{rid}/{i // req.n}" if req.n > 1 else None,   # one prompt's samples
                              stream_interval=self.config.ingress.stream_interval if req.stream else 0)
               for i, sub in enumerate(sub_ids)]
        try:        # every choice now or none: a stream's later choices start after its headers went out
            self.admission.enter(req.priority, count)
        except OverloadedError as e:
            raise _unavailable(e) from None
        self.metrics.inflight.labels(self.config.model_name).inc()
        status = 500
        try:
            # headers wait for the first output of every choice (refusals become HTTP errors), a
            # stream's only for each prompt's first choice (a prompt the engine refuses is a 400
            # there too): the others join as they start (with n above the engine's free slots,
            # later choices start as earlier ones finish)
            started = [i for i in range(len(its)) if not req.stream or i % req.n == 0]
            firsts = [None] * len(its)
            for i, out in zip(started, await _within(when, timeout, self._firsts([its[i] for i in started]))):
                firsts[i] = out
            ttft = time.monotonic() - t0
            self.metrics.first_token(ttft)
            if not req.stream:
                done = await _within(when, timeout, all_or_none([self._last(it, f) for it, f in zip(its, firsts)]))
                for last, _ in done:
                    self._finish(last, t0, ttft)
                status = 200
                body = render.full(rid, [last for last, _ in done], [lps for _, lps in done])
                return JSONResponse(body.model_dump(mode="json"))
            status = 200
            release = Release(lambda: self._release(req, its))
            return ReleasingStream(self._sse(its, firsts, rid, req, render, t0, ttft, when, release), release,
                                   media_type="text/event-stream",
                                   headers={"Cache-Control": "no-cache"})
        except APIError as e:
            status = e.status
            raise _as_asked(e, req) from None
        finally:
            if not req.stream or status != 200:     # a stream's response releases it (cluster/stream_response.py)
                await self._release(req, its)

    async def _release(self, req, its: list) -> None:
        """What an admitted request holds: its admission slot, the in-flight gauge, its engine streams."""
        self.metrics.inflight.labels(self.config.model_name).dec()
        self.admission.leave(req.priority, len(its))
        for it in its:
            await it.aclose()

    async def _sse(self, its: list, firsts: list, rid: str, req, render, t0: float, ttft: float,
                   when: float | None, release: Release) -> AsyncIterator[str]:
        lasts = list(firsts)
        timeout = self.config.limits.request_timeout_s
        outputs = merge_streams(its, firsts, within=None if when is None else lambda aw: _within(when, timeout, aw))
        try:
            for chunk in render.head(rid):
                yield sse(chunk)
            while (item := await anext(outputs, None)) is not None:
                i, out = item
                lasts[i] = out = _accepted(out)      # a later choice's first output may be a refusal
                self.metrics.tokens(len(out.new_token_ids))
                yield sse(render.chunk(rid, i, out))
            if req.include_usage:
                yield sse(render.usage_chunk(rid, lasts))
            for last in lasts:
                self._finish(last, t0, ttft, count_tokens=False)
        except (ReplicaLostError, OverloadedError) as e:
            err = _unavailable(e)
            note_status(err.status)
            yield sse(err.body())
        except APIError as e:
            note_status(e.status)
            yield sse(e.body())
        except Exception as e:  # never end a stream silently
            logger.exception("stream %s failed", rid)
            note_status(500)
            yield sse(APIError(500, f"internal error: {e!r}", type="server_error").body())
        finally:
            await outputs.aclose()   # stops the choices' readers before their streams close
            await release()
        yield "data: [DONE]\n\n"

    def _finish(self, out, t0: float, ttft: float, count_tokens: bool = True) -> None:
        if count_tokens:
            self.metrics.tokens(len(out.token_ids))
        self.metrics.finished(out, time.monotonic() - t0, ttft)

    # ---- routes ------------------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        max_tokens = 1 if req.score_only else self._max_tokens(req.max_tokens, default=16)
        self._check_count(req, len(req.prompts))      # before tokenizing a batch that cannot run
        ids, texts = [], []
        truncating = req.truncate_prompt_tokens is not None
        for prompt in req.prompts:
            prompt_ids, text = await self.prompts.completion(prompt, self._context(), req.echo, truncating)
            kept = self._truncated(prompt_ids, req.truncate_prompt_tokens, max_tokens)
            if req.echo and len(kept) < len(prompt_ids):      # echo what the model reads
                _, text = await self.prompts.completion(kept, self._context(), need_text=True)
            prompt_ids = kept
            self._fits_context(len(prompt_ids), None if req.score_only else req.max_tokens, prompt_field="prompt")
            ids.append(prompt_ids)
            texts.append(text)
        render = CompletionRender(self.config.model_name, self.prompts, req, texts, ids)
        return await self._run("completions", req, ids, max_tokens, render)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        try:
            messages = req.template_messages()
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        max_tokens = self._max_tokens(req.requested_max_tokens, self.config.limits.max_tokens, req.max_tokens_field)
        self._check_count(req, 1)
        ids = await self.prompts.chat(messages, self._context(), req.truncate_prompt_tokens is not None)
        ids = self._truncated(ids, req.truncate_prompt_tokens, max_tokens)
        self._fits_context(len(ids), req.requested_max_tokens, req.max_tokens_field, prompt_field="messages")
        return await self._run("chat", req, [ids], max_tokens, ChatRender(self.config.model_name, self.prompts, req))

    def _truncated(self, ids: list[int], truncate: int | None, max_tokens: int) -> list[int]:
        """The prompt's tokens the request keeps (truncate_prompt_tokens), by the engine's own rule; with
        the context not known yet, the replica's engine cuts them by the same rule."""
        context = self._context()
        if truncate is None or context is None:
            return ids
        try:
            keep = kept_prompt_tokens(truncate, len(ids), context, max_tokens)
        except ValueError as e:
            raise APIError(400, str(e).removeprefix("SamplingParams."), param="truncate_prompt_tokens") from None
        return ids[len(ids) - keep:]

    def _fits_context(self, prompt_tokens: int, requested: int | None, field: str = "max_tokens",
                      prompt_field: str = "prompt") -> None:
        """A max_tokens the client asked for that cannot fit beside the prompt is a 400, as OpenAI and
        vLLM answer it (without one, generation stops at the context with finish_reason length);
        so is a prompt that leaves no room for one token, naming the field that holds it."""
        context = self._context()
        if context and prompt_tokens >= context:
            raise APIError(400, prompt_context_error(prompt_tokens, context), param=prompt_field,
                           code="context_length_exceeded")
        if requested and context and prompt_tokens + requested > context:
            raise APIError(400, context_error(prompt_tokens, requested, context), param=field,
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

    @api.api_route("/v1/models", methods=["GET", "HEAD"])     # HEAD: probes that check a path exists
    async def models(self, request: Request):
        self._check_auth(request)
        return JSONResponse(ModelList(data=[await self._model_card()]).model_dump(mode="json"))

    @api.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])   # the client's models.retrieve()
    async def model(self, request: Request, model_id: str):
        self._check_auth(request)
        self._known_model(model_id)
        return JSONResponse((await self._model_card()).model_dump(mode="json"))

    async def _model_card(self) -> ModelCard:
        if self.max_model_len is None:
            try:
                await self._probe_stats(timeout=2)
            except Exception:
                pass
        return ModelCard(id=self.config.model_name, root=self.config.model, max_model_len=self.max_model_len)

    @api.api_route("/health", methods=["GET", "HEAD"])
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
