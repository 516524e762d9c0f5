"""EAGLE on tensor-parallel replicas through the whole stack: the flagship `deploy/examples/gpu-tp2`
rendered and started on this CPU (TP 2 + a head, speculating), a head that does not fit failing the
deployment with the engine's reason, and a rank killed mid-generation failing only its replica while
its requests finish elsewhere."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from pathlib import Path

import pytest
import requests
import yaml

from cluster.config import ServeConfig
from tests.cluster.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
NO_EOS = {"ignore_eos": True}


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def rendered_app_args(example: str) -> dict:
    """The `args` of our app in the RayService `deploy render` writes for `example`."""
    from deploy.kuberay import render_files

    files = render_files(REPO / "deploy" / "examples" / example / "serve.yaml")
    service = next(yaml.safe_load(text) for text in files.values() if "kind: RayService" in text)
    apps = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    return next(a for a in apps if a["import_path"] == "cluster.serve_app:app_builder")["args"]


def on_this_cpu(args: dict, target: Path, head: Path, name: str, **overrides) -> ServeConfig:
    """The rendered settings with the same TP + head shape, moved onto this CPU and a tiny target."""
    keep = {k: v for k, v in args.items() if k not in ("api_keys_env", "host", "port")}
    keep.update(model=str(target), draft=str(head), device="cpu", dtype="float32", app_name=name,
                served_model_name="tiny", resources_per_rank={"cpu": 0.5, "gpu": 0}, kv_cache_gb=0.01,
                api_keys=["test-key"], limits={"max_model_len": 128, "max_tokens": 48, "max_num_seqs": 4},
                speculation={"adaptive": False}, **overrides)
    return ServeConfig(**keep)


def test_the_gpu_tp2_example_runs_here_with_speculation(deploy, copying_target):
    from eagle_worker import LLM, SamplingParams

    args = rendered_app_args("gpu-tp2")
    assert args["tp_size"] == 2 and args["draft"] and args["device"] == "cuda"
    target, head = copying_target
    app = deploy(on_this_cpu(args, target, head, "gputp2"), "/gputp2")
    plain = LLM(model=str(target), draft=None, block_size=16, num_kv_blocks=64)
    for prompt in ["The quick brown fox", "def add(a, b):\n"]:
        want = plain.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].text
        got = app.client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body=NO_EOS)
        assert got.choices[0].text == want
    text = requests.get(f"{app.url}/metrics", headers={"Authorization": "Bearer test-key"}).text
    assert _metric(text, "eagle_target_forwards_total") < _metric(text, "eagle_generation_tokens_total") / 2  # tau > 2


def test_a_head_that_does_not_fit_fails_the_deployment_with_the_engines_reason(deploy, copying_target, tmp_path):
    import json
    import shutil

    from cluster.serve_app import deploy_app

    target, good = copying_target
    head = tmp_path / "head"
    shutil.copytree(good, head)                      # its MLP tensors no longer fit the config
    raw = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**raw, "intermediate_size": 2 * raw["intermediate_size"]}))
    cfg = on_this_cpu(rendered_app_args("gpu-tp2"), target, head, "badhead")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine refused this replica's settings") as failure:
        deploy_app(cfg, "/badhead")
    assert str(head) in str(failure.value) and time.monotonic() - started < 240
    from ray import serve

    serve.delete("badhead")


def _kill_one_rank_worker() -> int:
    """SIGKILL the process of one non-zero TP rank (a TPRankWorker actor, `ray::TPRankWorker...`) of
    this process's Ray (its raylet is our child): another test process may run TP ranks too."""
    import psutil

    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if any("TPRankWorker" in part for part in cmdline):
            os.kill(proc.pid, signal.SIGKILL)
            return proc.pid
    raise AssertionError("no TP rank worker process found")


def test_a_rank_killed_mid_generation_fails_only_its_replica(deploy, copying_target):
    """Two TP 2 replicas speculating; one rank-1 process is killed while requests run: its replica
    fails (rank 0's collective errors out, the engine loop dies, Serve replaces the replica) and the
    router sends its non-streamed requests to the other replica, so every request answers right."""
    from eagle_worker import LLM, SamplingParams

    target, head = copying_target
    cfg = on_this_cpu(rendered_app_args("gpu-tp2"), target, head, "rankdeath", autoscaling=None, num_replicas=2)
    app = deploy(cfg, "/rankdeath")
    prompts = [f"The quick brown fox {i}" for i in range(12)]
    plain = LLM(model=str(target), draft=None, block_size=16, num_kv_blocks=64)
    want = [o.text for o in plain.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))]

    def ask(p):
        return app.client.completions.create(model="tiny", prompt=p, max_tokens=48, temperature=0,
                                             extra_body=NO_EOS).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        time.sleep(1.0)
        _kill_one_rank_worker()
        unfinished_at_kill = sum(not f.done() for f in futures)
        got = [f.result(timeout=300) for f in futures]
    assert unfinished_at_kill > 0
    assert got == want
    from ray import serve

    def replaced():       # the failed replica is gone and a new one runs in its place
        st = serve.status().applications["rankdeath"].deployments["LLMServer"]
        return st.replica_states.get("RUNNING", 0) == 2
    assert wait_for(replaced, timeout=120)
