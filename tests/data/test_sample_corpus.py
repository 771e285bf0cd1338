"""The sample corpus builder, on a tiny stand-in for the standard library (the real one is the default)."""

import os

import pytest

from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset
from data.sample_corpus import ensure_sample_corpus, stdlib_source_files
from data.tokenizers import build_tokenizer
from tests.data.options import SAMPLES

pytestmark = pytest.mark.tier("fast")


def _fake_stdlib(root):
    files = {
        "b.py": "print('b')\n",
        "a.py": "x = 1\n" * 50,
        "pkg/z.py": "def f():\n    return 'é'\n",
        "site-packages/thirdparty.py": "nope = True\n",
        "notes.txt": "not python",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return str(root)


def test_stdlib_files_sorted_without_site_packages(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    rel = [os.path.relpath(p, root) for p in stdlib_source_files(root)]
    assert rel == ["a.py", "b.py", os.path.join("pkg", "z.py")]


def test_build_once_then_return_at_once(tmp_path, capsys):
    stdlib = _fake_stdlib(tmp_path / "lib")
    info = ensure_sample_corpus(str(tmp_path / "sample_data"), stdlib_dir=stdlib)
    assert "[sample corpus]" in capsys.readouterr().out
    assert set(info) == {"data_prefix", "tokenizer_type", "vocab_file", "merge_file"}
    assert info["data_prefix"] == str(tmp_path / "sample_data" / "stdlib_text_document")
    tok = build_tokenizer(info["tokenizer_type"], info["vocab_file"], info["merge_file"])
    ds = IndexedDataset(info["data_prefix"])
    assert len(ds) == 3 and ds[0].tolist() == tok.encode("x = 1\n" * 50) + [tok.eod]
    assert sorted(os.listdir(tmp_path)) == ["lib", "sample_data"]  # no build folder or lock left
    assert ensure_sample_corpus(str(tmp_path / "sample_data"), stdlib_dir=stdlib) == info
    assert capsys.readouterr().out == ""
    assert len(GPTDataset(ds, "train", (0, 3), 8, 1, 5, None, SAMPLES)[0]["text"]) == 9


def test_refuses_a_foreign_non_empty_folder(tmp_path):
    (tmp_path / "sample_data").mkdir()
    (tmp_path / "sample_data" / "mine.txt").write_text("user data")
    with pytest.raises(RuntimeError, match="sample_data"):
        ensure_sample_corpus(str(tmp_path / "sample_data"), progress=False)


def _build_in_child(root, stdlib, queue):
    queue.put(ensure_sample_corpus(root, progress=False, stdlib_dir=stdlib))


def test_concurrent_callers_build_once(tmp_path):
    import multiprocessing

    stdlib = _fake_stdlib(tmp_path / "lib")
    root = str(tmp_path / "sample_data")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(root, stdlib, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(r == results[0] for r in results)
    assert sorted(os.listdir(tmp_path)) == ["lib", "sample_data"]
    assert len(IndexedDataset(results[0]["data_prefix"])) == 3


def test_real_stdlib_listing_is_sorted_and_excludes_site_packages():
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_source_files()
    rel = [os.path.relpath(p, root) for p in files]
    assert len(files) > 500 and rel == sorted(rel)
    assert not [r for r in rel if "site-packages" in r.split(os.sep) or not r.endswith(".py")]
    assert os.path.join("json", "__init__.py") in rel
