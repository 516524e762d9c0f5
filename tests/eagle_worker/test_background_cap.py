"""The offline cap: while online requests run, offline work fills a step only as far as the step's
modelled time allows (fixed cost models here, never wall-clock), always makes progress, and never
changes what anyone generates."""
from __future__ import annotations

import pytest

from eagle_worker.background_cap import step_work
from eagle_worker.block_manager import BlockManager
from eagle_worker.config import EngineConfig
from eagle_worker.engine import LLMEngine
from eagle_worker.sampling_params import SamplingParams
from eagle_worker.scheduler import Scheduler
from eagle_worker.sequence import Sequence, SequenceStatus
from eagle_worker.speculative.step_cost import StepCost
from tests.conftest import assert_no_leaks

# seconds = 10 + 1 per sequence + 0.1 per prefill token (FEATURES' order: fixed, per_seq, per_row, per_head_row,
# per_head_pass, per_prefill_token)
COST = (10.0, 1.0, 0.0, 0.0, 0.0, 0.1)


def make_seq(rid, n_prompt, priority=0):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(), priority, seed=0)


def scheduler(slowdown, cost=COST, tokens=1024):
    cfg = EngineConfig(max_num_batched_tokens=tokens, block_size=4, offline_slowdown=slowdown)
    bm = BlockManager(num_blocks=256, block_size=4)
    return Scheduler(cfg, bm, step_cost=StepCost(coefficients=cost)), bm


def decoding(sch, bm, seqs):
    """Admit `seqs` and run their prompts (uncapped), so that each next step is one decode apiece."""
    slowdown, sch.config.offline_slowdown = sch.config.offline_slowdown, None
    for s in seqs:
        sch.add(s)
    for item in sch.schedule():
        bm.commit(item.seq, item.num_tokens)
        item.seq.token_ids.append(7)
    sch.config.offline_slowdown = slowdown
    assert all(s.status == SequenceStatus.RUNNING and s.num_pending_tokens == 1 for s in seqs)


@pytest.mark.parametrize("slowdown, offline_in_step", [(0.5, 6), (1.0, 10), (0.0, 1)])
def test_offline_decodes_fill_a_step_up_to_the_slowdown_and_one_always_runs(slowdown, offline_in_step):
    sch, bm = scheduler(slowdown)
    online = [make_seq(f"on{i}", 4) for i in range(2)]
    offline = [make_seq(f"off{i}", 4, priority=1) for i in range(10)]
    decoding(sch, bm, online + offline)
    tables = {s.request_id: list(s.block_table) for s in offline}
    batch = sch.schedule()
    ids = [b.seq.request_id for b in batch]
    # online part: 10 + 2 = 12 s; each offline decode +1 s: 6 fit in 12 * 1.5, all 10 in 12 * 2; at 0 none
    # fits, and the oldest one runs anyway
    assert ids == ["on0", "on1"] + [f"off{i}" for i in range(offline_in_step)]
    assert sch.offline_held == 10 - offline_in_step
    left_out = offline[offline_in_step:]
    assert all(s.status == SequenceStatus.RUNNING and s.block_table == tables[s.request_id] for s in left_out)


def test_without_online_work_or_without_a_slowdown_offline_work_is_not_capped():
    for slowdown, with_online in ((0.0, False), (None, True)):
        sch, bm = scheduler(slowdown)
        seqs = [make_seq(f"off{i}", 4, priority=1) for i in range(10)]
        seqs += [make_seq("on", 4)] if with_online else []
        decoding(sch, bm, seqs)
        assert len(sch.schedule()) == len(seqs) and sch.offline_held == 0


def test_an_offline_prompt_is_cut_to_the_chunk_that_fits_and_resumes_later():
    sch, bm = scheduler(0.5)
    online = make_seq("on", 4)
    decoding(sch, bm, [online])
    job = make_seq("off", 100, priority=1)
    sch.add(job)
    batch = sch.schedule()
    # online 11 s, limit 16.5 s: 10 + 2 + 0.1 * m <= 16.5 -> a 45-token chunk that samples nothing yet
    assert [(b.seq.request_id, b.num_tokens, b.completes) for b in batch] == [("on", 1, True), ("off", 45, False)]
    assert sch.offline_held == 1
    for b in batch:
        bm.commit(b.seq, b.num_tokens)
    online.token_ids.append(7)
    sch.remove(online)          # online done: the rest of the prompt (12 + 5.5 s) fits the last limit
    assert [(b.seq.request_id, b.num_tokens, b.completes) for b in sch.schedule()] == [("off", 55, True)]


def test_offline_steps_stay_within_the_last_online_limit_for_a_moment_after_online_work_ends(monkeypatch):
    from eagle_worker import background_cap
    from eagle_worker import scheduler as scheduler_module

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    sch, bm = scheduler(0.5)
    online = make_seq("on", 4)
    offline = [make_seq(f"off{i}", 4, priority=1) for i in range(10)]
    decoding(sch, bm, [online] + offline)
    assert len(sch.schedule()) == 1 + 5                 # limit 1.5 x (10 + 1) = 16.5 s: 5 offline fit, +1 s each
    sch.remove(online)          # the client's next request is on its way: steps stay short meanwhile
    clock[0] += background_cap.ONLINE_GRACE_S / 2
    held = sch.offline_held
    assert len(sch.schedule()) == 6 and sch.offline_held == held + 4     # 10 + 6 <= 16.5
    clock[0] += background_cap.ONLINE_GRACE_S      # no online work for a while: offline takes the whole step
    assert len(sch.schedule()) == 10


def test_a_prompt_that_fits_nowhere_still_advances_a_block_at_a_time():
    sch, bm = scheduler(0.0)
    decoding(sch, bm, [make_seq("on", 4)])
    sch.add(make_seq("off", 100, priority=1))
    assert [(b.seq.request_id, b.num_tokens) for b in sch.schedule()] == [("on", 1), ("off", 4)]


def test_a_waiting_online_request_is_planned_before_running_offline_work():
    sch, bm = scheduler(0.0)
    offline = [make_seq(f"off{i}", 4, priority=1) for i in range(3)]
    decoding(sch, bm, offline)
    sch.add(make_seq("on", 8))
    assert [(b.seq.request_id, b.num_tokens) for b in sch.schedule()] == [("on", 8), ("off0", 1)]


PROMPTS = ["The quick brown fox", "Bonjour", "def add(a, b):\n", "x", "The lazy dog", "two plus two", "abc abc"]


def run_engine(config: EngineConfig, online: list[bool], cost=None, max_tokens=12):
    """PROMPTS (online where `online` says, offline otherwise) through an `LLMEngine` until done:
    the engine and each request's tokens. `cost` fixes the scheduler's cost model."""
    engine = LLMEngine(config)
    if cost is not None:
        engine.scheduler.step_cost = StepCost(coefficients=cost)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, (prompt, is_online) in enumerate(zip(PROMPTS, online)):
        engine.add_request(f"r{i}", prompt, params, priority=0 if is_online else 1)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert_no_leaks(engine)
    return engine, done


def test_the_engine_measures_its_steps_and_the_cap_never_changes_tokens(tiny_model_dir):
    online = [i < 2 for i in range(len(PROMPTS))]

    def config(slowdown):
        return EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256, draft=None,
                            offline_slowdown=slowdown)

    free, expected = run_engine(config(None), online)
    assert free.stats()["num_offline_held"] == 0
    capped, got = run_engine(config(0.0), online, COST)
    assert got == expected and len(got) == len(PROMPTS)
    assert capped.stats()["num_offline_held"] > 0
    measured, got = run_engine(config(0.25), online)           # the engine's own StepCost, fitted from its steps
    assert got == expected and measured.scheduler.step_cost.measured


def test_the_cost_model_sees_each_step_as_it_was_planned(tiny_model_dir, monkeypatch):
    """The step commits its items (after it, none reaches its sequence's end), so what the cost model
    is fitted from is taken before the step: its logit rows (every decode, a prompt's last chunk)
    are there, and their cost is not folded into the per-sequence one."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256, draft=None,
                                    offline_slowdown=0.25))
    planned, observed = [], []
    execute, observe = engine.worker.execute, engine.scheduler.step_cost.observe
    monkeypatch.setattr(engine.worker, "execute",
                        lambda batch: planned.append(step_work([(i.num_tokens, i.completes) for i in batch]))
                        or execute(batch))
    monkeypatch.setattr(engine.scheduler.step_cost, "observe", lambda work, s: observed.append(work) or observe(work, s))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                           priority=i % 2)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert sorted(o.finish_reason for o in finished) == ["length"] * len(PROMPTS)
    assert len(observed) == len(planned) == 4 and observed == planned     # a prefill, then 3 decodes
    assert all(w.target_rows == w.sequences for w in observed)    # every item sampled: prompts fit one chunk


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 1e9])
def test_a_slowdown_out_of_range_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="offline_slowdown"):
        EngineConfig(offline_slowdown=bad)


@pytest.mark.parametrize("spec", ["head", "hybrid"])
def test_speculating_sequences_left_out_of_steps_generate_the_same_tokens(spec, copying_target):
    """A drafted sequence that sits steps out (its head state and lookahead slots untouched meanwhile)
    continues exactly where it stopped."""
    from eagle_worker.speculative.config import SpecConfig

    target, head = copying_target
    online = [i % 3 == 0 for i in range(len(PROMPTS))]

    def config(slowdown):
        return EngineConfig(model=str(target), block_size=4, num_kv_blocks=512, offline_slowdown=slowdown,
                            spec=SpecConfig(draft=str(head), lookup=spec == "hybrid"))

    _, expected = run_engine(config(None), online, max_tokens=16)
    capped, got = run_engine(config(0.0), online, COST, max_tokens=16)
    assert got == expected and len(got) == len(PROMPTS)
    assert capped.stats()["num_offline_held"] > 0
