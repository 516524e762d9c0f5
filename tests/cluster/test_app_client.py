"""A job's rows through a running serving app (cluster/app_client.py): real Ray, real Serve, the app's
router and HTTP ingress, the fake engine. Online requests go ahead of a job's rows (asserted from the
router's and the replicas' counters, not from timings); a reported backlog grows the app to its
max_replicas and clearing it shrinks the app back."""
from __future__ import annotations

import asyncio
import re
import threading

import openai
import pytest
import requests

from cluster.app_client import AppClient, AppNotFoundError
from cluster.config import ServeConfig
from tests.cluster.conftest import FAKE, wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")]
APP = "jobs-app"
LIMITS = {"max_model_len": 256, "max_tokens": 64, "max_num_seqs": 2, "max_queued_requests": 4}


@pytest.fixture(scope="module")
def app(deploy):
    cfg = ServeConfig(model="fake", engine=FAKE, app_name=APP, num_replicas=1, resources_per_rank={"cpu": 0.25},
                      limits=LIMITS)
    return deploy(cfg, "/jobs")


def _rows(client: AppClient, prompts: list[str], max_tokens: int) -> list:
    """Each row's last output, sent at offline priority all at once (the router holds back what does
    not fit)."""
    async def one(i, prompt):
        last = None
        async for out in client.generate(f"row-{i}", prompt, {"max_tokens": max_tokens, "temperature": 0}):
            last = out
        return last

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return asyncio.run(run())


def _replica_stats(client: AppClient) -> dict:
    return client.handle.stats.remote().result(timeout_s=30)


def test_a_missing_app_is_named_with_the_running_ones(app):
    with pytest.raises(AppNotFoundError, match=rf"no Serve app 'nope'.*{APP}"):
        AppClient("nope")


def test_engine_config_is_what_the_replica_runs(app):
    cfg = AppClient(APP).engine_config()
    assert (cfg["model"], cfg["engine"], cfg["max_model_len"], cfg["draft"]) == ("fake", FAKE, 256, None)


def test_a_row_gets_the_text_an_http_request_gets(app):
    client = AppClient(APP)
    (row,) = _rows(client, ["The capital of France is"], 8)
    http = app.client.completions.create(model="fake", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert row.finished and row.text == http.choices[0].text


def test_online_requests_go_ahead_of_a_running_job(app):
    client = AppClient(APP)
    online = openai.OpenAI(base_url=f"{app.url}/v1", api_key="x", max_retries=0, timeout=120)
    online.completions.create(model="fake", prompt="warm", max_tokens=1)       # the ingress's router is up
    before = _replica_stats(client)
    rows: list = []
    job = threading.Thread(target=lambda: rows.extend(_rows(client, [f"[slow:0.05] row {i}" for i in range(12)], 24)))
    job.start()
    try:
        assert wait_for(lambda: _replica_stats(client)["num_running"] == 2, timeout=60), "the job never filled the batch"
        answers: list = []

        def chat(i):
            answers.append(online.completions.create(model="fake", prompt=f"[slow:0.05] chat {i}", max_tokens=4))
        threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        mid = _replica_stats(client)
    finally:
        job.join(300)
    assert [a.usage.completion_tokens for a in answers] == [4, 4, 4]
    # the online requests finished while most of the job's rows had not run yet
    assert mid["offline_finished"] - before["offline_finished"] < 12, mid
    assert mid["online_finished"] - before["online_finished"] >= 3
    assert AppClient.router_counters()["offline_deferred"] >= 1      # rows held back while online ran
    assert len(rows) == 12 and all(r.finished and len(r.token_ids) == 24 for r in rows)
    after = _replica_stats(client)
    assert after["offline_finished"] - before["offline_finished"] == 12
    text = requests.get(f"{app.url}/metrics", timeout=30).text
    assert re.search(r"^eagle_replica_offline_finished_total{[^}]*} [1-9]", text, re.M), text[-2000:]
    assert re.search(r"^eagle_replica_torch_threads{[^}]*} [1-9]", text, re.M)


def _running(app_name: str) -> int:
    from ray import serve

    return serve.status().applications[app_name].deployments["LLMServer"].replica_states.get("RUNNING", 0)


def test_a_reported_backlog_grows_the_app_to_max_replicas_and_clearing_it_shrinks_it(deploy):
    name = "backlog-app"
    cfg = ServeConfig(model="fake", engine=FAKE, app_name=name, resources_per_rank={"cpu": 0.25}, limits=LIMITS,
                      autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2,
                                   "upscale_delay_s": 0, "downscale_delay_s": 2,
                                   "look_back_period_s": 2, "metrics_interval_s": 0.5})
    deploy(cfg, "/backlog")
    assert _running(name) == 1
    client = AppClient(name)
    seen: list[int] = []

    def grown():
        seen.append(_running(name))
        client.report_backlog("job-a", 500)       # a driver repeats its report while rows remain
        return seen[-1] == 3
    assert wait_for(grown, timeout=120, interval=0.5), f"no scale-up for the backlog: {seen}"
    assert max(seen) <= 3                           # never beyond max_replicas
    client.clear_backlog("job-a")
    assert wait_for(lambda: _running(name) == 1, timeout=120, interval=0.5), "no scale-down after the job"


def test_a_backlog_report_expires_when_its_driver_stops_repeating_it(ray_cluster):
    from cluster import backlog

    board = backlog.board("expiry-app")
    board.report.remote("job-b", 7, 0.5)
    assert ray_cluster.get(board.total.remote()) == 7
    assert wait_for(lambda: ray_cluster.get(board.total.remote()) == 0, timeout=30)
