"""Real data end to end: an image folder with a broken file, CIFAR-10 on disk, token shards made
by ``sdpipe prepare text``, a dataset of one's own; exact resume; bad data refused before
anything is written."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from PIL import Image

from sdpipe_cli.cli.parsing import main
from tests.helpers import losses, metrics, one_error_line, resumed_losses, run_processes, sdpipe, user_module

pytestmark = pytest.mark.multiprocess

CLASSES = ("circle", "cross", "square")
RESNET = ("model=resnet_cifar", "pipeline.stages=2", "train.batch_size=8", "pipeline.microbatches=2",
          "train.eval_every=0")


def write_image_folder(root, per_class: int = 10, side: int = 36) -> None:
    """train/ and val/ of three classes of generated PNGs (each class its own colour and noise),
    and one file in train/ named like an image that is not one."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", 4)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 60, (side, side, 3), dtype=np.uint8)
                pixels[..., c] += 150
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    (root / "train" / "circle" / "broken.png").write_bytes(b"not a png at all")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    write_image_folder(root)
    return root


def test_an_image_folder_trains_counts_the_broken_file_and_resumes_exactly(image_folder, tmp_path):
    run = tmp_path / "run"
    args = (*RESNET, "data=imagefolder", f"data.path={image_folder}", "data.image_size=32",
            "data.num_workers=1", "train.steps=8", "checkpoint.every=4", "sync=allreduce")
    out = sdpipe("train", f"run.dir={run}", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    bad = metrics(run, "unreadable")
    assert bad and {b["sample"] for b in bad} == {str(image_folder / "train" / "circle" / "broken.png")}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["unreadable"] == [bad[0]["sample"]]
    assert "1 unreadable sample" in out.stderr
    resolved = json.loads(json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())))
    record = resolved["data"]["resolved"]
    assert record["train"] == 31 and record["val"] == 12 and record["classes"] == 3
    assert record["read"]["path"] == str(image_folder.resolve())
    assert resolved["data"]["eval_batches"] == 1  # every full batch of 12
    assert not run_processes(run)

    continued = resumed_losses(run, tmp_path / "copy", "step_8")  # killed after step 4's checkpoint
    assert sorted(continued) == [(p, k) for p in (0, 1) for k in range(5, 9)]
    reference = losses(metrics(run))
    assert all(continued[key] == reference[key] for key in continued)  # the same samples, bit-exact


def write_cifar(root, per_batch: int = 16) -> None:
    """The python-pickle CIFAR-10 layout, with ``per_batch`` images per file."""
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, per_batch).tolist()
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)


def test_cifar10_from_disk_trains(tmp_path):
    (tmp_path / "cifar").mkdir()
    write_cifar(tmp_path / "cifar")
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", *RESNET, "data=cifar10", f"data.path={tmp_path / 'cifar'}",
                 "train.steps=2", "train.eval_every=2")
    assert out.returncode == 0, out.stderr[-3000:]
    evals = metrics(run, "eval")
    assert evals and all(0.0 <= e["val_accuracy"] <= 1.0 for e in evals)


@pytest.fixture(scope="module")
def token_shards(tmp_path_factory):
    """The standard library's sources (the first 1.5 MB) as BPE tokens of a 4096 vocabulary."""
    out = tmp_path_factory.mktemp("tokens") / "stdlib-bpe"
    made = sdpipe("prepare", "text", "stdlib", "--out", str(out), "--tokenizer", "bpe:4096",
                  "--max-bytes", "1500000", "--val-fraction", "0.02")
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def test_token_shards_train_gpt_tiny_and_resume_exactly(token_shards, tmp_path):
    manifest = json.loads((token_shards / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 4096 and manifest["dtype"] == "uint16"
    run = tmp_path / "run"
    args = ("data=tokens", f"data.path={token_shards}", "model.seq_len=64", "train.batch_size=8",
            "train.steps=12", "train.eval_every=6", "checkpoint.every=6", "train.lr=3e-3",
            "sync=allreduce")
    out = sdpipe("train", f"run.dir={run}", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    evals = {}
    for e in metrics(run, "eval"):
        evals.setdefault(e["step"], []).append(e["val_loss"])
    first, last = min(evals), max(evals)
    assert sum(evals[last]) < sum(evals[first]) < 8.4 * len(evals[first])  # ln 4096 = 8.3: it learns
    config = __import__("yaml").safe_load((run / "config.yaml").read_text())
    assert config["model"]["vocab_size"] == 4096  # the model took the tokenizer's vocabulary
    assert config["data"]["resolved"]["read"]["fingerprint"]

    continued = resumed_losses(run, tmp_path / "copy", "step_12")
    assert sorted(continued) == [(p, k) for p in (0, 1) for k in range(7, 13)]
    reference = losses(metrics(run))
    assert all(continued[key] == reference[key] for key in continued)


DICT_DATA = '''
    """Samples whose inputs are a dict (as a tokenizer gives), and a model whose first block takes it."""
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    class Tokenized(Dataset):
        classes = ["low", "mid", "high"]  # what gives the model its number of classes

        def __init__(self, size):
            self.size = size

        def __len__(self):
            return self.size

        def __getitem__(self, i):
            ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "attention_mask": ids % 5 != 0}, int(ids.sum() % 3)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)

        def forward(self, batch):
            return (self.emb(batch["input_ids"]) * batch["attention_mask"].unsqueeze(-1)).mean(1)

    def data(size=60):
        return Tokenized(size)

    def model(num_classes=3):
        return nn.Sequential(Embed(), nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, num_classes))
'''


def test_a_dataset_of_ones_own_with_dict_inputs_crosses_three_stages(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "dict_data", DICT_DATA)
    run = tmp_path / "run"
    out = sdpipe("train", f"run.dir={run}", "model=custom", "model._target_=dict_data.model",
                 "data=custom", "data._target_=dict_data.data", "+data.size=120", "pipeline.stages=3",
                 "data.val_fraction=0.2", "train.steps=4", "train.eval_every=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert metrics(run, "eval") and len(metrics(run, "train")) == 2 * 4
    config = __import__("yaml").safe_load((run / "config.yaml").read_text())
    assert config["data"]["kwargs"] == {"size": 120} and config["model"]["num_classes"] == 3
    assert config["data"]["resolved"]["train"] == 96 and config["data"]["eval_batches"] == 1


# -- bad data: one line, exit 2, nothing written (run in-process: nothing may start)
def refused(capsys, tmp_path, key: str, *argv: str) -> str:
    run = tmp_path / "never"
    rc = main([*argv, f"run.dir={run}"] if argv[0] == "train" else list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not run.exists()
    return one_error_line(err, key)


def test_a_folder_without_class_folders_is_refused(tmp_path, capsys):
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "a.png")
    line = refused(capsys, tmp_path, "data.path", "train", *RESNET, "data=imagefolder",
                   f"data.path={tmp_path / 'flat'}")
    assert "CLASS" in line


def test_an_empty_corpus_is_refused_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "shards"
    line = refused(capsys, tmp_path, "sources", "prepare", "text", str(tmp_path / "empty.txt"),
                   "--out", str(out))
    assert "empty corpus" in line and str(tmp_path / "empty.txt") in line
    assert not out.exists()


def test_a_vocabulary_too_large_for_the_token_type_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text " * 100)
    out = tmp_path / "shards"
    refused(capsys, tmp_path, "--dtype", "prepare", "text", str(tmp_path / "a.txt"), "--out", str(out),
            "--tokenizer", "bpe:70000", "--dtype", "uint16")
    assert not out.exists()


def test_a_shard_that_does_not_match_its_manifest_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    shards = tmp_path / "shards"
    assert main(["prepare", "text", str(tmp_path / "a.txt"), "--out", str(shards),
                 "--val-fraction", "0.2"]) == 0
    capsys.readouterr()
    shard = shards / json.loads((shards / "manifest.json").read_text())["splits"]["train"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[7] ^= 0xFF
    shard.write_bytes(bytes(data))
    line = refused(capsys, tmp_path, "data.path", "train", "model=mlp", "data=tokens",
                   f"data.path={shards}", "model.seq_len=16")
    assert shard.name in line


def test_a_dataset_that_does_not_import_is_refused(tmp_path, capsys):
    refused(capsys, tmp_path, "data._target_", "train", *RESNET, "data=custom",
            "data._target_=no_such_module.build")
