"""Paged KV bookkeeping: allocation, freeing, preemption, uncommitted append + keep-subset, no leaks."""
import pytest

from eagle_worker.block_manager import BlockManager, OutOfBlocks
from eagle_worker.config import EngineConfig
from eagle_worker.sampling_params import SamplingParams
from eagle_worker.scheduler import Scheduler
from eagle_worker.sequence import Sequence, SequenceStatus


def make_seq(rid, n_prompt, priority=0):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(), priority, seed=0)


def test_allocation_is_proportional_to_length_and_freed():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = make_seq("a", 9)
    slots = bm.append_slots(s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    assert slots.tolist() == [s.block_table[p // 4] * 4 + p % 4 for p in range(9)]
    bm.commit(s, 9)
    bm.append_slots(s, 3)          # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    bm.commit(s, 3)
    bm.append_slots(s, 1)
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_out_of_blocks_raises_without_partial_allocation():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = make_seq("a", 9)
    with pytest.raises(OutOfBlocks):
        bm.append_slots(s, 9)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_keep_subset_moves_kept_tokens_and_frees_tail_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = make_seq("a", 6)
    bm.append_slots(s, 6)
    bm.commit(s, 6)
    tree_slots = bm.append_slots(s, 7)              # positions 6..12 uncommitted (draft tree)
    assert len(s.block_table) == 4 and s.num_computed_tokens == 6
    copies = []

    def copy_kv(src, dst):   # the source blocks are still the sequence's while their KV is copied
        copies.append((src.tolist(), dst.tolist(), len(s.block_table), bm.num_free_blocks))

    bm.keep_subset(s, [0, 3, 5], copy_kv)
    # kept offsets 3 and 5 move to positions 7 and 8; offset 0 stays in place
    assert copies == [([tree_slots[3].item(), tree_slots[5].item()], [tree_slots[1].item(), tree_slots[2].item()], 4, 6)]
    assert s.num_computed_tokens == 9 and len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.keep_subset(s, [], copy_kv)                 # nothing appended and nothing kept
    assert copies[-1][:2] == ([], []) and s.num_computed_tokens == 9


def test_keep_subset_rejects_bad_offsets():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = make_seq("a", 2)
    bm.append_slots(s, 3)
    with pytest.raises(ValueError):
        bm.keep_subset(s, [2, 1], lambda src, dst: None)


def test_scheduler_chunks_prefill_and_decodes_first():
    cfg = EngineConfig(max_num_batched_tokens=8, block_size=4)
    bm = BlockManager(num_blocks=32, block_size=4)
    sch = Scheduler(cfg, bm)
    long, short = make_seq("long", 20), make_seq("short", 3)
    sch.add(long)
    batch = sch.schedule()
    assert [(b.seq.request_id, b.num_tokens, b.completes) for b in batch] == [("long", 8, False)]
    bm.commit(long, 8)
    sch.add(short)
    batch = sch.schedule()
    assert [(b.seq.request_id, b.num_tokens) for b in batch] == [("long", 8)]
    bm.commit(long, 8)
    batch = sch.schedule()       # long finishes its prompt (4 tokens), short is admitted in the same step
    assert [(b.seq.request_id, b.num_tokens) for b in batch] == [("long", 4), ("short", 3)]
    for b in batch:
        bm.commit(b.seq, b.num_tokens)
        b.seq.token_ids.append(7)
    batch = sch.schedule()       # both decode one token
    assert sorted((b.seq.request_id, b.num_tokens) for b in batch) == [("long", 1), ("short", 1)]


def test_priority_orders_admission():
    cfg = EngineConfig(max_num_batched_tokens=4, block_size=4)
    sch = Scheduler(cfg, BlockManager(num_blocks=32, block_size=4))
    sch.add(make_seq("offline", 4, priority=1))
    sch.add(make_seq("online", 4, priority=0))
    assert [b.seq.request_id for b in sch.schedule()] == ["online"]


def test_full_cache_preempts_least_urgent_then_recomputes_without_leaks():
    cfg = EngineConfig(max_num_batched_tokens=64, block_size=4)
    bm = BlockManager(num_blocks=4, block_size=4)
    sch = Scheduler(cfg, bm)
    online, offline = make_seq("online", 8, priority=0), make_seq("offline", 8, priority=1)
    sch.add(online)
    sch.add(offline)
    for b in sch.schedule():
        bm.commit(b.seq, b.num_tokens)
        b.seq.token_ids.append(5)
    assert bm.num_free_blocks == 0
    batch = sch.schedule()       # online needs a 3rd block: offline is preempted
    assert [b.seq.request_id for b in batch] == ["online"]
    assert offline.status == SequenceStatus.WAITING and offline.num_computed_tokens == 0
    assert offline.metrics.num_preemptions == 1
    sch.remove(online)
    batch = sch.schedule()       # offline is recomputed: prompt + its generated token
    assert [(b.seq.request_id, b.num_tokens) for b in batch] == [("offline", 9)]
    sch.remove(offline)
    assert bm.num_free_blocks == bm.num_blocks


def test_lookahead_slots_come_from_what_real_tokens_leave_and_are_freed_on_commit():
    """The scheduler reserves draft-tree slots after each decode, most urgent first, never by
    preempting or by holding back a waiting request, capped by the context; commit frees them."""
    cfg = EngineConfig(max_num_batched_tokens=64, block_size=4)
    bm = BlockManager(num_blocks=6, block_size=4)
    sch = Scheduler(cfg, bm, num_lookahead_slots=8, max_model_len=14)
    a, b = make_seq("a", 3, priority=0), make_seq("b", 3, priority=1)
    sch.add(a)
    sch.add(b)
    for item in sch.schedule():                  # prefills: no lookahead
        assert item.num_lookahead == 0
        bm.commit(item.seq, item.num_tokens)
        item.seq.token_ids.append(5)
    assert bm.num_free_blocks == 4
    late = make_seq("late", 8)
    sch.add(late)
    batch = sch.schedule()                       # decodes at position 3; late takes 2 blocks first
    assert [(i.seq.request_id, i.num_tokens) for i in batch] == [("a", 1), ("b", 1), ("late", 8)]
    assert [i.num_lookahead for i in batch] == [8, 0, 0]    # a: 2 more blocks; none left for b
    assert bm.num_free_blocks == 0 and not any(s.metrics.num_preemptions for s in (a, b, late))
    for item in batch:
        bm.commit(item.seq, item.num_tokens)     # nothing kept past the committed tokens
    assert len(a.block_table) == 1 and bm.num_free_blocks == 2
    near_end = Scheduler(cfg, BlockManager(num_blocks=8, block_size=4), num_lookahead_slots=8, max_model_len=12)
    c = make_seq("c", 10)
    near_end.add(c)
    for item in near_end.schedule():
        near_end.block_manager.commit(item.seq, item.num_tokens)
    c.token_ids.append(5)                        # 11 tokens: the 12-token context leaves 1 draft slot
    assert [i.num_lookahead for i in near_end.schedule()] == [1]


def test_an_urgent_request_preempts_less_urgent_work_when_the_batch_is_full(tiny_model_dir):
    """Online (priority 0) before offline (1): with every batch slot taken by offline rows, an online
    request preempts the least urgent, latest of them (recompute) instead of waiting for one to end;
    one of equal priority waits. Outputs are unchanged by the preemption."""
    from eagle_worker import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=256, max_num_seqs=2)
    eng = llm.engine
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = {o.request_id: o.token_ids for o in llm.generate(["offline a", "offline b", "online"], p)}
    eng.add_request("a", "offline a", p, priority=1)
    eng.add_request("b", "offline b", p, priority=1)
    eng.step()
    eng.add_request("same", "offline a", p, priority=1)      # as urgent as the running rows: waits
    eng.step()
    assert {s.request_id for s in eng.scheduler.running} == {"a", "b"}
    eng.add_request("on", "online", p, priority=0)
    eng.step()
    assert "on" in {s.request_id for s in eng.scheduler.running}
    assert eng.requests["b"].metrics.num_preemptions == 1 and eng.requests["a"].metrics.num_preemptions == 0
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done["a"] == done["same"] == expected["llm-0"] and done["b"] == expected["llm-1"]
    assert done["on"] == expected["llm-2"]
    st = eng.stats()
    assert st["num_preemptions_by_priority"] == {"1": 1} and st["num_preemptions_total"] == 1
