"""The per-process tokenizer cache (eagle_worker/prompt_tokenizer.py load_tokenizer)."""
import os
import threading

from eagle_worker.prompt_tokenizer import PromptTokenizer, load_tokenizer
from tests.conftest import make_tokenizer


def _folder(tmp_path, name="tok"):
    folder = tmp_path / name
    make_tokenizer().save_pretrained(folder)
    return folder


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


def test_a_rewritten_tokenizer_file_loads_afresh(tmp_path):
    folder = _folder(tmp_path)
    first = load_tokenizer(folder)
    config = folder / "tokenizer_config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = load_tokenizer(folder)
    assert second is not first
    assert second.encode("hello") == first.encode("hello")
    assert load_tokenizer(folder) is second


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


def test_the_cache_keeps_a_bounded_number_of_tokenizers(tmp_path):
    folders = [_folder(tmp_path, f"tok{i}") for i in range(6)]
    first = load_tokenizer(folders[0])
    for f in folders[1:]:
        load_tokenizer(f)
    assert load_tokenizer(folders[0]) is not first   # evicted, loaded again
    assert load_tokenizer(folders[-1]) is load_tokenizer(folders[-1])
