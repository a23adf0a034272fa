"""Your own model on the command line (docs/your_model.md): `--model pkg.module:factory`, `--data
pkg.module:factory` and `--model hf:PATH` with a real transformers `LlamaForCausalLM`, through `train`,
`compare` and its report, and every way a user can get them wrong, each one line and a non-zero exit."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from cli_harness import wansync
from wansync.cli import main
from wansync.errors import ConfigError

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/my_model.py"
TINY_LM = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--threads", "1", "--workers", "2"]
TOKENIZER_VOCAB, LLAMA_VOCAB = 300, 320  # the tied model's own tokenizer; its config (a padded vocabulary)

# A model defined here, written into the test's directory and named by module:factory. Its factory
# records a draw from torch's generator: every worker must draw the same (the factory runs seeded).
MY_MODELS = '''
import os
import torch
from torch import nn


class GRULM(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 24)
        self.rnn = nn.GRU(24, 24, batch_first=True)
        self.head = nn.Linear(24, vocab_size)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


def build(spec):
    assert (spec.kind, spec.vocab_size, spec.seq_len) == ("lm", 256, 32), spec
    with open("draws.txt", "a") as f:
        f.write(f"{os.getpid()} {torch.rand(1).item()!r}\\n")
    return GRULM(spec.vocab_size)


def boom(spec):
    raise ValueError("the factory's own error\\nwith a second line")


def not_a_module(spec):
    return {"weights": 1}


def not_a_workload(spec):
    return GRULM(8)


def small_vocab(spec):
    return GRULM(spec.vocab_size // 2)


def frozen(spec):
    model = GRULM(spec.vocab_size)
    model.requires_grad_(False)
    return model


class RunsDry:
    """A workload whose data ends after two batches (a plain iterator's habit)."""
    kind = "lm"

    def __init__(self):
        self.model = GRULM(8)
        self.data = iter([(torch.zeros(2, 4, dtype=torch.long),)] * 2)

    def next_batch(self):
        return next(self.data)

    def loss(self, model, batch):
        return model(batch[0]).mean()

    def evaluate(self, model):
        return {"val_loss": 1.0}


def runs_dry(spec):
    return RunsDry()


class DictBatches(RunsDry):
    def next_batch(self):
        return {"tokens": torch.zeros(2, 4, dtype=torch.long)}


def dict_batches(spec):
    return DictBatches()


class ScalarItem(RunsDry):
    def next_batch(self):
        return (torch.zeros(2, 4, dtype=torch.long), 3)


def scalar_item(spec):
    return ScalarItem()


NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small text corpus: tokenizing it costs nothing, and it has windows enough for 2 workers."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wise", "owls"]
    lines = (" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(11)) for i in range(1200))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def llamas(tmp_path_factory, corpus) -> dict[str, Path]:
    """Two tiny LLaMA configs (hidden 32, 2 layers, 2 heads): `untied` with the byte tokenizer's
    vocabulary and no tokenizer of its own; `tied` (tie_word_embeddings) with its own tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("llamas")
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    LlamaConfig(vocab_size=256, tie_word_embeddings=False, **shape).save_pretrained(root / "untied")
    LlamaConfig(vocab_size=LLAMA_VOCAB, tie_word_embeddings=True, **shape).save_pretrained(root / "tied")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus.read_text().splitlines(),
        trainers.BpeTrainer(
            vocab_size=TOKENIZER_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(root / "tied")
    return {"untied": root / "untied", "tied": root / "tied"}


@pytest.fixture()
def my_models(tmp_path) -> Path:
    """A directory holding mymodels.py (the CLI runs there: the module is found in the working directory)."""
    (tmp_path / "mymodels.py").write_text(MY_MODELS)
    return tmp_path


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """Rank 0's model at the run's last checkpoint."""
    step = max((run_dir / "checkpoints").glob("step*"))
    return torch.load(step / "rank0.pt", weights_only=False)["model"]


def test_train_a_transformers_llama_built_from_its_config(llamas, corpus, tmp_path):
    """diloco on 2 workers under an emulated LAN; the model is the config's LlamaForCausalLM (untied
    head), the run's config.toml names it, and a resume accepts it."""
    from wansync.runner.run import resume_config

    out = tmp_path / "run"
    r = wansync(
        "train",
        "--model",
        f"hf:{llamas['untied']}",
        "--data",
        str(corpus),
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "4",
        "--wan",
        "lan",
        "--out",
        str(out),
        *TINY_LM,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == f"hf:{llamas['untied']}" and summary["steps"] == 4
    assert math.isfinite(summary["final_val_loss"]) and summary["sync_events"] == 2
    assert summary["chance_level"] == pytest.approx(math.log(256))  # the byte tokenizer
    state = final_model(out)
    assert "model.layers.1.self_attn.q_proj.weight" in state and "lm_head.weight" in state
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert f'model = "hf:{llamas["untied"]}"' in (out / "config.toml").read_text()
    assert resume_config(out, {"steps": "6"}).model == f"hf:{llamas['untied']}"


def test_compare_streaming_and_cocodc_on_a_tied_llama_with_its_own_tokenizer(llamas, corpus, tmp_path):
    """The usual report from `compare` on an HF model: its directory's tokenizer (300 ids in a
    320-row embedding), the tie kept through every exchange."""
    out = tmp_path / "cmp"
    r = wansync(
        "compare",
        "--model",
        f"hf:{llamas['tied']}",
        "--data",
        str(corpus),
        "--strategies",
        "streaming,cocodc",
        "--fragments",
        "2",
        "--overlap",
        "1",
        "--sync-every",
        "4",
        "--steps",
        "4",
        "--eval-every",
        "4",
        "--out",
        str(out),
        *TINY_LM,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    assert (out / "report.md").is_file() and (out / "summary.csv").is_file()
    assert "streaming" in r.stdout and "cocodc" in r.stdout
    for strategy in ("streaming", "cocodc"):
        run = out / strategy / "seed0"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["chance_level"] == pytest.approx(math.log(TOKENIZER_VOCAB))  # its own tokenizer
        assert summary["sync_events"] > 0 and math.isfinite(summary["final_val_loss"])
        state = final_model(run)
        assert torch.equal(
            state.get("lm_head.weight", state["model.embed_tokens.weight"]), state["model.embed_tokens.weight"]
        )


def test_train_a_model_defined_here_by_module_and_factory(my_models, corpus):
    """`--model mymodels:build` from the working directory: every worker's factory drew the same
    numbers (it runs under the run's seed), and the run resumes with the same model string."""
    from wansync.runner.run import resume_config

    out = my_models / "run"
    r = wansync(
        "train",
        "--model",
        "mymodels:build",
        "--data",
        str(corpus),
        "--strategy",
        "local_sgd",
        "--sync-every",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "4",
        "--out",
        str(out),
        *TINY_LM,
        cwd=my_models,
    )
    assert r.returncode == 0, r.stderr
    draws = [line.split() for line in (my_models / "draws.txt").read_text().splitlines()]
    assert len({pid for pid, _ in draws}) == 2 and len({value for _, value in draws}) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "mymodels:build" and math.isfinite(summary["final_val_loss"])
    assert "GRULM" in r.stdout or "mymodels:build" in r.stdout
    assert set(final_model(out)) == {
        "embed.weight",
        "rnn.weight_ih_l0",
        "rnn.weight_hh_l0",
        "rnn.bias_ih_l0",
        "rnn.bias_hh_l0",
        "head.weight",
        "head.bias",
    }
    assert resume_config(out, {"steps": "6"}).model == "mymodels:build"


def test_the_example_workload_trains_on_workers_of_two_ranks(tmp_path):
    """`--data examples/my_model.py:workload` (model, data, loss and evaluation all the user's) on 2
    workers of 2 ranks each under an emulated LAN, judged by its test accuracy."""
    out = tmp_path / "run"
    r = wansync(
        "train",
        "--data",
        f"{EXAMPLE}:workload",
        "--strategy",
        "diloco",
        "--sync-every",
        "2",
        "--workers",
        "2",
        "--ranks-per-worker",
        "2",
        "--wan",
        "lan",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--batch-size",
        "8",
        "--threads",
        "1",
        "--out",
        str(out),
        cwd=ROOT,
    )  # the path is the repository's
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks_per_worker"] == 2 and summary["bytes_inside_workers"] > 0
    assert 0 <= summary["final_test_acc"] <= 100 and math.isfinite(summary["final_test_loss"])
    assert "test_acc" in r.stdout


def test_the_example_model_trains_on_the_built_in_text(corpus, monkeypatch):
    """The example's `build` as the workload builds it for a worker: its loss is the LM's cross-entropy."""
    from wansync.config import build_config
    from wansync.workloads import build_workload

    monkeypatch.chdir(ROOT)
    cfg = build_config(
        overrides={
            "model": f"{EXAMPLE}:build",
            "data": str(corpus),
            "batch_size": 2,
            "seq_len": 16,
            "out": str(corpus.parent / "cache"),
        }
    )
    workload = build_workload(cfg, 0, 2)
    loss = workload.loss(workload.model, workload.next_batch())
    loss.backward()
    assert type(workload.model).__name__ == "GRULM"
    assert loss.item() == pytest.approx(math.log(256), rel=0.05)  # an untrained model: near chance


def test_a_workload_without_its_own_position_resumes_where_it_was(monkeypatch):
    """The example workload keeps no data position: wansync counts its batches, and a workload built
    afresh from the same seed replays them, so it serves next exactly the batch the first would."""
    from wansync.config import build_config
    from wansync.workloads import build_workload

    monkeypatch.chdir(ROOT)
    cfg = build_config(overrides={"data": f"{EXAMPLE}:workload", "batch_size": 4})
    first, again, healed = (build_workload(cfg, 1, 2) for _ in range(3))
    for _ in range(3):
        first.next_batch()
    again.load_state_dict(first.state_dict())
    healed.skip_to(3)
    expected = first.next_batch()
    for other in (again, healed):
        assert all(torch.equal(a, b) for a, b in zip(other.next_batch(), expected))
    with pytest.raises(Exception, match="cannot go back"):
        first.skip_to(1)


@pytest.mark.parametrize(
    "case, args, message",
    [
        (
            "a module that does not import",
            ["--model", "no_such_module:build"],
            "--model no_such_module:build: cannot import no_such_module",
        ),
        ("a missing attribute", ["--model", "mymodels:nothere"], "mymodels has no attribute 'nothere'"),
        ("a name that is not callable", ["--model", "mymodels:NOT_CALLABLE"], "NOT_CALLABLE is not callable"),
        ("a file that is not there", ["--model", "no/such.py:build"], "no such file"),
        (
            "a module whose import fails",
            ["--model", "broken:build"],
            "importing broken failed: ZeroDivisionError: division by zero",
        ),
        (
            "a workload module that does not import",
            ["--data", "no_such_module:workload"],
            "--data no_such_module:workload: cannot import no_such_module",
        ),
        ("hf: a missing directory", ["--model", "hf:no/such/dir"], "no such directory no/such/dir"),
        ("hf: a directory without config.json", ["--model", "hf:."], "has no config.json"),
        ("hf: nothing after the prefix", ["--model", "hf:"], "name a local directory with a config.json"),
        ("a model that is none of the forms", ["--model", "gpt5"], "hf:PATH"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(my_models, monkeypatch, capsys, case, args, message):
    (my_models / "broken.py").write_text("1 / 0\n")
    monkeypatch.chdir(my_models)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the module lookup may add the working directory
    assert_one_line_error(capsys, ["train", "--out", str(my_models / "run"), *args], message)


def test_without_transformers_hf_is_one_line(llamas, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    assert_one_line_error(
        capsys,
        ["train", "--model", f"hf:{llamas['untied']}"],
        "needs the transformers package: pip install 'wansync[hf]'",
    )


def test_a_vocabulary_the_tokenizer_does_not_fit_is_one_line(llamas, capsys):
    assert_one_line_error(
        capsys,
        ["train", "--model", f"hf:{llamas['untied']}", "--tokenizer", "bpe", "--bpe-vocab", "512"],
        "has a vocabulary of 256 tokens, fewer than the bpe tokenizer's 512",
    )


def test_a_sequence_longer_than_the_models_positions_is_one_line(llamas, capsys):
    assert_one_line_error(
        capsys,
        ["train", "--model", f"hf:{llamas['untied']}", "--seq-len", "65"],
        "seq_len must be at most 64 for --model hf:",
    )


def test_a_config_transformers_cannot_read_is_one_line(llamas, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    assert_one_line_error(
        capsys, ["train", "--model", f"hf:{tmp_path}", "--out", str(tmp_path / "run")], "transformers cannot read"
    )


def test_a_factory_that_raises_ends_the_run_in_one_line(my_models, corpus):
    """The factories run in the workers: the first one's failure is the run's one line."""
    r = wansync(
        "train",
        "--model",
        "mymodels:boom",
        "--data",
        str(corpus),
        "--steps",
        "2",
        "--out",
        str(my_models / "run"),
        *TINY_LM,
        cwd=my_models,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--model mymodels:boom: the factory raised ValueError: the factory's own error" in lines[0]


@pytest.mark.parametrize(
    "flag, factory, message",
    [
        ("model", "mymodels:not_a_module", "returned an object of type dict, not a torch.nn.Module"),
        ("data", "mymodels:not_a_workload", "returned a GRULM without model .* next_batch, loss, evaluate"),
    ],
)
def test_a_factory_returning_the_wrong_thing_is_one_line(my_models, corpus, monkeypatch, flag, factory, message):
    from wansync.config import build_config
    from wansync.workloads import build_workload

    monkeypatch.chdir(my_models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = build_config(
        overrides={
            flag: factory,
            **({"data": str(corpus)} if flag == "model" else {}),
            "batch_size": 2,
            "seq_len": 32,
            "out": str(my_models / "run"),
        }
    )
    with pytest.raises(ConfigError, match=message) as e:
        build_workload(cfg, 0, 2)
    assert "\n" not in str(e.value)


def assert_one_line_error(capsys, argv: list[str], message: str) -> None:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert int(e.value.code or 0) != 0
    assert message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_model_whose_embedding_is_smaller_than_the_vocabulary_is_one_line(my_models, corpus, monkeypatch):
    from wansync.config import build_config
    from wansync.workloads import build_workload

    monkeypatch.chdir(my_models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = build_config(
        overrides={
            "model": "mymodels:small_vocab",
            "data": str(corpus),
            "batch_size": 2,
            "seq_len": 32,
            "out": str(my_models / "run"),
        }
    )
    with pytest.raises(
        ConfigError,
        match="its input embedding has 128 rows, fewer than the byte tokenizer's 256 "
        "token ids: build it with the vocab_size it is given",
    ) as e:
        build_workload(cfg, 0, 2)
    assert "\n" not in str(e.value)


def test_a_model_with_nothing_to_train_is_one_line(my_models, corpus, monkeypatch):
    from wansync.config import build_config
    from wansync.trainer.optim import build_optimizer
    from wansync.workloads import build_workload

    monkeypatch.chdir(my_models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = build_config(
        overrides={
            "model": "mymodels:frozen",
            "data": str(corpus),
            "batch_size": 2,
            "seq_len": 32,
            "out": str(my_models / "run"),
        }
    )
    model = build_workload(cfg, 0, 2).model
    with pytest.raises(ConfigError, match="--model mymodels:frozen: the model has no parameter that requires grad"):
        build_optimizer(cfg, model)


def test_a_workload_whose_data_runs_dry_says_so_in_one_line(my_models, monkeypatch):
    from wansync.config import build_config
    from wansync.errors import DataError
    from wansync.workloads import build_workload

    monkeypatch.chdir(my_models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = build_config(overrides={"data": "mymodels:runs_dry", "out": str(my_models / "run")})
    workload = build_workload(cfg, 0, 1)
    workload.next_batch(), workload.next_batch()
    with pytest.raises(
        DataError, match="next_batch\\(\\) raised StopIteration at batch 3: its data is empty or ran out"
    ):
        workload.next_batch()


@pytest.mark.parametrize(
    "factory, words",
    [
        ("dict_batches", "next_batch() returned dict, not a tuple of tensors whose first dimension is the batch"),
        ("scalar_item", "next_batch() returned a tuple whose item 1 is int, not a tensor"),
    ],
)
def test_a_batch_that_breaks_the_contract_is_named_at_the_first_batch(my_models, monkeypatch, factory, words):
    from wansync.config import build_config
    from wansync.errors import DataError
    from wansync.workloads import build_workload

    monkeypatch.chdir(my_models)
    monkeypatch.setattr(sys, "path", list(sys.path))
    workload = build_workload(
        build_config(overrides={"data": f"mymodels:{factory}", "out": str(my_models / "r")}), 0, 1
    )
    with pytest.raises(DataError, match=f"--data mymodels:{factory}: " + words.replace("(", "\\(").replace(")", "\\)")):
        workload.next_batch()
