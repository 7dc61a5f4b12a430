"""Tokenized corpora: ``prepare_text`` writes shards and a manifest, ``open_tokens`` checks them, and
``TokenWindows`` cuts training samples out of memory-mapped shards."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from sdpipe_cli.data import tokenizer
from sdpipe_cli.data.corpus import _stdlib_bytes
from sdpipe_cli.data.prepare import prepare_text
from sdpipe_cli.data.tokens import MANIFEST, TokenWindows, file_sha256, fingerprint, mask_tokens, open_tokens
from sdpipe_cli.runtime.errors import DataError

WORDS = ("the pipeline stage sends its activations to the next stage while the optimizer waits for "
         "gradients from every shard of the batch; a slow worker holds back its peers unless the "
         "schedule adapts, Über café naïve").split()


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(max(1, n_words // 12)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return "\n".join(lines) + "\n"


def _corpus_dir(root: Path, n_files: int = 4, n_words: int = 600) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (root / f"doc{i}.txt").write_text(_text(n_words, i), encoding="utf-8")
    return root


def _read_split(out: Path, manifest: dict, split: str) -> list[int]:
    width = {"uint16": 2, "uint32": 4}[manifest["dtype"]]
    data = b"".join((out / e["file"]).read_bytes() for e in manifest["splits"][split])
    return [int.from_bytes(data[i:i + width], "little") for i in range(0, len(data), width)]


def _quiet(_line: str) -> None:
    pass


def _no_leftovers(parent: Path) -> bool:
    return not any(p.name.endswith(".tmp") for p in parent.iterdir())


# ----------------------------------------------------------------------------- prepare_text


def test_bytes_tokenizer_round_trip(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("héllo wörld\n", encoding="utf-8")
    (src / "b.md").write_text("second document", encoding="utf-8")
    lines: list[str] = []
    m = prepare_text([str(src)], str(tmp_path / "out"), val_fraction=0.25, log=lines.append)
    out = tmp_path / "out"
    assert m == json.loads((out / MANIFEST).read_text())
    assert m["tokenizer"] == {"spec": "bytes", "kind": "bytes", "vocab_size": 256, "file": None,
                              "eos_id": None, "mask_id": None}
    assert m["dtype"] == "uint16" and not (out / "tokenizer.json").exists()
    expected = list("héllo wörld\nsecond document".encode())
    assert _read_split(out, m, "train") + _read_split(out, m, "val") == expected
    assert len(_read_split(out, m, "val")) == int(len(expected) * 0.25)
    assert m["documents"] == 2 and m["text_bytes"] == len(expected)
    assert m["sources"] == [str(src.resolve())]
    assert lines and any("documents" in line for line in lines)


def test_bpe_manifest_shards_and_val_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer, "ENCODE_CHUNK_DOCS", 3)  # several encode_batch chunks
    src = _corpus_dir(tmp_path / "src", n_files=7)
    out = tmp_path / "out"
    m = prepare_text([str(src)], str(out), "bpe:300", val_fraction=0.2, shard_tokens=500, log=_quiet)
    tok = m["tokenizer"]
    assert tok["kind"] == "bpe" and tok["vocab_size"] == 300 and tok["file"] == "tokenizer.json"
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok["eos_id"] == hf.token_to_id("<|endoftext|>") and tok["mask_id"] is None
    stream: list[int] = []
    for path in sorted(src.iterdir()):
        stream += hf.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids + [tok["eos_id"]]
    train, val = _read_split(out, m, "train"), _read_split(out, m, "val")
    assert train + val == stream
    assert len(val) == int(len(stream) * 0.2) > 500  # the tail spans two train shards and two val shards
    for split in ("train", "val"):
        entries = m["splits"][split]
        assert [e["file"] for e in entries] == [f"{split}-{i:05d}.bin" for i in range(len(entries))]
        assert all(e["tokens"] == 500 for e in entries[:-1]) and 0 < entries[-1]["tokens"] <= 500
        for e in entries:
            data = (out / e["file"]).read_bytes()
            assert len(data) == 2 * e["tokens"] and hashlib.sha256(data).hexdigest() == e["sha256"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST, "tokenizer.json"] + [e["file"] for s in ("train", "val") for e in m["splits"][s]])
    corpus = open_tokens(str(out))
    assert corpus.tokens("train") == len(train) and corpus.vocab_size == 300
    assert corpus.eos_id == tok["eos_id"] and corpus.dtype == torch.uint16
    assert torch.cat(corpus.shards("val")).tolist() == val


@pytest.mark.parametrize("shard_tokens, val_fraction", [(10, 0.1), (7, 0.33), (1, 0.05), (1000, 0.5)])
def test_val_tail_at_any_shard_boundary(tmp_path, shard_tokens, val_fraction):
    text = bytes(range(32, 127)) + b"abcde"  # 100 ASCII bytes: 100 tokens
    (tmp_path / "t.txt").write_bytes(text)
    m = prepare_text([str(tmp_path / "t.txt")], str(tmp_path / "out"), shard_tokens=shard_tokens,
                     val_fraction=val_fraction, log=_quiet)
    n_val = int(100 * val_fraction)
    train, val = _read_split(tmp_path / "out", m, "train"), _read_split(tmp_path / "out", m, "val")
    assert (bytes(train), bytes(val)) == (text[:100 - n_val], text[100 - n_val:])
    for split, want in (("train", 100 - n_val), ("val", n_val)):
        entries = m["splits"][split]
        assert [e["tokens"] for e in entries] == [shard_tokens] * (want // shard_tokens) + (
            [want % shard_tokens] if want % shard_tokens else [])
    files = {e["file"] for s in ("train", "val") for e in m["splits"][s]}
    assert {p.name for p in (tmp_path / "out").glob("*.bin")} == files
    open_tokens(str(tmp_path / "out"))


def test_wordpiece_has_mask_and_eos(tmp_path):
    src = _corpus_dir(tmp_path / "src", n_files=2)
    out = tmp_path / "out"
    m = prepare_text([str(src)], str(out), "wordpiece:400", log=_quiet)
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok = m["tokenizer"]
    assert tok["kind"] == "wordpiece"
    assert tok["mask_id"] == hf.token_to_id("[MASK]") and tok["eos_id"] == hf.token_to_id("[SEP]")
    assert hf.encode("ÜBER Pipeline", add_special_tokens=False).ids == \
        hf.encode("uber pipeline", add_special_tokens=False).ids
    stream = _read_split(out, m, "train") + _read_split(out, m, "val")
    assert stream[-1] == tok["eos_id"] and stream.count(tok["eos_id"]) == 2
    assert open_tokens(str(out)).mask_id == tok["mask_id"]


def test_jsonl_text_key_and_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"body": "first doc", "id": 1}\n\n{"body": "second"}\n', encoding="utf-8")
    m = prepare_text([str(good)], str(tmp_path / "out"), text_key="body", val_fraction=0.1, log=_quiet)
    assert m["documents"] == 2 and m["sources"] == [str(good)]
    assert bytes(_read_split(tmp_path / "out", m, "train") + _read_split(tmp_path / "out", m, "val")) \
        == b"first docsecond"

    for lines, lineno in ((['{"body": "ok"}', '{"text": "no body"}'], 2), (['{"body": "ok"}', "", "{oops"], 3)):
        bad = tmp_path / "bad.json"
        bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
        with pytest.raises(DataError) as err:
            prepare_text([str(bad)], str(tmp_path / "bad-out"), text_key="body", log=_quiet)
        assert err.value.key == f"{bad}:{lineno}"
        assert not (tmp_path / "bad-out").exists() and _no_leftovers(tmp_path)


def test_tokenizer_file_is_reused(tmp_path):
    src = _corpus_dir(tmp_path / "src", n_files=2)
    first = prepare_text([str(src)], str(tmp_path / "a"), "bpe:300", log=_quiet)
    spec = str(tmp_path / "a" / "tokenizer.json")
    again = prepare_text([str(src)], str(tmp_path / "b"), spec, log=_quiet)
    assert again["tokenizer"]["kind"] == "file" and again["tokenizer"]["spec"] == spec
    for key in ("vocab_size", "eos_id", "mask_id"):
        assert again["tokenizer"][key] == first["tokenizer"][key]
    assert again["splits"] == first["splits"]
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == Path(spec).read_bytes()
    assert fingerprint(open_tokens(str(tmp_path / "a"))) == fingerprint(open_tokens(str(tmp_path / "b")))


def test_large_vocabulary_picks_uint32_and_refuses_uint16(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    hf = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "big.json"))
    (tmp_path / "doc.txt").write_text("w1 w69999 w5 w2 w3 w4 w6 w7 w8 w9 w10", encoding="utf-8")
    m = prepare_text([str(tmp_path / "doc.txt")], str(tmp_path / "out"), str(tmp_path / "big.json"),
                     val_fraction=0.2, log=_quiet)
    assert m["dtype"] == "uint32" and m["tokenizer"]["eos_id"] is None
    assert 69999 in _read_split(tmp_path / "out", m, "train")
    assert open_tokens(str(tmp_path / "out")).dtype == torch.uint32
    with pytest.raises(DataError) as err:
        prepare_text([str(tmp_path / "doc.txt")], str(tmp_path / "out16"), str(tmp_path / "big.json"),
                     dtype="uint16", log=_quiet)
    assert err.value.key == "--dtype" and not (tmp_path / "out16").exists()


def test_stdlib_source_with_max_bytes(tmp_path):
    m = prepare_text(["stdlib"], str(tmp_path / "out"), max_bytes=3000, val_fraction=0.1, log=_quiet)
    assert m["sources"] == ["stdlib"] and 2997 <= m["text_bytes"] <= 3000
    stream = _read_split(tmp_path / "out", m, "train") + _read_split(tmp_path / "out", m, "val")
    assert bytes(stream) == bytes(_stdlib_bytes(m["text_bytes"]).tolist())
    again = prepare_text(["stdlib"], str(tmp_path / "again"), max_bytes=3000, val_fraction=0.1, log=_quiet)
    assert again["splits"] == m["splits"]


def test_binary_files_are_skipped_and_empty_out_folder_accepted(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "blob.bin").write_bytes(b"\x00\x01binary")
    (src / "z.txt").write_bytes(b"caf\xe9 ok")  # not UTF-8: the bytes tokenizer keeps its bytes
    (tmp_path / "out").mkdir()
    m = prepare_text([str(src)], str(tmp_path / "out"), val_fraction=0.2, log=_quiet)
    stream = _read_split(tmp_path / "out", m, "train") + _read_split(tmp_path / "out", m, "val")
    assert bytes(stream) == b"caf\xe9 ok" and m["documents"] == 1


def _bad_inputs(tmp_path: Path) -> list[tuple[dict, str]]:
    """(prepare_text keyword arguments, the DataError key expected)."""
    src = _corpus_dir(tmp_path / "src", n_files=1, n_words=60)
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "nothing.txt").write_text("")
    (tmp_path / "blank" / "zero.bin").write_bytes(b"\x00\x00")
    (tmp_path / "tiny.txt").write_text("ab")
    ok = {"sources": [str(src)]}
    return [
        ({**ok, "tokenizer": "sentencepiece:100"}, "--tokenizer"),
        ({**ok, "tokenizer": "bpe:abc"}, "--tokenizer"),
        ({**ok, "tokenizer": "bpe:256"}, "--tokenizer"),
        ({**ok, "tokenizer": "wordpiece:5"}, "--tokenizer"),
        ({**ok, "tokenizer": str(tmp_path / "no" / "tokenizer.json")}, "--tokenizer"),
        ({**ok, "tokenizer": str(tmp_path / "tiny.txt")}, "--tokenizer"),
        ({**ok, "dtype": "int8"}, "--dtype"),
        ({**ok, "val_fraction": 0.0}, "--val-fraction"),
        ({**ok, "val_fraction": 1.0}, "--val-fraction"),
        ({**ok, "shard_tokens": 0}, "--shard-tokens"),
        ({**ok, "max_bytes": 0}, "--max-bytes"),
        ({"sources": []}, "sources"),
        ({"sources": [str(tmp_path / "missing.txt")]}, str(tmp_path / "missing.txt")),
        ({"sources": [str(tmp_path / "empty")]}, str(tmp_path / "empty")),
        ({"sources": [str(tmp_path / "blank")]}, "sources"),
        ({"sources": [str(tmp_path / "tiny.txt")]}, "--val-fraction"),
        ({**ok, "dataset_format": "json"}, "--dataset"),  # datasets hidden below
    ]


def test_every_bad_input_is_one_data_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    for kwargs, key in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        with pytest.raises(DataError) as err:
            prepare_text(out=str(out), log=_quiet, **kwargs)
        assert err.value.key == key, kwargs
        assert "\n" not in str(err.value), kwargs
        assert not out.exists() and _no_leftovers(tmp_path), kwargs
    assert "empty corpus" in str(_raises(prepare_text, [str(tmp_path / "blank")], str(tmp_path / "o")))
    assert "pip install datasets" in str(
        _raises(prepare_text, [str(tmp_path / "tiny.txt")], str(tmp_path / "o"), dataset_format="json"))


def _raises(fn, *args, **kwargs) -> DataError:
    with pytest.raises(DataError) as err:
        fn(*args, log=_quiet, **kwargs)
    return err.value


def test_existing_out_is_refused_and_untouched(tmp_path):
    src = _corpus_dir(tmp_path / "src", n_files=1, n_words=60)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert _raises(prepare_text, [str(src)], str(out)).key == "--out"
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert _raises(prepare_text, [str(src)], str(out / "keep.txt")).key == "--out"
    assert _no_leftovers(tmp_path)


def test_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": [1, 2, 3], "content": ["first", None, "third row"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    m = prepare_text([str(tmp_path / "rows.parquet")], str(tmp_path / "out"), text_key="content",
                     val_fraction=0.2, log=_quiet)
    assert m["documents"] == 2
    stream = _read_split(tmp_path / "out", m, "train") + _read_split(tmp_path / "out", m, "val")
    assert bytes(stream) == b"firstthird row"
    err = _raises(prepare_text, [str(tmp_path / "rows.parquet")], str(tmp_path / "o2"))
    assert err.key == str(tmp_path / "rows.parquet") and "--text-key" in err.reason


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    err = _raises(prepare_text, [str(tmp_path / "rows.parquet")], str(tmp_path / "out"))
    assert "pip install pyarrow" in err.reason and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- open_tokens


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    src = _corpus_dir(root / "src", n_files=3, n_words=300)
    prepare_text([str(src)], str(root / "tokens"), val_fraction=0.1, shard_tokens=2000, log=_quiet)
    return root / "tokens"


def _copy(prepared: Path, tmp_path: Path) -> tuple[Path, dict]:
    dst = tmp_path / "tokens"
    shutil.copytree(prepared, dst)
    return dst, json.loads((dst / MANIFEST).read_text())


def _open_error(path: Path, verify: bool = True) -> DataError:
    with pytest.raises(DataError) as err:
        open_tokens(str(path), verify=verify)
    assert err.value.key == "data.path" and "\n" not in str(err.value)
    return err.value


def test_open_tokens_reads_what_prepare_wrote(prepared):
    corpus = open_tokens(str(prepared))
    m = corpus.manifest
    assert len(m["splits"]["train"]) > 1
    shards = corpus.shards("train")
    assert [len(s) for s in shards] == [e["tokens"] for e in m["splits"]["train"]]
    assert all(s.dtype == torch.uint16 for s in shards)
    assert torch.cat(shards).tolist() == _read_split(prepared, m, "train")
    assert corpus.tokens("val") == m["splits"]["val"][0]["tokens"] and corpus.tokenizer_file is None
    assert len(fingerprint(corpus)) == 16 and fingerprint(corpus) == fingerprint(open_tokens(str(prepared)))


def test_open_tokens_flipped_byte_and_truncated_shard(prepared, tmp_path):
    dst, m = _copy(prepared, tmp_path)
    shard = dst / m["splits"]["train"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    err = _open_error(dst)
    assert shard.name in err.reason and "corrupt or changed" in err.reason
    open_tokens(str(dst), verify=False)  # sizes still match
    shard.write_bytes(bytes(data[:-2]))
    assert shard.name in _open_error(dst, verify=False).reason


def test_open_tokens_bad_folders_and_manifests(prepared, tmp_path):
    assert "does not exist" in _open_error(tmp_path / "nowhere").reason
    (tmp_path / "file").write_text("x")
    _open_error(tmp_path / "file")
    (tmp_path / "bare").mkdir()
    assert "sdpipe prepare text SRC --out DIR" in _open_error(tmp_path / "bare").reason

    dst, m = _copy(prepared, tmp_path)
    manifest = dst / MANIFEST
    broken = [
        "{not json",
        json.dumps({**m, "format": "other"}),
        json.dumps({**m, "version": 2}),
        json.dumps({**m, "dtype": "float32"}),
        json.dumps({**m, "splits": {"train": m["splits"]["train"]}}),
        json.dumps({**m, "tokenizer": {**m["tokenizer"], "vocab_size": 70_000}}),
        json.dumps({**m, "splits": {"train": m["splits"]["train"], "val": []}}),
        json.dumps({**m, "splits": {"train": m["splits"]["train"],
                                    "val": [{**m["splits"]["val"][0], "file": "../x.bin"}]}}),
    ]
    for text in broken:
        manifest.write_text(text)
        _open_error(dst)
    manifest.write_text(json.dumps(m))
    (dst / m["splits"]["val"][0]["file"]).unlink()
    assert "missing" in _open_error(dst, verify=False).reason


def test_fingerprint_survives_a_move_and_notices_new_data(prepared, tmp_path):
    dst, m = _copy(prepared, tmp_path)
    assert fingerprint(open_tokens(str(dst))) == fingerprint(open_tokens(str(prepared)))
    other = prepare_text([str(_corpus_dir(tmp_path / "src2", n_files=1))], str(tmp_path / "o"),
                         val_fraction=0.1, shard_tokens=2000, log=_quiet)
    assert other["splits"] != m["splits"]
    assert fingerprint(open_tokens(str(tmp_path / "o"))) != fingerprint(open_tokens(str(prepared)))


def test_large_shard_is_mapped_not_read(tmp_path):
    n = 32 * 2**20  # uint16 tokens: a 64 MiB shard, written sparse
    for name, tokens in (("train-00000.bin", n), ("val-00000.bin", 1000)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(2 * tokens)
    manifest = {
        "format": "sdpipe-tokens", "version": 1,
        "tokenizer": {"spec": "bytes", "kind": "bytes", "vocab_size": 256, "file": None,
                      "eos_id": None, "mask_id": None},
        "dtype": "uint16",
        "splits": {split: [{"file": f"{split}-00000.bin", "tokens": t, "sha256": file_sha256(tmp_path / f)}]
                   for split, t, f in (("train", n, "train-00000.bin"), ("val", 1000, "val-00000.bin"))},
        "documents": 1, "sources": ["x"], "text_bytes": n,
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    TokenWindows([torch.zeros(100, dtype=torch.uint8)], 8)[3]  # warm up torch's own allocations
    before = _rss_anon_kib()
    corpus = open_tokens(str(tmp_path), verify=True)
    windows = TokenWindows(corpus.shards("train"), 256)
    assert len(windows) == (n - 1) // 256
    for i in range(0, len(windows), len(windows) // 200):
        x, y = windows[i]
        assert x.dtype == torch.int64 and int(x.sum()) == 0
    assert _rss_anon_kib() - before < 8 * 1024


def _rss_anon_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    pytest.skip("needs /proc/self/status (Linux)")


# ----------------------------------------------------------------------------- windows and masking


def test_windows_overlap_by_one_and_never_cross_shards():
    shards = [torch.arange(10, dtype=torch.uint8), torch.arange(100, 103, dtype=torch.uint8),
              torch.arange(200, 207, dtype=torch.uint8)]
    ds = TokenWindows(shards, 3)
    assert len(ds) == 3 + 0 + 2
    x, y = ds[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3,)
    assert (x.tolist(), y.tolist()) == ([0, 1, 2], [1, 2, 3])
    assert ds[1][0].tolist() == [3, 4, 5] and ds[2][1].tolist() == [7, 8, 9]
    assert ds[3][0].tolist() == [200, 201, 202] and ds[4][1].tolist() == [204, 205, 206]
    assert ds[-1][1].tolist() == [204, 205, 206]
    assert sum((ds[i][1].tolist() for i in range(3)), []) == list(range(1, 10))  # each a target once
    with pytest.raises(IndexError):
        ds[5]
    assert len(list(ds)) == 5


def test_windows_over_mapped_shards(prepared):
    corpus = open_tokens(str(prepared))
    shards = corpus.shards("train")
    ds = TokenWindows(shards, 16)
    assert len(ds) == sum((len(s) - 1) // 16 for s in shards)
    first = (len(shards[0]) - 1) // 16
    assert ds[first][0].tolist() == shards[1][:16].tolist()


def test_too_little_data_for_one_window():
    with pytest.raises(DataError) as err:
        TokenWindows([torch.arange(8, dtype=torch.uint8), torch.arange(5, dtype=torch.uint8)], 8)
    assert err.value.key == "data" and "seq_len + 1" in err.value.reason
    with pytest.raises(DataError):
        TokenWindows([], 8)


def test_mlm_targets_only_where_chosen_and_seeded():
    g = torch.Generator().manual_seed(1)
    shard = torch.randint(0, 250, (64 * 1000 + 1,), generator=g).to(torch.uint8)
    ds = TokenWindows([shard], 64, objective="mlm", vocab_size=256)
    chosen = masked = total = 0
    for i in range(0, len(ds), 2):
        x, y = ds[i]
        orig = shard[i * 64:i * 64 + 64].long()
        picked = y != -100
        assert torch.equal(y[picked], orig[picked]) and torch.equal(x[~picked], orig[~picked])
        chosen += int(picked.sum())
        masked += int((x[picked] == 255).sum())  # default mask id: vocab_size - 1
        total += 64
    assert 0.13 < chosen / total < 0.17 and 0.75 < masked / chosen < 0.85
    torch.manual_seed(7)
    a = ds[3]
    torch.manual_seed(7)
    b = ds[3]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_mask_tokens_uses_the_given_mask_and_vocab():
    torch.manual_seed(0)
    tokens = torch.full((20_000,), 5, dtype=torch.int64)
    inputs, targets = mask_tokens(tokens, mask_id=9, vocab=7)
    changed = inputs[inputs != 5]
    assert set(changed.unique().tolist()) <= set(range(7)) | {9}
    assert inputs.dtype == targets.dtype == torch.int64
    assert set(targets.unique().tolist()) == {-100, 5}


def test_a_token_outside_the_vocabulary_is_bad_data_not_an_index_error():
    """With data.verify=false nothing compares the shards with their manifest: a window holding an
    id past the vocabulary names the data instead of failing in an embedding."""
    from sdpipe_cli.data.tokens import TokenWindows
    from sdpipe_cli.runtime.errors import DataError

    shard = torch.arange(20, dtype=torch.int32) % 250
    shard[13] = 300
    windows = TokenWindows([shard], seq_len=4, vocab_size=256)
    assert windows[0][0].tolist() == [0, 1, 2, 3]
    with pytest.raises(DataError) as bad:
        windows[3]  # tokens 12..16: holds 300
    assert bad.value.key == "data.path" and "token id 300" in str(bad.value)
