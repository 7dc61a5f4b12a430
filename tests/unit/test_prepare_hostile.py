"""``sdpipe prepare text`` against hostile input: every case is one ``sdpipe: error: KEY: ...`` line,
exit 2 (130 for an interrupt), no traceback, nothing half-written left and nothing existing lost.

In-process (``parsing.main`` with capsys, or the module's functions) wherever no process boundary
is under test; a subprocess, with a timeout, only for a signal or a file size limit.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sdpipe_cli.cli.parsing import main
from sdpipe_cli.data import documents, prepare as prep, shard_writer, tokenizer
from sdpipe_cli.runtime.errors import DataError
from tests.helpers import one_error_line

CLI = "import sys; from sdpipe_cli.cli.parsing import main; sys.exit(main(sys.argv[1:]))"
REPO = Path(__file__).resolve().parents[2]


def _quiet(_line: str) -> None:
    pass


def _no_tmp(folder: Path) -> bool:
    return not any(p.name.endswith(".tmp") for p in folder.iterdir())


def _words(n: int, seed: int = 0, vocab: int = 3000) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 10)))
             for _ in range(vocab)]
    return " ".join(rng.choice(words) for _ in range(n))


def _stream(out: Path, split: str | None = None) -> list[int]:
    manifest = json.loads((out / "manifest.json").read_text())
    width = {"uint16": 2, "uint32": 4}[manifest["dtype"]]
    splits = [split] if split else ["train", "val"]
    data = b"".join((out / e["file"]).read_bytes() for s in splits for e in manifest["splits"][s])
    return [int.from_bytes(data[i:i + width], "little") for i in range(0, len(data), width)]


def _refused(capsys, key: str, *argv: str) -> str:
    rc = main(["prepare", "text", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    return one_error_line(err, key)


# ----------------------------------------------------------------------------- 1: long lines


def test_a_long_line_reaches_the_tokenizer_in_bounded_pieces(tmp_path, monkeypatch):
    """A file of one line was handed whole to the tokenizer (20 MB: 4 GB of memory); now no text
    longer than PIECE_CHARS is, cut where bpe splits anyway: the tokens are the same."""
    monkeypatch.setattr(documents, "PIECE_CHARS", 1000)
    monkeypatch.setattr(documents, "CUT_WINDOW", 200)
    text = _words(4000)  # ~24 000 characters, no newline
    (tmp_path / "line.txt").write_text(text)
    resolved = documents.resolve_sources([str(tmp_path / "line.txt")])
    pieces = list(documents.documents(resolved, "text", None, None))
    assert len(pieces) > 20 and all(len(t) <= 1000 for t, _ in pieces)
    assert "".join(t for t, _ in pieces) == text
    assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(t[0] == " " for t, _ in pieces[1:])  # cut before " word", never inside a word

    seen: list[int] = []
    train, encode = tokenizer.train_tokenizer, tokenizer._encode_chunk
    monkeypatch.setattr(prep, "train_tokenizer", lambda tok, docs: train(tok, (seen.append(len(d)) or d
                                                                                for d in docs)))
    monkeypatch.setattr(tokenizer, "_encode_chunk", lambda tok, chunk: (
        seen.extend(len(t) for t, _ in chunk), encode(tok, chunk))[1])
    m = prep.prepare_text([str(tmp_path / "line.txt")], str(tmp_path / "out"), "bpe:400",
                          val_fraction=0.1, log=_quiet)
    assert seen and max(seen) <= 1000 and m["documents"] == 1
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    whole = hf.encode(text, add_special_tokens=False).ids + [m["tokenizer"]["eos_id"]]
    assert _stream(tmp_path / "out") == whole


def test_a_large_file_is_read_in_chunks_with_its_bytes_intact(tmp_path, monkeypatch):
    """Past SMALL_FILE a text file is streamed READ_CHUNK bytes at a time; a UTF-8 character or
    an invalid byte astride two reads comes out whole, and a NUL anywhere still skips the file."""
    monkeypatch.setattr(documents, "PIECE_CHARS", 500)
    monkeypatch.setattr(documents, "SMALL_FILE", 2000)
    monkeypatch.setattr(documents, "READ_CHUNK", 333)
    data = ("wörd ü€𝄞 " * 800).encode() + b"\xff\xfe tail"
    (tmp_path / "big.txt").write_bytes(data)
    reads: list[int] = []
    real_read = documents.open_source

    def spying(path, where=None):
        f = real_read(path, where)
        read = f.read
        f.read = lambda n=-1: (reads.append(n), read(n))[1]
        return f

    monkeypatch.setattr(documents, "open_source", spying)
    pieces = list(documents._text_file(tmp_path / "big.txt"))
    assert all(len(t) <= 500 for t, _ in pieces) and pieces[-1][1] and len(pieces) > 10
    assert b"".join(documents.utf8(t) for t, _ in pieces) == data
    assert reads and all(0 < n <= max(documents.SMALL_FILE + 1, documents.COPY_CHUNK) for n in reads)
    (tmp_path / "nul.txt").write_bytes(data + b"\0")
    assert list(documents._text_file(tmp_path / "nul.txt")) == []


# ----------------------------------------------------------------------------- 2: special files


def test_a_named_pipe_or_device_is_refused_in_one_line(tmp_path, capsys):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    line = _refused(capsys, str(fifo), str(fifo), "--out", str(tmp_path / "out"))
    assert "named pipe" in line
    line = _refused(capsys, "/dev/null", "/dev/null", "--out", str(tmp_path / "out"))
    assert "character device" in line
    (tmp_path / "a.txt").write_text("some text " * 50)
    line = _refused(capsys, "--tokenizer", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"),
                    "--tokenizer", str(fifo))
    assert "named pipe" in line
    assert not (tmp_path / "out").exists() and _no_tmp(tmp_path)


def test_a_file_swapped_for_a_named_pipe_after_listing_does_not_hang(tmp_path):
    """Listed as a regular file, a pipe by the time it is read: refused, not waited on."""
    fifo = tmp_path / "late.txt"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(list(documents._text_file(fifo)))
        except DataError as e:
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # the old code blocks in open(): give it a writer and EOF
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading a named pipe blocked")
    assert isinstance(outcome[0], DataError) and "named pipe" in str(outcome[0])


# ----------------------------------------------------------------------------- 3: vocabulary sizes


def test_an_absurd_vocabulary_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text " * 50)
    for spec in ("bpe:99999999999999999999", f"bpe:{tokenizer.MAX_VOCAB + 1}", "wordpiece:5000000000"):
        line = _refused(capsys, "--tokenizer", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"),
                        "--tokenizer", spec)
        assert "at most" in line
    with pytest.raises(DataError) as bad:  # what made the trainer abort the process (SIGABRT)
        tokenizer.parse_tokenizer("bpe:5000000000")
    assert bad.value.key == "--tokenizer"
    assert tokenizer.parse_tokenizer(f"bpe:{tokenizer.MAX_VOCAB}").vocab == tokenizer.MAX_VOCAB
    assert not (tmp_path / "out").exists() and _no_tmp(tmp_path)


# ----------------------------------------------------------------------------- 4: deep JSON


def test_deeply_nested_json_names_the_file_and_line(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 200_000 + "]" * 200_000 + "}\n"
                    + '{"text": "x", "n": ' + "9" * 5000 + "}\n")
    line = _refused(capsys, f"{rows}:2", str(rows), "--out", str(tmp_path / "out"))
    assert "nested too deeply" in line
    rows.write_text('{"text": "fine"}\n{"text": "x", "n": ' + "9" * 5000 + "}\n")
    line = _refused(capsys, f"{rows}:2", str(rows), "--out", str(tmp_path / "out"))
    assert "not JSON" in line  # too many digits for an int: a ValueError without .msg
    assert not (tmp_path / "out").exists() and _no_tmp(tmp_path)


# ----------------------------------------------------------------------------- 5: writing --out


def test_out_under_a_regular_file_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text " * 50)
    (tmp_path / "somefile").write_text("mine")
    line = _refused(capsys, "--out", str(tmp_path / "a.txt"), "--out", str(tmp_path / "somefile" / "sub"))
    assert "somefile" in line and "not a folder" in line
    line = _refused(capsys, "--out", str(tmp_path / "a.txt"), "--out",
                    str(tmp_path / "somefile" / "sub" / "deeper"))
    assert (tmp_path / "somefile").read_text() == "mine" and _no_tmp(tmp_path)
    line = _refused(capsys, "--out", str(tmp_path / "a.txt"), "--out", str(tmp_path / ("x" * 300)))
    assert "File name too long" in line and _no_tmp(tmp_path)


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("some text " * 500)
    (tmp_path / "out").mkdir()  # an empty --out folder: kept as it was

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_writer.ShardWriter, "write_raw", full)
    line = _refused(capsys, "--out", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"))
    assert "ENOSPC" in line and "nothing was written" in line
    assert (tmp_path / "out").is_dir() and not any((tmp_path / "out").iterdir()) and _no_tmp(tmp_path)
    line = _refused(capsys, "--out", str(tmp_path / "a.txt"), "--out", str(tmp_path / "new" / "deep" / "out"))
    assert not (tmp_path / "new").exists() and _no_tmp(tmp_path)  # the folders made for it: gone


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "a.txt").write_text(_words(10_000))  # ~60 KB: 120 KB of uint16 tokens
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", CLI, "prepare", "text", str(tmp_path / "a.txt"),
                          "--out", str(out)], preexec_fn=_limit_file_size, capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2, run.stderr
    line = one_error_line(run.stderr, "--out")
    assert "EFBIG" in line and not out.exists() and _no_tmp(tmp_path)


@pytest.fixture
def read_only(tmp_path):
    """A folder on a read-only file system: a tmpfs mounted ro (root writes through a folder's
    mode bits, not through a read-only mount)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        if os.geteuid() == 0:
            pytest.fail(f"root could not mount a tmpfs: {done.stderr.strip()}")
        folder.chmod(0o500)  # another user: the mode bits stop it
        yield folder
        folder.chmod(0o700)
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_location_is_refused(tmp_path, capsys, read_only):
    (tmp_path / "a.txt").write_text("some text " * 50)
    line = _refused(capsys, "--out", str(tmp_path / "a.txt"), "--out", str(read_only / "out"))
    assert "EROFS" in line or "EACCES" in line


# ----------------------------------------------------------------------------- 6: Ctrl-C


def test_ctrl_c_stops_at_once_and_removes_what_was_being_written(tmp_path):
    """Training a bpe tokenizer is one native call of many seconds; Ctrl-C used to wait for it
    (its handler runs in the main thread only), then left the temporary folder."""
    src = tmp_path / "src"
    src.mkdir()
    letters = bytes((97 + b % 26) if b < 234 else 32 for b in range(256))  # words of ~11 letters
    for i in range(3):  # 9 MB of random words: a minute of training on 2 cores
        (src / f"{i}.txt").write_bytes(random.Random(i).randbytes(3_000_000).translate(letters))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", CLI, "prepare", "text", str(src), "--out", str(out),
                             "--tokenizer", "bpe:60000"], stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while _no_tmp(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # into the training
        assert proc.poll() is None, proc.stderr.read()
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert took < 3, f"{took:.1f} s to stop"
    lines = [line for line in err.splitlines() if line.startswith("sdpipe: ")]
    assert lines == [lines[-1]] and "interrupted" in lines[0] and "nothing was written" in lines[0], err
    assert "Traceback" not in err and not out.exists() and _no_tmp(tmp_path)
    assert "trained a bpe tokenizer" not in err  # it was the training that got interrupted


# ----------------------------------------------------------------------------- 7: bytes kept


def test_the_bytes_tokenizer_keeps_bytes_that_are_not_utf8(tmp_path, capsys, monkeypatch):
    data = b"caf\xe9 \xff\xfe ok \xe2\x82 \xf0\x9d\x84\x9e" * 50
    (tmp_path / "latin1.txt").write_bytes(data)
    assert main(["prepare", "text", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "out"),
                 "--val-fraction", "0.1"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert bytes(_stream(tmp_path / "out")) == data
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["text_bytes"] == len(data)
    # the same through --max-bytes (cut before a character it would split) and JSON lines
    m = prep.prepare_text([str(tmp_path / "latin1.txt")], str(tmp_path / "cut"), max_bytes=17,
                          val_fraction=0.2, log=_quiet)
    assert bytes(_stream(tmp_path / "cut")) == data[:m["text_bytes"]] and m["text_bytes"] == 14
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "caf\xe9"}\n{"text": "lone \\ud800"}\n')
    lines: list[str] = []
    prep.prepare_text([str(tmp_path / "rows.jsonl")], str(tmp_path / "rows"), val_fraction=0.2,
                      log=lines.append)
    assert bytes(_stream(tmp_path / "rows")) == b"caf\xe9lone \xef\xbf\xbd"
    assert any("1 lone surrogate" in line for line in lines)


def test_a_text_tokenizer_says_how_many_bytes_it_replaced(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 and more text " * 40 + b"\xff")
    (tmp_path / "rows.jsonl").write_text('{"text": "lone \\ud800 surrogate"}\n')
    assert main(["prepare", "text", str(tmp_path / "a.txt"), str(tmp_path / "rows.jsonl"),
                 "--out", str(tmp_path / "out"), "--tokenizer", "bpe:300", "--val-fraction", "0.1"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "42 bytes" in warnings[0] and "U+FFFD" in warnings[0], warnings
