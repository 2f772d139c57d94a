"""The benchmarks' text corpora: deterministic, split as documented, identified by a hash."""

import numpy as np

from benchmarks.support import workloads


def test_stdlib_corpus_is_split_by_file_and_identified():
    first, again = workloads.stdlib_corpus(), workloads.stdlib_corpus()
    assert first.info == again.info and first.train == again.train  # same text, same order
    info = first.info
    assert info["chars_train"] == len(first.train) and info["chars_val"] == len(first.val)
    assert info["chars_train"] > 5_000_000  # a 10,000-step study sees ~21M characters
    # every 10th file is held out (before non-ASCII files are left out): about a tenth
    assert 0.08 < info["files_val"] / (info["files_train"] + info["files_val"]) < 0.12
    assert first.val[:2000] not in first.train
    assert first.train.isascii() and first.val.isascii()
    assert len(info["sha256"]) == 64


def test_char_lm_on_the_stdlib_corpus():
    work = workloads.char_lm(2, context=16, dim=16, heads=2, layers=1, corpus="stdlib")
    assert work.data["corpus"] == "stdlib" and work.data["vocab"] <= 128
    batch = work.train_batch(0)
    assert batch.shape == (2, 8, 17) and batch.max() < work.data["vocab"]
    np.testing.assert_array_equal(batch, work.train_batch(0))  # batches follow (seed, step)
    pydoc = workloads.char_lm(2, context=16, dim=16, heads=2, layers=1)
    # 90% of the help topics joined (418,613 characters on Python 3.11.7; each release moves it)
    from pydoc_data.topics import topics

    joined = sum(map(len, topics.values())) + 2 * (len(topics) - 1)
    assert pydoc.data["corpus"] == "pydoc" and pydoc.data["chars_train"] == int(0.9 * joined)
