"""After training: one model out of a run's stages and replicas (``sdpipe export``), loaded by
transformers and by plain PyTorch, evaluated (``sdpipe eval``) and sampled (``sdpipe sample``).

Each run is a real ``sdpipe train`` of S=2 stages, most on P=2 pipelines; what the export holds is
checked by the libraries its users load it with, and the losses against the run's own records.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.helpers import metrics, sdpipe, user_module

pytestmark = pytest.mark.multiprocess

GPT2 = ("model=gpt2", "model.seq_len=32", "model.d_model=32", "model.n_layers=2",
        "model.n_heads=2", "model.d_hidden=64", "model.hf.n_positions=64")
# 4 steps: what is checked of a run (its export, its losses) does not depend on how long it trained
SMALL_RUN = ("cluster.pipelines=2", "pipeline.stages=2", "train.steps=4", "train.batch_size=8",
             "train.eval_every=0", "run.save_final=true")


def _train(run: Path, *overrides: str) -> Path:
    out = sdpipe("train", f"run.dir={run}", *SMALL_RUN, *overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _last_eval(run: Path) -> dict:
    return metrics(run, "eval")[-1]


def _validation_batches(run: Path):
    """The run's fixed validation batches, read by sdpipe's data code from its config."""
    from sdpipe_cli.data import sources
    from sdpipe_cli.data.loader import evaluation_batches

    cfg = OmegaConf.load(run / "config.yaml")
    splits = sources.open_splits(cfg)
    batches = evaluation_batches(splits.val, sources.val_count(cfg), int(cfg.train.batch_size),
                                 int(cfg.train.seed))
    return cfg, [(b.inputs, b.targets) for b in batches]


def _mean_loss(cfg, batches, logits_of) -> float:
    """The loss as the run's eval averages it: per batch the mean over its micro-batches."""
    m = int(cfg.pipeline.microbatches)
    per_batch = []
    with torch.no_grad():
        for x, y in batches:
            losses = [F.cross_entropy(logits_of(xc).flatten(0, -2), yc.flatten(), ignore_index=-100)
                      for xc, yc in zip(x.chunk(m), y.chunk(m))]
            per_batch.append(sum(float(v) for v in losses) / m)
    return sum(per_batch) / len(per_batch)


def _eval(path: Path, *args: str) -> float:
    out = sdpipe("eval", str(path), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stderr.splitlines() if x.startswith("eval: "))
    return float(line.split("val_loss ")[1].split()[0].rstrip(","))


# -- transformers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_on_tokens(tmp_path_factory):
    """gpt2 trained with sdpipe on token shards with a BPE tokenizer trained by sdpipe prepare."""
    root = tmp_path_factory.mktemp("gpt2")
    tokens = root / "tokens"
    out = sdpipe("prepare", "text", "stdlib", "--out", str(tokens), "--tokenizer", "bpe:320",
                 "--max-bytes", "300000")
    assert out.returncode == 0, out.stderr
    run = _train(root / "run", *GPT2, "model.vocab_size=320", "data=tokens",
                 f"data.path={tokens}", "sync=sdpipe")
    export = root / "export"
    out = sdpipe("export", str(run), "--out", str(export))
    assert out.returncode == 0, out.stderr[-3000:]
    return run, export, tokens, out.stderr


def test_gpt2_export_loads_in_transformers_with_its_tokenizer_and_the_runs_loss(gpt2_on_tokens):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, export, tokens, said = gpt2_on_tokens
    assert "replicas are equal" in said
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # one weight
    cfg, batches = _validation_batches(run)
    model.eval()
    theirs = _mean_loss(cfg, batches, lambda x: model(input_ids=x).logits)
    recorded = _last_eval(run)["val_loss"]
    ours = _eval(export)
    assert abs(theirs - recorded) < 1e-4 and abs(ours - recorded) < 1e-4, (theirs, ours, recorded)
    assert abs(_eval(run) - recorded) < 1e-4  # the run's weights, merged in memory

    tok = AutoTokenizer.from_pretrained(export)
    text = "import os\ndef main():\n"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(tokens / "tokenizer.json")).encode(text).ids
    generated = model.generate(**tok(text, return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == len(tok(text)["input_ids"]) + 5
    out = sdpipe("sample", str(export), "--prompt", "def ", "--max-new-tokens", "8")
    assert out.returncode == 0 and out.stdout.startswith("def "), out.stderr[-2000:]

    manifest = json.loads((export / "export.json").read_text())
    assert manifest["format"] == "transformers" and manifest["tokenizer"] == "tokenizer.json"
    assert manifest["replicas"] == {"how": "equal", "pipelines": [0, 1], "consensus_distance": 0.0}
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_an_export_is_trained_on_from_with_model_pretrained(gpt2_on_tokens, tmp_path):
    run, export, tokens, _ = gpt2_on_tokens
    again = _train(tmp_path / "again", *GPT2, "model.vocab_size=320", "data=tokens",
                   f"data.path={tokens}", "sync=sdpipe", f"model.pretrained={export}",
                   "train.steps=1", "train.lr=1e-12",  # one step that changes nothing
                   "cluster.pipelines=1")  # whose evaluation is the run's (its replicas are equal)
    assert abs(_last_eval(again)["val_loss"] - _last_eval(run)["val_loss"]) < 1e-4


def test_bert_tiny_export_loads_as_a_masked_lm_with_the_runs_loss(tmp_path):
    from transformers import AutoModelForMaskedLM

    # one pipeline: merging replicas is the gpt2 run's to show; here the stages and the tied weight
    run = _train(tmp_path / "run", "model=bert_tiny", "data=stdlib", "sync=sdpipe", "cluster.pipelines=1")
    out = sdpipe("export", str(run), "--out", str(tmp_path / "export"))
    assert out.returncode == 0, out.stderr[-3000:]
    model, info = AutoModelForMaskedLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg, batches = _validation_batches(run)
    model.eval()
    theirs = _mean_loss(cfg, batches, lambda x: model(input_ids=x).logits)
    recorded = _last_eval(run)["val_loss"]
    assert abs(theirs - recorded) < 1e-4 and abs(_eval(tmp_path / "export") - recorded) < 1e-4
    out = sdpipe("sample", str(tmp_path / "export"), "--prompt", "x")
    assert out.returncode == 2 and "not a causal language model" in out.stderr


# -- plain PyTorch ---------------------------------------------------------------------------------

def test_resnet_export_loads_strict_into_the_built_resnet_with_the_runs_accuracy(tmp_path):
    from sdpipe_cli.model import resnet

    # trained on the zero-bubble schedule (each backward as B, then W), BatchNorm included:
    # what a run exports does not depend on its schedule
    run = _train(tmp_path / "run", "model=resnet_cifar", "data=digits", "train=digits",
                 "train.steps=4", "train.eval_every=0", "sync=sdpipe", "pipeline.schedule=zb_h1")
    out = sdpipe("export", str(run), "--out", str(tmp_path / "export"))
    assert out.returncode == 0, out.stderr[-3000:]
    model = resnet.build("resnet_cifar", num_classes=10)
    model.load_state_dict(torch.load(tmp_path / "export" / "model.pt", weights_only=True), strict=True)
    model.eval()
    cfg, batches = _validation_batches(run)
    right = total = 0
    with torch.no_grad():
        for x, y in batches:
            right += int((model(x).argmax(-1) == y).sum())
            total += len(y)
    assert right / total == _last_eval(run)["val_accuracy"]
    from safetensors.torch import load_file

    assert all(torch.equal(v, model.state_dict()[k])
               for k, v in load_file(tmp_path / "export" / "model.safetensors").items())


USER_NETS = '''
    import torch
    from torch import nn

    class Net(nn.Module):
        """Blocks given by pipeline_blocks(); the output layer shares the embedding's weight."""
        def __init__(self, width=16):
            super().__init__()
            self.emb = nn.Embedding(256, width)
            self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU())
            self.out = nn.Linear(width, 256, bias=False)
            self.out.weight = self.emb.weight
            self.register_buffer("version", torch.tensor(2))  # in no block
        def pipeline_blocks(self):
            return [self.emb, self.body, self.out]

    def build(width=16):
        return Net(width)
'''


def test_a_users_model_exports_as_its_builds_state_dict(tmp_path, monkeypatch):
    from safetensors.torch import load_model

    user_module(tmp_path, monkeypatch, "export_nets", USER_NETS)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    run = _train(tmp_path / "run", "model=custom", "model._target_=export_nets.build",
                 "+model.kwargs.width=24", "data=stdlib", "model.seq_len=16", "sync=sdpipe")
    out = sdpipe("export", str(run), "--out", str(tmp_path / "export"))
    assert out.returncode == 0, out.stderr[-3000:]
    import export_nets

    model = export_nets.build(width=24)
    model.load_state_dict(torch.load(tmp_path / "export" / "model.pt", weights_only=True), strict=True)
    again = export_nets.build(width=24)
    assert load_model(again, str(tmp_path / "export" / "model.safetensors")) == (set(), [])
    assert torch.equal(again.emb.weight, model.emb.weight) and again.out.weight is again.emb.weight
    saved = OmegaConf.load(tmp_path / "export" / "model.yaml")
    assert saved._target_ == "export_nets.build" and saved.kwargs.width == 24
    assert abs(_eval(tmp_path / "export") - _last_eval(run)["val_loss"]) < 1e-4


# -- replicas that differ ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def apart(tmp_path_factory):
    """Replicas that never averaged (sync=none), with a checkpoint at the end."""
    return _train(tmp_path_factory.mktemp("apart") / "run", "model=gpt_tiny", "data=stdlib",
                  "sync=none", "checkpoint.every=4")


def test_replicas_that_differ_are_averaged_and_their_distance_reported(apart, tmp_path):
    from sdpipe_cli import checkpoint

    out = sdpipe("export", str(apart), "--out", str(tmp_path / "mean"))
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = json.loads((tmp_path / "mean" / "export.json").read_text())
    ckpt = apart / "checkpoints" / "step_4"
    shards = [checkpoint.load_shard(ckpt, str(r))["model"] for r in range(4)]  # p0s0 p0s1 p1s0 p1s1
    exported = torch.load(tmp_path / "mean" / "model.pt", weights_only=True)
    first = next(k for k in exported if k.startswith("embedding."))
    name = first.partition(".")[2]
    mean = (shards[0][f"0.{name}"].double() + shards[2][f"0.{name}"].double()) / 2
    assert torch.allclose(exported[first].double(), mean, atol=1e-6)
    assert manifest["replicas"]["how"] == "mean"
    distance = manifest["replicas"]["consensus_distance"]
    squares = mean_squares = 0.0
    for s in (0, 1):  # the formula of training's global syncs, over every parameter
        for key, a in shards[s].items():
            b = shards[2 + s][key]
            if "." in key and key.split(".")[-1] in ("weight", "bias") and a.is_floating_point():
                m = (a.double() + b.double()) / 2
                squares += float(((a - m) ** 2).sum() + ((b - m) ** 2).sum()) / 2
                mean_squares += float((m ** 2).sum())
    assert distance == pytest.approx((squares / mean_squares) ** 0.5, rel=1e-6) and distance > 0
    # one pipeline's replica evaluates to that pipeline's own last eval
    recorded = [m["val_loss"] for m in metrics(apart, "eval") if m["pipeline"] == 1][-1]
    assert abs(_eval(apart, "--pipeline", "1") - recorded) < 1e-4


def test_final_weights_of_a_resumed_run_are_its_last_legs(apart, tmp_path):
    """A resume on one pipeline leaves the first leg's p1-s*.pt in final/: they are not taken."""
    run = tmp_path / "run"
    shutil.copytree(apart, run)
    # the 2 x 4 iterations done, on one pipeline: 4 more to 12
    out = sdpipe("resume", str(run), "cluster.pipelines=1", "train.steps=12")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "final" / "p1-s0.pt").exists()  # the first leg's, stale
    out = sdpipe("export", str(run), "--out", str(tmp_path / "export"))
    assert out.returncode == 0 and "one pipeline" in out.stderr, out.stderr[-3000:]
    manifest = json.loads((tmp_path / "export" / "export.json").read_text())
    assert manifest["source"]["kind"] == "final" and manifest["source"]["steps"] == {"0": 12}
    assert abs(_eval(tmp_path / "export") - _last_eval(run)["val_loss"]) < 1e-4


# -- bad input: one line, exit 2, nothing written ----------------------------------------------------

def _refused(tmp_path: Path, *args: str) -> str:
    out = sdpipe(*args)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("sdpipe: error: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_bad_input_is_one_line_and_writes_nothing(apart, tmp_path):
    out = tmp_path / "out"
    assert "neither a run folder" in _refused(tmp_path, "export", str(tmp_path), "--out", str(out))
    assert "does not exist" in _refused(tmp_path, "export", str(tmp_path / "nope"), "--out", str(out))
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    shutil.copy(apart / "config.yaml", empty_run / "config.yaml")
    assert "no complete checkpoint and no final/" in _refused(
        tmp_path, "export", str(empty_run), "--out", str(out))
    assert "--format" in _refused(tmp_path, "export", str(apart), "--out", str(out), "--format",
                                  "transformers")
    assert "--pipeline" in _refused(tmp_path, "export", str(apart), "--out", str(out),
                                    "--pipeline", "5")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no leftovers

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert "already holds files" in _refused(tmp_path, "export", str(apart), "--out", str(taken))
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    (tmp_path / "result.json").write_text("mine")
    assert "already exists" in _refused(tmp_path, "eval", str(apart), "--out",
                                        str(tmp_path / "result.json"))
    assert (tmp_path / "result.json").read_text() == "mine"
    assert "train.lr" in _refused(tmp_path, "eval", str(apart), "train.lr=1")
    assert "eval_batchs" in _refused(tmp_path, "eval", str(apart), "data.eval_batchs=2")
    assert "data.eval_batches" in _refused(tmp_path, "eval", str(apart), "data.eval_batches=0")
    assert "data" in _refused(tmp_path, "eval", str(apart), "data=digits")  # not the model's
    assert "train.batch_size: the evaluation needs about" in _refused(  # before any batch is made
        tmp_path, "eval", str(apart), "train.batch_size=300000000")
    assert "data.eval_batches: is 1000000000" in _refused(
        tmp_path, "eval", str(apart), "data.eval_batches=1000000000")
    assert "--out" in _refused(tmp_path, "export", str(apart), "--out", str(tmp_path / ("x" * 300)))
    elsewhere = apart.parent / "elsewhere"  # a checkpoint of another run is not RUN's
    assert "CHECKPOINT" in _refused(tmp_path, "export", str(tmp_path), str(elsewhere),
                                    "--out", str(out))


def test_weights_of_another_model_are_refused_naming_the_file(apart, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(apart, run)
    ckpt = run / "checkpoints" / "step_4"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["config"]["model"]["d_model"] = 48  # the config of another model
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    line = _refused(tmp_path, "export", str(run), "step_4", "--out", str(tmp_path / "out"))
    assert "step_4/0.pt" in line and "has shape" in line
    assert not (tmp_path / "out").exists()


def test_an_export_changed_afterwards_is_refused(apart, tmp_path):
    export = tmp_path / "export"
    assert sdpipe("export", str(apart), "--out", str(export)).returncode == 0
    data = bytearray((export / "model.pt").read_bytes())
    data[-100] ^= 1
    (export / "model.pt").write_bytes(bytes(data))
    assert "checksum mismatch" in _refused(tmp_path, "eval", str(export))


def test_a_copied_export_naming_code_does_not_run_it(apart, tmp_path):
    """export.json is data: code its config names runs only as sealed by this user's launch."""
    export = tmp_path / "export"
    assert sdpipe("export", str(apart), "--out", str(export)).returncode == 0
    manifest = json.loads((export / "export.json").read_text())
    manifest["config"]["model"].update(arch="custom", _target_="os.system", kwargs={"command": "true"})
    (export / "export.json").write_text(json.dumps(manifest))
    assert "model._target_" in _refused(tmp_path, "eval", str(export))


def test_data_changed_since_the_run_is_refused_naming_what_differs(apart, tmp_path):
    """An export whose run read a text file (the record made here as the launcher makes it:
    the model reads bytes either way), evaluated after the text was edited in place to the
    same size: refused in one line naming data.path and its content. An export of an older
    sdpipe, whose record holds the sizes only, is evaluated, saying so."""
    from sdpipe_cli.data import sources

    export = tmp_path / "export"
    assert sdpipe("export", str(apart), "--out", str(export)).returncode == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(__file__).read_text() * 4)[:60000])
    manifest = json.loads((export / "export.json").read_text())
    cfg = OmegaConf.create(manifest["config"])
    cfg.data.update(name="text", path=str(corpus), resolved=None)
    cfg.data.resolved = sources.resolve(cfg)
    manifest["config"]["data"] = OmegaConf.to_container(cfg.data)
    (export / "export.json").write_text(json.dumps(manifest))
    corpus.write_text(corpus.read_text().replace("e", "q"))
    line = _refused(tmp_path, "eval", str(export))
    assert line.startswith(f"sdpipe: error: data.path: {corpus}: ") and "SHA-256" in line, line
    del manifest["config"]["data"]["resolved"]["read"]["sha256"]
    (export / "export.json").write_text(json.dumps(manifest))
    out = sdpipe("eval", str(export), "train.batch_size=4")
    assert out.returncode == 0 and "checked by its sizes only" in out.stderr, out.stderr[-2000:]


def test_an_interrupted_eval_says_so_in_its_own_words(apart):
    """Ctrl-C during sdpipe eval (its imports, its reading, its batches): one line, exit 130,
    in the command's words (not those of a training run's preparation)."""
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    cli = ("import sys; from sdpipe_cli.cli.parsing import main; print('ready', flush=True); "
           "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", cli, "eval", str(apart), "data.eval_batches=null"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["sdpipe: error: eval interrupted (SIGINT); nothing was written"], err


# -- the file system: a home folder, a full disk, what a killed export left, a pruned checkpoint ----

def test_a_home_folder_in_paths_is_the_users(allreduce_2x2_run, tmp_path, monkeypatch):
    """``~`` in export's and eval's --out and in resume's and sample's paths is $HOME, as
    ``run.dir`` takes it; never a folder named ``~`` in the working folder."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    out = sdpipe("export", str(allreduce_2x2_run), "--out", "~/model")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (home / "model" / "export.json").is_file()
    out = sdpipe("eval", str(allreduce_2x2_run), "--out", "~/eval.json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "val_loss" in json.loads((home / "eval.json").read_text())
    assert f"{home / 'absent'}: does not exist" in _refused(tmp_path, "resume", "~/absent")
    assert f"{home / 'absent'}: is not an export" in _refused(tmp_path, "sample", "~/absent",
                                                             "--prompt", "a")
    assert not (tmp_path / "~").exists()


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(allreduce_2x2_run, tmp_path):
    """On a file system too small for the export (a tmpfs; root only): the file it was writing
    named with ENOSPC, exit 2, and nothing left on it, the folders made for --out included."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    reference = tmp_path / "reference"
    assert sdpipe("export", str(allreduce_2x2_run), "--out", str(reference)).returncode == 0
    size = {p.name: p.stat().st_size for p in reference.iterdir()}
    disk = tmp_path / "disk"
    disk.mkdir()
    for file, room in (("model.pt", size["model.pt"] // 2),
                       ("model.safetensors", size["model.pt"] + size["model.safetensors"] // 2)):
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(disk)],
                                 capture_output=True, text=True, timeout=30)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
        try:
            out = sdpipe("export", str(allreduce_2x2_run), "--out", str(disk / "models" / "mlp"))
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
            line = out.stderr.splitlines()[-1]  # after the lines that say what was read
            assert [x for x in out.stderr.splitlines() if "error" in x] == [line], out.stderr
            assert f"--out: cannot write {disk / 'models' / 'mlp'} ({file}): the disk is full: " \
                   "No space left on device (ENOSPC); nothing was written" in line, line
            assert not list(disk.iterdir())
        finally:
            subprocess.run(["umount", "--lazy", str(disk)], check=True, timeout=30)  # even if busy


def _write_and_wait(out: str, ready) -> None:
    """A forked export writer: its partial folder made (as formats.write makes it), said, and
    then a wait until it is killed."""
    from sdpipe_cli.export import formats

    try:
        staging, _ = formats._partial_folder(Path(out))
        (staging / "model.pt").write_bytes(bytes(1000))
        ready.send(str(staging))
        time.sleep(60)
    finally:
        os._exit(0)


def test_a_killed_exports_partial_folder_is_removed_and_a_live_ones_refused(allreduce_2x2_run,
                                                                            tmp_path):
    """A writer's partial folder beside --out: refused while its writer runs (another export to
    the same --out), removed and said by the next export once it was killed (kill -9)."""
    out = tmp_path / "model"
    context = multiprocessing.get_context("fork")
    said, ready = context.Pipe(duplex=False)
    writer = context.Process(target=_write_and_wait, args=(str(out), ready))
    writer.start()
    try:
        assert said.poll(30), "the writer did not start"
        partial = Path(said.recv())
        assert "another export to" in _refused(tmp_path, "export", str(allreduce_2x2_run), "--out",
                                               str(out))
        assert partial.is_dir() and not out.exists()
    finally:
        writer.kill()  # SIGKILL: as kill -9
        writer.join(30)
    assert partial.is_dir()  # what kill -9 leaves
    done = sdpipe("export", str(allreduce_2x2_run), "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{partial} (0.0 MB), a partial export to {out} left by an export that did not end, " \
           "removed" in done.stderr
    assert (out / "export.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_checkpoint_pruned_while_it_is_read_is_said_so(allreduce_2x2_run, tmp_path):
    """The run goes on and prunes the checkpoint an export reads (checkpoint.keep): renamed, then
    removed, between the export's check of the manifest and its reading the shards."""
    from sdpipe_cli import checkpoint
    from sdpipe_cli.export import weights
    from sdpipe_cli.runtime.errors import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(allreduce_2x2_run, run)
    source = weights.find(run, "step_10")
    pruned = run / "checkpoints" / f"{checkpoint.DELETING_PREFIX}step_10"
    (run / "checkpoints" / "step_10").rename(pruned)
    shutil.rmtree(pruned)
    with pytest.raises(CheckpointError, match=r"step_10: was removed while it was read \(a run still "
                       r"training prunes its older checkpoints: checkpoint.keep\): export again"):
        weights.merge(source)
