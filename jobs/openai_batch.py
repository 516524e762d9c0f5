"""OpenAI Batch output lines: one per request, in the shape OpenAI's Batch API writes them.

A bad request is a `status_code` 400 line with an `error` body (what OpenAI answers for it; 404 for
a model the job does not run); a row the server failed (its engine step raised, its replicas died)
is a 500 `server_error` line, which a client may send again as it is. A finished one carries the
chat.completion / text_completion body, with `logprobs` in OpenAI's shape when the request asked
for them (built in the replica, jobs/replica_pool.py, where the tokenizer is).
"""
from __future__ import annotations

import time

from jobs.id_set import id_digest

# an error row the server is to blame for, not the request (rec | SERVER_ERROR): a 500 in Batch output
SERVER_ERROR = {"error_type": "server_error"}


def openai_line(rec: dict) -> dict:
    """One line of an OpenAI Batch output file for a finished (or failed) row."""
    digest = id_digest(rec["id"]).hex()[:24]
    if rec.get("error") is not None:
        server = rec.get("error_type") == "server_error"
        status = 500 if server else 404 if rec.get("error_code") == "model_not_found" else 400
        body = {"error": {"message": rec["error"], "type": "server_error" if server else "invalid_request_error",
                          "param": rec.get("error_param"), "code": rec.get("error_code")}}
        return {"id": f"batch_req_{digest}", "custom_id": rec["id"],
                "response": {"status_code": status, "request_id": digest, "body": body}, "error": None}
    finish = {"stop": "stop", "length": "length"}.get(rec.get("finish_reason"), rec.get("finish_reason"))
    usage = {"prompt_tokens": rec["prompt_tokens"], "completion_tokens": rec["completion_tokens"],
             "total_tokens": rec["prompt_tokens"] + rec["completion_tokens"]}
    logprobs = rec.get("logprobs")
    if rec.get("chat"):
        choice = {"index": 0, "message": {"role": "assistant", "content": rec["text"]},
                  "logprobs": logprobs, "finish_reason": finish}
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": rec["text"], "logprobs": logprobs, "finish_reason": finish}
        obj, prefix = "text_completion", "cmpl"
    body = {"id": f"{prefix}-{digest}", "object": obj, "created": int(time.time()),
            "model": rec.get("model"), "choices": [choice], "usage": usage,
            "eagle": {"accepted_tokens_per_step": rec.get("accepted_tokens_per_step"),
                      "latency_s": rec.get("latency_s"), "ttft_s": rec.get("ttft_s")}}
    return {"id": f"batch_req_{digest}", "custom_id": rec["id"],
            "response": {"status_code": 200, "request_id": digest, "body": body}, "error": None}


MIN_LOGPROB = -9999.0  # JSON has no -inf (OpenAI and vLLM report -9999.0 too)


def openai_logprobs(entries: list, token_ids: list[int], prompts, chat: bool) -> dict:
    """A choice's `logprobs` as OpenAI writes it: chat `{"content": [{token, logprob, bytes, top_logprobs}]}`,
    completions `{tokens, token_logprobs, top_logprobs, text_offset}`. `entries` are the engine's
    TokenLogprob(token_id, logprob, top=[(id, logprob)]) aligned with `token_ids`; `prompts`: the
    model's PromptTokenizer (token texts and bytes)."""
    def lp(v: float) -> float:
        return max(float(v), MIN_LOGPROB)

    token_text = prompts.token_text
    if chat:
        content = []
        for e, tid in zip(entries, token_ids):
            content.append({"token": token_text(tid), "logprob": lp(e.logprob), "bytes": prompts.token_bytes(tid),
                            "top_logprobs": [{"token": token_text(t), "logprob": lp(v), "bytes": prompts.token_bytes(t)}
                                             for t, v in e.top]})
        return {"content": content}
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for e, tid in zip(entries, token_ids):
        text = token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(lp(e.logprob))
        alternatives = {token_text(t): lp(v) for t, v in e.top}
        alternatives.setdefault(text, lp(e.logprob))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


