"""Tokenizer loading (eagle_worker/tokenizer_loader.py): once per process, from a disk cache after."""
import os
import threading

import pytest

from eagle_worker import tokenizer_loader
from eagle_worker.prompt_tokenizer import PromptTokenizer
from eagle_worker.tokenizer_loader import load_tokenizer
from tests.conftest import make_tokenizer


@pytest.fixture(autouse=True)
def fresh_caches(tmp_path, monkeypatch):
    """Each test: its own disk cache, nothing in memory."""
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_loader, "_loaded", type(tokenizer_loader._loaded)())


def _folder(tmp_path, name="tok"):
    folder = tmp_path / name
    make_tokenizer().save_pretrained(folder)
    return folder


def _forget_in_memory(monkeypatch):
    monkeypatch.setattr(tokenizer_loader, "_loaded", type(tokenizer_loader._loaded)())


def _no_parsing(monkeypatch):
    """AutoTokenizer.from_pretrained fails: a load must come from memory or the disk cache."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("parsed the tokenizer files again")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_one_load_per_folder_shared_by_engines_and_the_prompt_side(tmp_path, tiny_model_dir):
    folder = _folder(tmp_path)
    first = load_tokenizer(folder)
    assert load_tokenizer(folder) is first
    assert load_tokenizer(str(folder) + "/") is first          # the same folder however it is named

    from eagle_worker import LLM

    model = tiny_model_dir("llama")
    a = LLM(model=str(model), draft=None, num_kv_blocks=16, block_size=4)
    b = LLM(model=str(model), draft=None, num_kv_blocks=16, block_size=4)
    assert a.tokenizer is b.tokenizer
    assert PromptTokenizer.load(str(model)).tokenizer is a.tokenizer   # the ingress's side too
    assert a.tokenizer is not first


def test_the_next_process_reads_the_disk_cache(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    first = load_tokenizer(folder)
    [cached] = (tmp_path / "cache" / ".tokenizers").glob("*.pkl")
    assert not list(cached.parent.glob("*.tmp"))
    _forget_in_memory(monkeypatch)
    _no_parsing(monkeypatch)
    again = load_tokenizer(folder)
    assert again is not first and type(again) is type(first)
    for text in ("hello world", "a b c", ""):
        assert again.encode(text) == first.encode(text)
    assert again.get_vocab() == first.get_vocab() and again.bos_token_id == first.bos_token_id


def test_a_rewritten_tokenizer_file_loads_afresh(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    first = load_tokenizer(folder)
    config = folder / "tokenizer_config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = load_tokenizer(folder)
    assert second is not first and second.encode("hello") == first.encode("hello")
    assert load_tokenizer(folder) is second
    assert len(list((tmp_path / "cache" / ".tokenizers").glob("*.pkl"))) == 2


@pytest.mark.parametrize("damage", ["truncated", "not a pickle", "writable by others"])
def test_a_bad_cache_entry_is_only_a_slower_start(tmp_path, monkeypatch, damage):
    folder = _folder(tmp_path)
    first = load_tokenizer(folder)
    [cached] = (tmp_path / "cache" / ".tokenizers").glob("*.pkl")
    if damage == "truncated":
        cached.write_bytes(cached.read_bytes()[:100])
    elif damage == "not a pickle":
        cached.write_bytes(b"garbage")
    else:
        cached.chmod(0o666)
    _forget_in_memory(monkeypatch)
    again = load_tokenizer(folder)
    assert again.encode("hello world") == first.encode("hello world")
    if damage != "writable by others":   # rewritten whole by the fresh load
        _forget_in_memory(monkeypatch)
        _no_parsing(monkeypatch)
        assert load_tokenizer(folder).encode("hello") == first.encode("hello")


def test_a_read_only_cache_still_loads(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".tokenizers").write_text("a file where the folder would be")
    assert load_tokenizer(folder).encode("hello") == make_tokenizer().encode("hello")


def test_concurrent_first_loads_parse_once(tmp_path):
    folder = _folder(tmp_path)
    got, errors = [], []

    def load():
        try:
            got.append(load_tokenizer(folder))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(got) == 4 and all(t is got[0] for t in got)


def test_memory_keeps_a_bounded_number_of_tokenizers(tmp_path):
    folders = [_folder(tmp_path, f"tok{i}") for i in range(tokenizer_loader.KEEP_IN_MEMORY + 2)]
    first = load_tokenizer(folders[0])
    for f in folders[1:]:
        load_tokenizer(f)
    assert len(tokenizer_loader._loaded) == tokenizer_loader.KEEP_IN_MEMORY
    assert load_tokenizer(folders[0]) is not first   # evicted, loaded again (from disk)


def test_a_model_folder_without_tokenizer_files_is_refused(tmp_path, tiny_model_dir):
    """transformers builds a stand-in of a few tokens from the config alone (every prompt one unknown
    token, exit 0): refused naming the folder, before anything is cached."""
    import shutil

    from eagle_worker import LLM

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir("gemma3"), bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    with pytest.raises(ValueError, match=f"model folder {bare} has no tokenizer"):
        LLM(model=str(bare), block_size=4, num_kv_blocks=16, draft=None)
    assert not (tmp_path / "cache" / ".tokenizers").exists()
