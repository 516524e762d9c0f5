"""Engine outputs -> OpenAI responses and streamed chunks, for n choices, with logprobs as OpenAI
(and vLLM) format them: token text, not ids; completions' `tokens` / `token_logprobs` /
`top_logprobs` (dicts of text -> logprob, the chosen token included) / `text_offset`; chat's
`content` list of `{token, logprob, bytes, top_logprobs}`.

Token texts come from the ingress's prompt tokenizer (the engine sends ids); per-choice state
(streamed text offsets, whether the echoed prompt went out) lives in the render of one request.
"""
from __future__ import annotations

import asyncio
import codecs
import time
from typing import Any, AsyncIterator

from cluster.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
    finish_reason,
    usage,
)

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM reports -9999.0 too)


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _entry(e: Any) -> tuple[float, list[tuple[int, float]]] | None:
    """(logprob, top alternatives) of an engine logprob entry (a TokenLogprob; a bare float from an
    engine that reports only the chosen token's)."""
    if e is None:
        return None
    if isinstance(e, (int, float)):
        return float(e), []
    return e.logprob, list(e.top)


def _total_usage(outs: list, n: int, generated: bool = True) -> Usage:
    """Each prompt counted once (choices p*n .. p*n+n-1 share prompt p), every completion summed."""
    return usage(sum(len(o.prompt_token_ids) for o in outs[::n]), sum(len(o.token_ids) for o in outs) if generated else 0)


class _Render:
    def __init__(self, model: str, prompts, req):
        self.model, self.prompts, self.req = model, prompts, req
        self.created = int(time.time())      # one timestamp for every chunk of the request (OpenAI's rule)
        self.want_logprobs = req.num_logprobs is not None
        self.score_only = getattr(req, "score_only", False)   # the one generated token is not shown

    def usage_chunk(self, rid: str, outs: list):
        return self.response_cls(id=rid, created=self.created, model=self.model, choices=[],
                                 usage=_total_usage(outs, self.req.n, not self.score_only))


class CompletionRender(_Render):
    prefix = "cmpl"
    response_cls = CompletionResponse

    def __init__(self, model: str, prompts, req, prompt_texts: list[str], prompt_ids: list[list[int]]):
        """`prompt_texts` / `prompt_ids`: each prompt of the request; choice i answers prompt i // n."""
        super().__init__(model, prompts, req)
        self.prompt_texts, self.prompt_ids = prompt_texts, prompt_ids
        self._offsets: dict[int, tuple[int, bytes]] = {}   # choice -> (text offset, bytes of a partial character)
        # a BOS the tokenizer added is an echoed token that the echoed text does not hold: no width
        bos = getattr(prompts, "bos_token", None)
        self._unseen_bos = [bool(bos and ids and prompts.token_text(ids[0]) == bos and not text.startswith(bos))
                            for text, ids in zip(prompt_texts, prompt_ids)]

    def logprobs(self, entries: list, token_ids: list[int], offset: int, echoed: bool = False,
                 pending: bytes = b"", unseen_bos: bool = False) -> tuple[dict[str, Any], int, bytes]:
        """`echoed`: the first entries are the echoed prompt's (offsets within the echoed text).
        A token advances the offset by the characters its bytes complete (`pending`: the bytes of a
        character begun by earlier tokens), so a character split over tokens counts once."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for k, (e, tid) in enumerate(zip(entries, token_ids)):
            text = self.prompts.token_text(tid)
            tokens.append(text)
            offsets.append(offset)
            if not (echoed and k == 0 and unseen_bos):
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                offset += len(decoder.decode(pending + bytes(self.prompts.token_bytes(tid))))
                pending = decoder.getstate()[0]
            got = _entry(e)
            if got is None:          # the first prompt token has no logprob
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            lp, top = got
            token_logprobs.append(_lp(lp))
            alternatives = {self.prompts.token_text(t): _lp(v) for t, v in top}
            alternatives.setdefault(text, _lp(lp))
            top_logprobs.append(alternatives)
        return dict(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets), offset, pending

    def _echoed(self, p: int, prompt_lps: list | None) -> tuple[list, list[int]]:
        """Prompt p's share of an echoed choice's logprobs."""
        if not (self.req.echo and self.want_logprobs):
            return [], []
        return list(prompt_lps or [None] * len(self.prompt_ids[p])), list(self.prompt_ids[p])

    def full(self, rid: str, outs: list, prompt_lps: list[list | None]) -> CompletionResponse:
        """`prompt_lps`: each choice's prompt logprobs (with echo and logprobs)."""
        choices = []
        for i, (out, lps) in enumerate(zip(outs, prompt_lps)):
            p, logprobs = i // self.req.n, None
            if self.want_logprobs:
                entries, ids = self._echoed(p, lps)
                gen, gen_ids = ([], []) if self.score_only else (list(out.logprobs or []), list(out.token_ids))
                logprobs = self.logprobs(entries + gen, ids + gen_ids, 0, echoed=bool(ids),
                                         unseen_bos=self._unseen_bos[p])[0]
            text = (self.prompt_texts[p] if self.req.echo else "") + ("" if self.score_only else out.text)
            choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs,
                                               finish_reason=finish_reason(out.finish_reason)))
        return CompletionResponse(id=rid, created=self.created, model=self.model, choices=choices,
                                     usage=_total_usage(outs, self.req.n, not self.score_only))

    def head(self, rid: str) -> list:
        return []

    def chunk(self, rid: str, i: int, out) -> CompletionResponse:
        first, p = i not in self._offsets, i // self.req.n
        text, logprobs = ("" if self.score_only else out.delta_text), None
        if first and self.req.echo:
            text = self.prompt_texts[p] + text
        if self.want_logprobs:
            entries, ids = self._echoed(p, getattr(out, "prompt_logprobs", None)) if first else ([], [])
            if not self.score_only:
                entries, ids = entries + list(getattr(out, "new_logprobs", None) or []), ids + list(out.new_token_ids)
            offset, pending = self._offsets.get(i, (0, b""))
            logprobs, *self._offsets[i] = self.logprobs(entries, ids, offset, echoed=first and self.req.echo,
                                                        pending=pending, unseen_bos=self._unseen_bos[p])
        else:
            self._offsets[i] = (0, b"")
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs,
                                     finish_reason=finish_reason(out.finish_reason))
        return CompletionResponse(id=rid, created=self.created, model=self.model, choices=[choice])


class ChatRender(_Render):
    prefix = "chatcmpl"
    response_cls = ChatCompletionChunk

    def logprobs(self, entries: list, token_ids: list[int]) -> dict[str, Any]:
        content = []
        for e, tid in zip(entries, token_ids):
            got = _entry(e)
            if got is None:
                continue
            lp, top = got
            content.append(dict(self._token(tid, lp), top_logprobs=[self._token(t, v) for t, v in top]))
        return {"content": content}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.prompts.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": self.prompts.token_bytes(token_id)}

    def full(self, rid: str, outs: list, prompt_lps: list | None = None) -> ChatCompletionResponse:
        """`prompt_lps`: unused (chat has no echo)."""
        choices = [ChatChoice(index=i, message=ChatCompletionMessage(content=out.text),
                                 logprobs=self.logprobs(out.logprobs or [], out.token_ids) if self.want_logprobs else None,
                                 finish_reason=finish_reason(out.finish_reason))
                   for i, out in enumerate(outs)]
        return ChatCompletionResponse(id=rid, created=self.created, model=self.model, choices=choices,
                                      usage=_total_usage(outs, self.req.n))

    def head(self, rid: str) -> list:
        return [ChatCompletionChunk(id=rid, created=self.created, model=self.model, choices=[
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(self.req.n)]

    def chunk(self, rid: str, i: int, out) -> ChatCompletionChunk:
        delta = DeltaMessage(content=out.delta_text if out.delta_text or not out.finished else None)
        logprobs = self.logprobs(getattr(out, "new_logprobs", None) or [], out.new_token_ids) if self.want_logprobs else None
        return ChatCompletionChunk(id=rid, created=self.created, model=self.model, choices=[
            ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason(out.finish_reason))])


async def merge_streams(its: list, firsts: list, within=None) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) of n engine streams as they come, each one's `first` output first
    (None: that stream has not started yet; its outputs come as it does). Each stream is read by
    its own task up to its finished (or failed) output; closing this generator stops the readers,
    so the streams can then be closed (and their requests aborted). `within(awaitable)` bounds each
    wait for the next output (the request's deadline): applied here, to the queue, because a
    deadline wrapped around the generator's `anext` runs it in another task, and a client that
    disconnects then closes the generator while that task is still inside it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def read(i: int, it, out) -> None:
        try:
            while out is None or getattr(out, "finished", True) is False:
                out = await it.__anext__()
                queue.put_nowait((i, out))
        except StopAsyncIteration:
            pass
        except Exception as e:  # handed to the consumer, which answers it in the stream
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    for i, first in enumerate(firsts):
        if first is not None:
            yield i, first
    readers = [asyncio.create_task(read(i, it, first)) for i, (it, first) in enumerate(zip(its, firsts))]
    try:
        remaining = len(readers)
        while remaining:
            i, item = await (queue.get() if within is None else within(queue.get()))
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def all_or_none(coros: list) -> list:
    """Results of the choices' coroutines; the first to raise cancels the others (so their streams
    can be closed, and their engine requests aborted, at once)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
