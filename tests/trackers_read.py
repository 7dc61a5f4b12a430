"""Reading back what the experiment trackers wrote, through their own formats: MLflow's client
on the file store, and W&B's records (its protobuf ``Record``) in an offline run's ``.wandb``
file."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def mlflow_run(run_dir: Path):
    """The client of ``<run>/mlruns`` and the one MLflow run there."""
    import os

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 reads a file store only so
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(Path(run_dir) / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("sdpipe")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


_BLOCK = 32 * 1024  # the .wandb file: LevelDB's log framing, after a 7-byte header
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every ``wandb_internal_pb2.Record`` of one ``.wandb`` file, in order (wandb 0.2x and
    later keep no Python reader of its own: this follows its writer's framing)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
    records, pos, payload = [], 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero-filled rest of the last block
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        payload = chunk if kind in (_FULL, _FIRST) else payload + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(payload)
            records.append(record)
    return records


def wandb_run(run_dir: Path) -> dict[str, Any]:
    """The one offline W&B run under ``<run>/wandb``: its ``run`` record, ``config`` (key ->
    value), ``history`` rows (key -> value), ``metrics`` (name -> step metric) and ``exit`` code
    (None: it did not finish)."""
    files = sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out: dict[str, Any] = {"history": [], "metrics": {}, "exit": None}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
            out["config"] = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind == "metric":
            out["metrics"][record.metric.name] = record.metric.step_metric
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def series(history: list[dict], tag: str, axis: str) -> dict[int, float]:
    """One W&B series as step -> value, on its step metric ``axis``."""
    return {row[axis]: row[tag] for row in history if tag in row}
