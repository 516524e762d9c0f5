"""The job's engine replicas: `cluster.replica.EngineReplica` actors driven straight from the job driver.

Why not through Ray Serve and its router: an offline job wants whole results, not token streams,
and owns its replicas for its lifetime. Going through a Serve handle would stream every step of
every row through a second process. Here each replica is the cluster layer's `EngineReplica` (same
engine thread, same command queue, same rejection handling, offline priority 1) with one extra
method, `generate`, that consumes the stream inside the actor and returns one small dict per row.

Distribution: each row goes to the ready replica with the fewest rows in flight, and a replica
holds at most `in_flight_per_replica` rows (its batch plus a quarter by default), so every engine always
has its next rows queued while the driver holds only a bounded window of work.

Failures: a replica that dies (actor lost, node lost, engine loop crashed, a step hung past
`step_timeout_s`, seen by polling its health) is killed and replaced
(at most `replica_restarts` times per job); its in-flight rows go back to the driver, which sends
them again: nothing was written for them, so nothing is lost or duplicated. A row whose replicas
keep dying is written as an error row after `max_row_retries` re-runs. A serving replica lost with
a node the cluster took away (preempted after a drain, or shut down: cluster/death_cause.py) is
nobody's doing: it is replaced without using a restart, and its rows' re-runs count against no row
(up to FREE_NODE_LOSSES each). A replica Ray calls unreachable for now (`ActorUnavailableError`: a
network or GCS blip; it has not called the actor dead) is no death either: its failed rows go again as
free losses (`death_cause.free_loss`), it takes no new rows and is probed every UNREACHABLE_PROBE_S
until it answers (then it serves again), Ray calls it dead (replaced as above) or UNREACHABLE_LIMIT_S
pass (hung or gone for good: replaced with a restart).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.config import ServeConfig
from cluster.config_sections import Limits, RankResources
from cluster.cpu_threads import engine_env
from cluster.death_cause import free_loss, lost_with_node
from cluster.engine_settings import engine_config
from cluster.openai_errors import context_error
from cluster.replica import EngineReplica
from cluster.replica_errors import EngineDiedError, Failed, Rejected, ReplicaConfigError
from jobs.input_reader import Row
from jobs.job_config import JobConfig
from jobs.openai_batch import SERVER_ERROR, openai_logprobs

logger = logging.getLogger(__name__)
OFFLINE_PRIORITY = 1
HEALTH_EVERY_S = 5.0
UNREACHABLE_PROBE_S = 1.0      # an unreachable replica is asked this often whether it is back
UNREACHABLE_LIMIT_S = 60.0     # longer than Ray takes to call a vanished node's actors dead


def row_result(last) -> dict:
    """A finished row's output columns and counters from its last RequestOutput (both row backends)."""
    m = last.metrics or {}
    return {"text": last.text, "finish_reason": last.finish_reason,
            "prompt_tokens": len(last.prompt_token_ids), "completion_tokens": len(last.token_ids),
            "accepted_tokens_per_step": float(m.get("mean_accepted_tokens", 1.0)),
            "latency_s": m.get("latency_s"), "ttft_s": m.get("ttft_s"), "forwards": int(m.get("num_target_forwards", 0)),
            "cached_tokens": m.get("num_cached_tokens"), "num_preemptions": int(m.get("num_preemptions", 0))}


class JobFailed(RuntimeError):
    """The job cannot go on (no replica can start, every restart used); committed output stays."""


class JobReplica(EngineReplica):
    """EngineReplica plus a whole-result call for batch work. Settings the engine refuses are kept
    and reported by `info` (the actor stays up), so the pool fails the job at once instead of
    starting replicas that can never start."""

    def __init__(self, config: dict):
        self.config_error: str | None = None
        self._prompt_tokenizer = None          # token texts and bytes, made on the first row with logprobs
        try:
            super().__init__(config)
        except ReplicaConfigError as e:
            self.config_error = str(e)

    async def generate(self, request_id: str, prompt, params: dict, messages: list[dict] | None = None,
                       priority: int = OFFLINE_PRIORITY, check_context: bool = False) -> dict[str, Any]:
        """The whole result of one row. `check_context` (a max_tokens the request set, as in an OpenAI
        request): prompt + max_tokens beyond the context is refused, as OpenAI does, not cut short."""
        last = None
        async for out in self.submit(request_id, prompt, params, priority=priority, messages=messages,
                                     stream_interval=0):   # the first output (its prompt) and the result
            if isinstance(out, Rejected):
                return {"error": out.message, "error_param": out.param, **({"error_code": out.code} if out.code else {})}
            if isinstance(out, Failed):
                return {"error": out.message, **SERVER_ERROR}
            if last is None and check_context:
                n = len(out.prompt_token_ids)
                if n + params["max_tokens"] > self.max_model_len:
                    await self.abort(request_id)
                    return {"error": context_error(n, params["max_tokens"], self.max_model_len),
                            "error_param": "max_tokens", "error_code": "context_length_exceeded"}
            last = out
        res = row_result(last)
        if params.get("logprobs") is not None:
            prompts = await asyncio.to_thread(self._prompts)     # the first one loads it: off the event loop
            res["logprobs"] = openai_logprobs(list(last.logprobs or []), list(last.token_ids), prompts,
                                              chat=messages is not None)
        return res

    def _prompts(self):
        """The model's prompt tokenizer (token texts and bytes), made on the first row with logprobs."""
        if self._prompt_tokenizer is None:
            from eagle_worker.engine_api import load_engine_module

            backend = load_engine_module(self.config.engine)
            self._prompt_tokenizer = backend.load_prompt_tokenizer(engine_config(self.config))
        return self._prompt_tokenizer

    def info(self) -> dict[str, Any]:
        if self.config_error is not None:
            return {"config_error": self.config_error}
        return {"replica_id": self.replica_id, "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "max_model_len": self.max_model_len}


def serve_config(cfg: JobConfig, cpus: float) -> ServeConfig:
    """The cluster layer's replica config for this job's engine."""
    limits = dict(max_num_seqs=cfg.max_num_seqs, step_timeout_s=cfg.step_timeout_s)
    if cfg.max_model_len is not None:
        limits.update(max_model_len=cfg.max_model_len, max_tokens=cfg.max_model_len - 1)
    extra = {}
    if "enable_prefix_caching" in ServeConfig.model_fields:   # the serve config passes it to the engine
        extra["enable_prefix_caching"] = cfg.enable_prefix_caching
    return ServeConfig(model=cfg.model, draft=cfg.draft, dtype=cfg.dtype, device=cfg.device,
                       engine=cfg.engine, tp_size=cfg.tp_size, chat_template=cfg.chat_template,
                       limits=Limits(**limits), speculation=cfg.speculation, **extra,
                       resources_per_rank=RankResources(cpu=cpus, gpu=1 if cfg.device == "cuda" else 0))


def default_cpus_per_replica(cfg: JobConfig) -> float:
    """The cluster's CPUs split evenly over the replicas, no more than the biggest node has."""
    if cfg.cpus_per_replica is not None:
        return cfg.cpus_per_replica
    if cfg.device == "cuda":
        return 1.0
    total = ray.cluster_resources().get("CPU", 1.0)
    biggest = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=total)
    return float(max(1, int(min(biggest, total // (cfg.replicas * cfg.tp_size)))))


@dataclass
class _Replica:
    index: int
    actor: Any
    ready_ref: Any = None            # set while starting
    info: dict = field(default_factory=dict)
    in_flight: int = 0
    dead: bool = False
    pg: Any = None
    health_ref: Any = None           # a check_health call in flight
    health_at: float = 0.0
    spawned_at: float = field(default_factory=time.monotonic)
    unreachable_since: float | None = None   # set while Ray says it is unavailable (no new rows meanwhile)

    @property
    def started(self) -> bool:
        return self.ready_ref is None and not self.dead

    @property
    def ready(self) -> bool:
        return self.started and self.unreachable_since is None


@dataclass
class _Call:
    row: Row
    replica: _Replica
    sent_at: float


class ReplicaPool:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.cpus = default_cpus_per_replica(cfg)
        self.serve_cfg = serve_config(cfg, self.cpus).model_dump(mode="json")
        self.replicas: list[_Replica] = []
        self.calls: dict[Any, _Call] = {}   # ObjectRef -> call
        self.restarts_left = cfg.replica_restarts
        self.replicas_lost_with_node = 0    # replaced without using a restart (manifest)
        self._gate_met = False              # min_ready_replicas were ready once
        self.last_error: str | None = None
        self.rows_by_node: dict[str, int] = {}   # node id -> rows finished there (manifest)
        self._cls = ray.remote(JobReplica)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for i in range(self.cfg.replicas):
            self.replicas.append(self._spawn(i))

    def _spawn(self, index: int) -> _Replica:
        opts: dict[str, Any] = dict(num_cpus=self.cpus, max_restarts=0, max_concurrency=4 * self.cfg.in_flight_per_replica,
                                    scheduling_strategy="SPREAD", runtime_env={"env_vars": engine_env()})
        if self.cfg.device == "cuda":
            opts["num_gpus"] = 1
        pg = None
        if self.cfg.tp_size > 1:  # rank 0 (this actor) in bundle 0, the other ranks in the rest
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {"CPU": self.cpus, **({"GPU": 1} if self.cfg.device == "cuda" else {})}
            pg = placement_group([dict(bundle) for _ in range(self.cfg.tp_size)], strategy="PACK")
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
        actor = self._cls.options(**opts).remote(self.serve_cfg)
        return _Replica(index, actor, ready_ref=actor.info.remote(), pg=pg)

    def shutdown(self) -> None:
        for r in self.replicas:
            self._kill(r)
        self.calls.clear()

    def _kill(self, r: _Replica) -> None:
        r.dead = True
        try:
            ray.kill(r.actor, no_restart=True)
        except Exception:  # already gone
            pass
        if r.pg is not None:
            ray.util.remove_placement_group(r.pg)
            r.pg = None

    # ---- dispatch ----------------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        return sum(r.ready for r in self.replicas)

    @property
    def accepting(self) -> bool:
        """Ready replicas may take rows: `min_ready_replicas` of them are up, or none is still starting.
        The gate holds only until first met: a replacement that cannot be placed mid-job (the spot
        capacity gone) must not stop the replicas that are up."""
        ready = self.num_ready
        starting = sum(r.ready_ref is not None and not r.dead for r in self.replicas)
        if ready >= min(self.cfg.min_ready_replicas, self.cfg.replicas):
            self._gate_met = True
        return ready > 0 and (self._gate_met or not starting)

    def free_slots(self) -> int:
        limit = self.cfg.in_flight_per_replica
        return sum(limit - r.in_flight for r in self.replicas if r.ready)

    def submit(self, row: Row, params: dict) -> None:
        r = min((r for r in self.replicas if r.ready), key=lambda r: r.in_flight)
        sends = row.attempts + row.free_losses
        rid = str(row.id) if not sends else f"{row.id}#retry{sends}"
        ref = r.actor.generate.remote(rid, row.prompt, params, messages=row.messages, priority=OFFLINE_PRIORITY,
                                      check_context=row.strict_max_tokens and "max_tokens" in row.params)
        r.in_flight += 1
        self.calls[ref] = _Call(row, r, time.monotonic())

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    # ---- collecting --------------------------------------------------------------------------
    def poll(self, timeout: float) -> tuple[list[tuple[Row, dict]], list[tuple[Row, bool]]]:
        """(finished rows with results, rows to send again because their replica died, each with
        whether that counts against the row's `max_row_retries`: not for a free loss)."""
        starting = {r.ready_ref: r for r in self.replicas if r.ready_ref is not None and not r.dead}
        waitable = list(self.calls) + list(starting)
        ready = []
        if not waitable:     # still probe below: replicas all unreachable hold no calls, yet may come back
            time.sleep(min(timeout, 0.05))
        else:
            ready, rest = ray.wait(waitable, num_returns=1, timeout=timeout)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
        done, retry = [], []
        for ref in ready:
            if ref in starting:
                self._on_started(starting[ref], ref)
                continue
            call = self.calls.pop(ref)
            call.replica.in_flight -= 1
            try:
                done.append((call.row, ray.get(ref)))
                node = call.replica.info.get("node_id", "?")
                self.rows_by_node[node] = self.rows_by_node.get(node, 0) + 1
            except (RayActorError, ActorUnavailableError, EngineDiedError) as e:
                self._on_lost(call.replica, e)
                retry.append((call.row, not free_loss(e)))
            except Exception as e:  # a bug on one row: report it on that row, keep going
                done.append((call.row, {"error": f"internal error: {type(e).__name__}: {_first_line(e)}", **SERVER_ERROR}))
        self._check_health()
        self._check_startup()
        return done, retry

    def _check_health(self) -> None:
        """Every HEALTH_EVERY_S, each ready replica is asked for its health: a step hung past
        `step_timeout_s` makes it give up (cluster/replica.py), failing its rows as a crash does, so
        they come back through the death path above; the answer itself is only read for errors.
        The same call probes an unreachable replica, every UNREACHABLE_PROBE_S."""
        now = time.monotonic()
        for r in self.replicas:
            if r.unreachable_since is not None and now - r.unreachable_since > UNREACHABLE_LIMIT_S:
                self._on_death(r, TimeoutError(f"unreachable for over {UNREACHABLE_LIMIT_S:.0f}s"))
                continue
            if r.health_ref is not None:
                if not ray.wait([r.health_ref], timeout=0)[0]:
                    continue
                ref, r.health_ref = r.health_ref, None
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - hung, or dead: either way replaced
                    self._on_lost(r, e)
                    continue
                if r.unreachable_since is not None:
                    logger.warning("replica %d is reachable again after %.1fs", r.index, now - r.unreachable_since)
                    r.unreachable_since = None
            every = HEALTH_EVERY_S if r.unreachable_since is None else UNREACHABLE_PROBE_S
            if r.started and now - r.health_at >= every:
                r.health_ref, r.health_at = r.actor.check_health.remote(), now

    def _on_started(self, r: _Replica, ref) -> None:
        try:
            r.info = ray.get(ref)
            if "config_error" in r.info:
                self._kill(r)
                raise JobFailed(f"replica {r.index} cannot start: {r.info['config_error']} (a restart cannot fix "
                                "this: change the job's settings); committed output is kept")
            r.ready_ref = None
            self.rows_by_node.setdefault(r.info["node_id"], 0)
            logger.info("replica %d ready on node %s (%s, %s CPUs)", r.index, r.info["node_id"][:8],
                        r.info.get("node_ip"), self.cpus)
        except JobFailed:
            raise
        except Exception as e:
            self.last_error = f"replica {r.index} failed to start: {_first_line(e)}"
            logger.error("%s", self.last_error)
            self._on_death(r, e)

    def _on_lost(self, r: _Replica, err: BaseException) -> None:
        """A call to a serving replica failed. Unreachable for now is no death: Ray has not called it dead,
        so it is kept (without new rows) and probed (`_check_health`) instead of using a restart."""
        if not isinstance(err, ActorUnavailableError):
            self._on_death(r, err)
        elif r.unreachable_since is None and not r.dead:
            r.unreachable_since, r.health_at = time.monotonic(), 0.0   # probe at once
            logger.warning("replica %d is unreachable (%s); it takes no rows until it answers again", r.index,
                           _first_line(err))

    def _on_death(self, r: _Replica, err: BaseException) -> None:
        if r.dead:
            return
        # the cluster's doing, not the rows': no restart used. Not while starting: a start that takes
        # its node down (a model too big for the pod) must use up restarts like any other failure
        node_lost = lost_with_node(err) and r.ready_ref is None
        logger.warning("replica %d %s (%s); %d rows in flight there go back to the queue", r.index,
                       "was lost with its node" if node_lost else "died", _first_line(err), r.in_flight)
        self._kill(r)
        if node_lost:
            self.replicas_lost_with_node += 1
            self.replicas[self.replicas.index(r)] = self._spawn(r.index)
            return
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.replicas[self.replicas.index(r)] = self._spawn(r.index)
        self.last_error = self.last_error or _first_line(err)

    def _check_startup(self) -> None:
        alive = [r for r in self.replicas if not r.dead]
        if not alive:
            raise JobFailed(f"no replica left ({self.last_error or 'all died'}); committed output is kept, "
                            "run the same command again to resume")
        # measured from the latest start: a replacement mid-job gets the same time as the first replicas
        waiting = time.monotonic() - max(r.spawned_at for r in alive)
        if not any(r.started for r in alive) and waiting > self.cfg.startup_timeout_s:
            have = ray.cluster_resources()
            gpus = f"{self.cfg.tp_size} GPU(s) (--device cuda) and " if self.cfg.device == "cuda" else ""
            raise JobFailed(f"no replica became ready within {self.cfg.startup_timeout_s:.0f}s; each needs {gpus}"
                            f"{self.cpus} CPUs (--cpus-per-replica) and the cluster has "
                            + (f"{have.get('GPU', 0):g} GPUs and " if gpus else "") + f"{have.get('CPU', 0)} CPUs")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Ray wraps remote errors in a traceback; the last line holds the actual message
    return (lines[-1] if len(lines) > 1 else lines[0])[:500]
