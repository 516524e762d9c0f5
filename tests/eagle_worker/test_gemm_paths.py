"""The float32 CPU GEMM table (`layers/gemm_paths.py`): every path computes the same product, the
tuner keeps what the timer says is fastest (by the margin), `linear` follows the table, and the
table is read back from its file instead of timed again. The timer is a test double: costs, not
wall-clock."""
from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn.functional as F

from eagle_worker import default_models
from eagle_worker.layers import gemm_paths
from eagle_worker.layers.linear import linear


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(gemm_paths, "_table", {})
    return gemm_paths._table


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 70])
@pytest.mark.parametrize("path", gemm_paths.PATHS)
def test_every_path_is_the_same_product(path, rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 48, generator=g), torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(gemm_paths.run(path, x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gemm_paths.run(path, x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def _timer(costs: dict[int, dict[str, float]], calls: list):
    """A timer that reads the path and row count off the call it times (through `run`)."""
    def timer(fn):
        seen = {}
        real_run = gemm_paths.run

        def spy(path, x2, weight, bias):
            seen.update(path=path, rows=x2.shape[0])
            return real_run(path, x2, weight, bias)
        gemm_paths.run = spy
        try:
            fn()
        finally:
            gemm_paths.run = real_run
        calls.append((seen["rows"], seen["path"]))
        return costs.get(seen["rows"], {}).get(seen["path"], 1.0)
    return timer


def test_the_fastest_path_wins_by_the_margin_and_linear_follows_it(table, tmp_path, monkeypatch):
    costs = {1: {"mkl": 0.5},                 # far faster than the rule (oneDNN): chosen
             4: {"weight_left": 0.95},        # 5% faster: inside the margin, the rule stays
             2: {"onednn": 0.3}}              # the rule at 2 rows is weight_left; oneDNN beats it
    calls: list = []
    w = torch.randn(40, 48)
    added = gemm_paths.tune([w, torch.randn(40, 48), torch.randn(3, 4, 5), w.half(), torch.randn(0, 48)],
                            _timer(costs, calls), cache=tmp_path / "t.json")
    assert {k[:2] for k in added} == {(40, 48)}          # one shape, 2-D float32 and not empty only, timed once
    assert len(calls) == len(gemm_paths.BUCKETS) * len(gemm_paths.PATHS)
    assert table == {(40, 48, 1): "mkl", (40, 48, 2): "onednn", (40, 48, 4): "onednn"}
    with gemm_paths.untimed():                                        # what bench decode compares against
        assert gemm_paths.path_for(w, 1) == gemm_paths.default_path(1) == "onednn"
    assert gemm_paths.path_for(w, 1) == "mkl"

    used = []
    real_run = gemm_paths.run
    monkeypatch.setattr(gemm_paths, "run", lambda p, *a: (used.append(p), real_run(p, *a))[1])
    with torch.inference_mode():
        for rows in (1, 2, 3, 20):
            linear(torch.randn(rows, 48), w)
    assert used == ["mkl", "onednn", "onednn", "onednn"]     # 3 rows: 4's choice; 20: beyond the table, the rule
    with torch.inference_mode():
        linear(torch.randn(1, 48).double(), w.double())               # not float32: F.linear, no table
    assert len(used) == 4


def test_the_table_is_read_back_from_its_file_and_a_bad_file_is_timed_again(table, tmp_path):
    file = tmp_path / "gemm.json"
    calls: list = []
    gemm_paths.tune([torch.randn(40, 48)], _timer({1: {"mkl": 0.1}}, calls), cache=file)
    stored = json.loads(file.read_text())
    assert stored["40,48,1"] == "mkl" and len(stored) == len(gemm_paths.BUCKETS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemm.json", "gemm.json.lock"]   # no temp files left

    table.clear()
    calls.clear()
    gemm_paths.tune([torch.randn(40, 48)], _timer({}, calls), cache=file)
    assert calls == [] and table[(40, 48, 1)] == "mkl"                # read, not timed

    table.clear()
    file.write_text("{not json")
    gemm_paths.tune([torch.randn(40, 48)], _timer({}, calls), cache=file)
    assert len(calls) == len(gemm_paths.BUCKETS) * len(gemm_paths.PATHS) and table[(40, 48, 1)] == "onednn"
    assert json.loads(file.read_text())["40,48,1"] == "onednn"        # rewritten whole


def test_the_cache_file_is_per_machine_and_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    a = gemm_paths.cache_file()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        b = gemm_paths.cache_file()
    finally:
        torch.set_num_threads(threads)
    assert a.parent == tmp_path / ".gemm_paths" and a != b


def test_a_process_loading_beside_one_that_times_waits_and_reads_its_table(table, tmp_path):
    """Two replicas loading together: the second waits for the first's timing and reads its file
    instead of timing in its noise (the test holds the lock as the first would)."""
    file = tmp_path / "gemm.json"
    calls: list = []
    with default_models.file_lock(tmp_path / "gemm.json.lock"):
        waiting = threading.Thread(target=gemm_paths.tune, args=([torch.randn(40, 48)], _timer({}, calls)),
                                   kwargs={"cache": file})
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and calls == [] and (40, 48, 1) not in table    # waits its turn
        file.write_text(json.dumps({f"40,48,{b}": "mkl" for b in gemm_paths.BUCKETS}))   # the first's table
    waiting.join(30)
    assert not waiting.is_alive()
    assert calls == [] and all(table[(40, 48, b)] == "mkl" for b in gemm_paths.BUCKETS)   # read, not timed


def test_without_a_writable_cache_folder_it_times_unlocked(table, tmp_path):
    (tmp_path / "file").write_text("")
    calls: list = []
    gemm_paths.tune([torch.randn(40, 48)], _timer({1: {"mkl": 0.1}}, calls), cache=tmp_path / "file" / "sub" / "t.json")
    assert len(calls) == len(gemm_paths.BUCKETS) * len(gemm_paths.PATHS) and table[(40, 48, 1)] == "mkl"
