"""GPT-2 BPE encoding throughput and ids: this checkout's GPT2BPETokenizer against another git ref's.

    python scripts/benchmarks/bench_bpe.py --old-ref main --work-dir /tmp/bench_bpe

Builds the sample corpus's JSONL (the stdlib sources, data/sample_corpus.py) and trains a GPT-2 BPE of
--vocab-size on every 4th document (the sample corpus's own vocabulary has no merges), once per work dir.
Then each checkout, in its own process (PYTHONPATH = that checkout; the old one is `git archive`d into the
work dir): encodes every document and a list of tricky texts, and runs data.preprocess.preprocess_jsonl with
one worker. Prints MB/s and tokens/s of both (wall and CPU time of the encoding process) and whether every
id of the corpus and the tricky texts is the same. Exit status 1 when any id differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRICKY_TEXTS = [
    "héllo wörld, naïve café, Ångström",
    "a  b   c\t\t d\r\n\r\nx\r\n",
    "🙂🙂 emoji 👨\u200d👩\u200d👧 family, flags 🇫🇷🇯🇵, skin 👍🏽",
    "x" * 20000,
    "supercalifragilistic" * 500 + " tail",
    " " * 300 + "y" + "\n" * 40 + "\t" * 17 + " z   ",
    "日本語のテキストと中文文本 한국어",
    "it's they're I'll we'd He'S 'sx ''",
    "before<|endoftext|>after <|endoftext|>",
    "\u00a0\u2003x\u3000y\u0085\x1c\x1d\x1e\x1f\x0b\x0cz",
    "a\u0300\u0301b \u0928\u093f \u0e01\u0e34",
    "١٢٣ 123 ½ Ⅻ ² 0x1F 3.14e-10",
    "\U0001fae8 \U0001fa77 unassigned in Unicode 14 \U0010fffd \U000e0001",
    "mixed\U0001fae8word and 日本\U0001fae8",
]


def _measure(work_dir: str, label: str) -> None:
    """Child process: encode the corpus and the tricky texts with the checkout on sys.path; print JSON."""
    # here, not at the top: the checkout measured (old or new) is the one on this child's sys.path
    from data.preprocess import preprocess_jsonl
    from data.tokenizer_training import iter_jsonl_texts
    from data.tokenizers import GPT2BPETokenizer

    vocab_file, merge_file = os.path.join(work_dir, "vocab.json"), os.path.join(work_dir, "merges.txt")
    jsonl = os.path.join(work_dir, "stdlib.jsonl")
    texts = list(iter_jsonl_texts(jsonl))
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    start, start_cpu = time.perf_counter(), time.process_time()
    encoded = [tokenizer.encode(text) for text in texts]
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    np.save(os.path.join(work_dir, f"ids_{label}.npy"), np.concatenate([np.asarray(ids, np.int32) for ids in encoded]))
    np.save(os.path.join(work_dir, f"lengths_{label}.npy"), lengths)
    stats = preprocess_jsonl(
        jsonl,
        os.path.join(work_dir, f"pre_{label}"),
        "GPT2BPETokenizer",
        vocab_file,
        merge_file,
        append_eod=True,
        workers=1,
        log=lambda msg: None,
    )
    result = {
        "bytes": sum(len(text.encode("utf-8")) for text in texts),
        "tokens": int(lengths.sum()),
        "encode_wall_s": wall,
        "encode_cpu_s": cpu,
        "preprocess_wall_s": stats.seconds,
        "tricky": [tokenizer.encode(text) for text in TRICKY_TEXTS],
        "round_trip": [tokenizer.decode(tokenizer.encode(text)) == text for text in TRICKY_TEXTS],
    }
    print(json.dumps(result))


def _prepare(work_dir: str, vocab_size: int) -> None:
    sys.path.insert(0, REPO_ROOT)  # this checkout's data/ (the script runs without it on sys.path)
    from data.sample_corpus import write_stdlib_jsonl
    from data.tokenizer_training import iter_jsonl_texts, train_gpt2_bpe

    jsonl = os.path.join(work_dir, "stdlib.jsonl")
    if not os.path.exists(jsonl):
        docs, size = write_stdlib_jsonl(jsonl + ".tmp")
        os.replace(jsonl + ".tmp", jsonl)
        print(f"corpus: {docs} documents, {size / 1e6:.1f} MB of source -> {jsonl}")
    if not os.path.exists(os.path.join(work_dir, "merges.txt")):
        start = time.perf_counter()
        sample = (text for k, text in enumerate(iter_jsonl_texts(jsonl)) if k % 4 == 0)
        train_gpt2_bpe(sample, vocab_size, work_dir)
        print(f"trained GPT-2 BPE, vocabulary {vocab_size} ({time.perf_counter() - start:.0f} s)")


def _run_checkout(root: str, work_dir: str, label: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--measure", label, "--work-dir", work_dir]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_bpe: the {label} checkout ({root}) failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-ref", default="main", help="git ref of the encoder to compare against")
    p.add_argument("--work-dir", default="/tmp/bench_bpe")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: the checkout's label
    args = p.parse_args()
    work_dir = os.path.abspath(args.work_dir)
    if args.measure:
        _measure(work_dir, args.measure)
        return
    os.makedirs(work_dir, exist_ok=True)
    _prepare(work_dir, args.vocab_size)
    old_root = os.path.join(work_dir, "old_src")
    subprocess.run(["rm", "-rf", old_root], check=True)
    os.makedirs(old_root)
    archive = subprocess.run(["git", "-C", REPO_ROOT, "archive", args.old_ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", old_root], input=archive.stdout, check=True)
    results = {}
    for label, root in (("old", old_root), ("new", REPO_ROOT)):
        results[label] = r = _run_checkout(root, work_dir, label)
        mb = r["bytes"] / 1e6
        print(
            f"{label} ({args.old_ref if label == 'old' else 'this checkout'}): encode {mb / r['encode_wall_s']:.2f} "
            f"MB/s wall, {mb / r['encode_cpu_s']:.2f} MB per CPU-s, {r['tokens'] / r['encode_cpu_s'] / 1e6:.2f} "
            f"M tokens per CPU-s; preprocess_jsonl (1 worker) {mb / r['preprocess_wall_s']:.2f} MB/s wall; "
            f"{mb:.1f} MB, {r['tokens']} tokens; decode round trips: {sum(r['round_trip'])}/{len(TRICKY_TEXTS)}"
        )
    same = all(
        np.array_equal(
            np.load(os.path.join(work_dir, f"{name}_old.npy")), np.load(os.path.join(work_dir, f"{name}_new.npy"))
        )
        for name in ("ids", "lengths")
    )
    with (
        open(os.path.join(work_dir, "pre_old_text_document.bin"), "rb") as a,
        open(os.path.join(work_dir, "pre_new_text_document.bin"), "rb") as b,
    ):
        same_bin = a.read() == b.read()
    differing = [k for k, (a, b) in enumerate(zip(results["old"]["tricky"], results["new"]["tricky"])) if a != b]
    print(f"corpus ids identical: {same}; preprocessed .bin identical: {same_bin}; tricky texts differing: {differing}")
    if not (same and same_bin and not differing):
        sys.exit(1)


if __name__ == "__main__":
    main()
