"""Corpora, tokenizers, shards and the resumable sampler of the LM workload."""

import math
import sys

import numpy as np
import pytest

from wansync.errors import ConfigError, DataError
from wansync.workloads.lm import (
    ByteTokenizer,
    build_lm_workload,
    build_tokenizer,
    load_corpus,
    shakespeare_plays,
    strip_markdown,
)
from wansync.runner.localgroup import run_ranks
from wansync.workloads import leader_first
from wansync.workloads.lm.dataset import ShardSampler, shard_windows, split_documents, window_batch
from wansync.workloads.lm.tokenizer import BPETokenizer
from wansync.workloads.lm.workload import bits_per_byte


@pytest.fixture
def small_corpus(tmp_path):
    """~60 KB of deterministic text: big enough for a few epochs of tiny batches, instant to build."""
    rng = np.random.default_rng(0)
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake"]
    path = tmp_path / "sonnets.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(1500)), encoding="utf-8")
    return str(path)


def test_strip_markdown_leaves_plain_play_text():
    md = "# Hamlet\n\n## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nTo be, or not\\-to be  \n_\\[Aside]_  \nA &amp; B\n"
    assert strip_markdown(md) == "Hamlet\n\nACT I\n\nEnter HAMLET\n\nHAMLET\nTo be, or not-to be\n[Aside]\nA & B\n"


def test_bundled_corpus_is_all_plays_as_plain_text():
    plays = shakespeare_plays()
    assert len(plays) == 38 and plays == sorted(plays)
    text = load_corpus("shakespeare")
    assert len(text) > 4_000_000
    assert "**" not in text and "_" not in text and "\\[" not in text
    assert text.startswith("A Midsummer Night's Dream\n") and "HAMLET\n" in text


def test_local_file_and_directory(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.md").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "skip.json").write_text("{}", encoding="utf-8")
    assert load_corpus(str(tmp_path)) == "first\nsecond"
    assert load_corpus(str(tmp_path / "a.txt")) == "first"


def test_missing_or_empty_corpus_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="nowhere"):
        load_corpus(str(tmp_path / "nowhere"))
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(DataError, match="no .txt or .md"):
        load_corpus(str(tmp_path / "bare"))


def test_hf_dataset_saved_on_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["alpha", "beta"], "id": [1, 2]}).save_to_disk(tmp_path / "flat")
    assert load_corpus(f"hf:{tmp_path / 'flat'}") == "alpha\n\nbeta"
    dd = datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["gamma"]})})
    dd.save_to_disk(tmp_path / "dict")
    assert load_corpus(f"hf:{tmp_path / 'dict'}:validation") == "gamma"
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(tmp_path / "notext")
    with pytest.raises(DataError, match="no 'text' column"):
        load_corpus(f"hf:{tmp_path / 'notext'}")


def test_hf_dataset_not_on_this_machine_is_one_line_data_error():
    pytest.importorskip("datasets")
    with pytest.raises(DataError, match="not available locally") as err:
        load_corpus("hf:wansync-test/no-such-dataset")
    assert "\n" not in str(err.value)


def test_missing_optional_packages_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"wansync\[bpe\]"):
        build_tokenizer("bpe", "some text")
    with pytest.raises(ConfigError, match=r"wansync\[hf\]"):
        load_corpus("hf:c4")


def test_byte_and_bpe_tokenizers_round_trip(tmp_path):
    text = "To be, or not to be: that is the question.\nWhether 'tis nobler — in the mind\n" * 20
    byte = ByteTokenizer()
    assert byte.encode(text).dtype == np.uint8 and byte.decode(byte.encode(text)) == text
    pytest.importorskip("tokenizers")
    bpe = build_tokenizer("bpe", text, bpe_vocab=300, cache_dir=str(tmp_path))
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text and len(ids) < len(text.encode()) and ids.max() < bpe.vocab_size <= 300
    cached = build_tokenizer("bpe", text, bpe_vocab=300, cache_dir=str(tmp_path))
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 1 and np.array_equal(cached.encode(text), ids)


def test_bpe_workload_uses_the_trained_vocabulary(small_corpus, tmp_path):
    pytest.importorskip("tokenizers")
    w = build_lm_workload(
        data=small_corpus, tokenizer="bpe", bpe_vocab=300, cache_dir=str(tmp_path), batch_size=4, seq_len=16
    )
    again = build_lm_workload(
        data=small_corpus, tokenizer="bpe", bpe_vocab=300, cache_dir=str(tmp_path), batch_size=4, seq_len=16
    )
    assert w.describe()["vocab"] == w.model.vocab_size <= 300
    assert np.array_equal(w.train_tokens, again.train_tokens)


def test_validation_is_the_tail_of_every_document():
    train, val = split_documents(["a" * 90 + "A" * 10, "b" * 18 + "B" * 2, "c"], 0.1)
    assert train == "a" * 90 + "\n" + "b" * 18 + "\n" + "c"
    assert val == "A" * 10 + "\n" + "BB"


def test_validation_of_a_corpus_directory_samples_every_file(tmp_path):
    for name, letter in (("a.txt", "x"), ("b.txt", "y"), ("c.md", "z")):
        (tmp_path / name).write_text((letter * 7 + "\n") * 400, encoding="utf-8")
    w = build_lm_workload(data=str(tmp_path), batch_size=2, seq_len=16, val_fraction=0.1)
    val = ByteTokenizer().decode(w.val_tokens)
    assert {c for c in val if c.isalpha()} == {"x", "y", "z"}
    assert all(abs(val.count(c) - 280) <= 8 for c in "xyz")  # a tenth of each file's 2800 letters


def test_bits_per_byte_is_the_byte_loss_in_bits(small_corpus):
    w = build_lm_workload(data=small_corpus, batch_size=4, seq_len=16, eval_batches=2)
    e = w.evaluate(w.model)
    assert e["val_bpb"] == pytest.approx(e["val_loss"] / math.log(2)) and w.describe()["val_bytes_per_token"] == 1.0
    assert bits_per_byte(8 * math.log(2), 4) == pytest.approx(2.0)


def test_bpe_bits_per_byte_count_the_bytes_its_tokens_stand_for(small_corpus, tmp_path):
    pytest.importorskip("tokenizers")
    text = "Wörds — “quoted” 日本語, and plain ones.\nA second line\n" * 40
    bpe = build_tokenizer("bpe", text, bpe_vocab=300)
    assert bpe.token_bytes()[bpe.encode(text)].sum() == len(text.encode("utf-8"))
    w = build_lm_workload(
        data=small_corpus,
        tokenizer="bpe",
        bpe_vocab=300,
        cache_dir=str(tmp_path),
        batch_size=4,
        seq_len=16,
        eval_batches=2,
    )
    e, per_token = w.evaluate(w.model), w.describe()["val_bytes_per_token"]
    assert per_token > 1.5  # the BPE packs several bytes per token ...
    assert e["val_bpb"] == pytest.approx(e["val_loss"] / math.log(2) / per_token, rel=0.1)  # ... and bpb says so


def build_bpe_counting_trainings(rank: int, world: int, corpus: str, cache_dir: str) -> tuple[int, list[int]]:
    """(BPE trainings on this rank, its first training tokens) for a workload built under `leader_first`."""
    trainings = []
    train = BPETokenizer.train

    def counting(text, vocab):
        trainings.append(1)
        return train(text, vocab)

    BPETokenizer.train = counting
    w = build_lm_workload(
        data=corpus,
        tokenizer="bpe",
        bpe_vocab=300,
        cache_dir=cache_dir,
        rank=rank,
        world_size=world,
        batch_size=4,
        seq_len=16,
        leader_first=leader_first,
    )
    return len(trainings), w.train_tokens[:50].tolist()


def test_the_bpe_is_trained_once_per_run_not_once_per_rank(small_corpus, tmp_path):
    pytest.importorskip("tokenizers")
    results = run_ranks(build_bpe_counting_trainings, 3, small_corpus, str(tmp_path))
    assert [n for n, _ in results] == [1, 0, 0]
    assert results[0][1] == results[1][1] == results[2][1]


def test_windows_give_next_token_targets():
    inputs, targets = window_batch(np.arange(100), np.array([2, 0]), seq_len=4)
    assert inputs.tolist() == [[10, 11, 12, 13], [0, 1, 2, 3]]
    assert targets.tolist() == [[11, 12, 13, 14], [1, 2, 3, 4]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_are_disjoint_equal_and_cover_the_windows(world_size):
    n = 1003
    shards = [shard_windows(n, seed=7, rank=r, world_size=world_size) for r in range(world_size)]
    union = np.concatenate(shards)
    assert {len(s) for s in shards} == {n // world_size}
    assert len(set(union.tolist())) == len(union) == n - n % world_size
    assert np.array_equal(shards[0], shard_windows(n, seed=7, rank=0, world_size=world_size))


def test_workload_batches_come_from_its_own_shard(small_corpus):
    ranks = [build_lm_workload(data=small_corpus, rank=r, world_size=2, batch_size=4, seq_len=16) for r in range(2)]
    assert not set(ranks[0].shard_indices.tolist()) & set(ranks[1].shard_indices.tolist())
    w = ranks[1]
    windows = {tuple(w.train_tokens[i * 17 : (i + 1) * 17].tolist()) for i in w.shard_indices}
    for _ in range(5):
        inputs, targets = w.next_batch()
        assert inputs.shape == targets.shape == (4, 16) and w.batch_size_items((inputs, targets)) == 64
        for x, y in zip(inputs.tolist(), targets.tolist()):
            assert tuple(x + y[-1:]) in windows


def test_epochs_reshuffle_and_visit_every_window_once():
    sampler = ShardSampler(np.arange(12), batch_size=4, seed=0, rank=0)
    epochs = [np.concatenate([sampler.next_window_ids() for _ in range(3)]) for _ in range(2)]
    assert sorted(epochs[0].tolist()) == sorted(epochs[1].tolist()) == list(range(12))
    assert not np.array_equal(epochs[0], epochs[1])
    assert sampler.epoch_progress() == 2.0


def test_skipping_to_a_step_serves_what_a_run_trained_that_far_would(small_corpus):
    def build():
        return build_lm_workload(data=small_corpus, rank=1, world_size=2, seed=3, batch_size=8, seq_len=32)

    straight = build()
    per_epoch = straight.describe()["batches_per_epoch"]
    expected = [straight.next_batch() for _ in range(2 * per_epoch + 2)]
    for steps in (0, 1, per_epoch, 2 * per_epoch - 1):
        healed = build()
        healed.next_batch()  # a position of its own, before the heal
        healed.skip_to(steps)
        assert healed.epoch_progress() == pytest.approx(steps / per_epoch)
        for (x, y), (xe, ye) in zip((healed.next_batch() for _ in range(3)), expected[steps:]):
            assert np.array_equal(np.asarray(x), np.asarray(xe)) and np.array_equal(np.asarray(y), np.asarray(ye))


def test_resume_continues_with_the_exact_next_batch(small_corpus):
    def build():
        return build_lm_workload(data=small_corpus, rank=1, world_size=2, seed=3, batch_size=8, seq_len=32)

    straight = build()
    per_epoch = straight.describe()["batches_per_epoch"]
    for _ in range(per_epoch - 2):
        straight.next_batch()
    state = straight.state_dict()
    expected = [straight.next_batch() for _ in range(5)]  # crosses an epoch boundary
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    for want, got in zip(expected, (resumed.next_batch() for _ in range(5))):
        assert all(np.array_equal(a, b) for a, b in zip(want, got))
    assert resumed.epoch_progress() == straight.epoch_progress() > 1.0
    with pytest.raises(DataError, match="position"):
        resumed.load_state_dict({"epoch": 0})


def test_bad_sizes_are_clear_errors(small_corpus):
    with pytest.raises(ConfigError, match="seq_len"):
        build_lm_workload(data=small_corpus, seq_len=10_000)
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        build_lm_workload(data=small_corpus, tokenizer="wordpiece")
    with pytest.raises(ConfigError, match="unknown LM model"):
        build_lm_workload(model="huge", data=small_corpus)
    with pytest.raises(DataError, match="too small"):
        build_lm_workload(data=small_corpus, batch_size=4096, seq_len=64)
    with pytest.raises(ConfigError, match="rank"):
        build_lm_workload(data=small_corpus, rank=2, world_size=2)
