"""``sdpipe eval``: a model's loss (and a classifier's accuracy) on a validation set, in one process.

The model is the whole of its blocks run as one stage of one pipeline: the same
:meth:`~sdpipe_cli.pipeline.executor.Executor.forward_only`, micro-batches, precision and
averaging (:mod:`sdpipe_cli.pipeline.validation`) as the run's own ``eval`` records, on the same
fixed validation batches (the split's first ``data.eval_batches x train.batch_size`` samples), so
the two agree to rounding. Another data set is a ``data=NAME`` or ``data.*`` override; the batch
and micro-batch sizes may change too. Nothing else may: the model is what it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import psutil
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from sdpipe_cli.config.schema import ConfigError, objective
from sdpipe_cli.core.segments import partitions_of
from sdpipe_cli.data import sources
from sdpipe_cli.data.loader import evaluation_batches
from sdpipe_cli.model import memory, models
from sdpipe_cli.model.boundary import map_tensors
from sdpipe_cli.pipeline import validation
from sdpipe_cli.pipeline.executor import Executor
from sdpipe_cli.runtime.errors import DataError

__all__ = ["CHANGEABLE", "check_keys", "check_memory", "evaluate", "with_overrides"]

CHANGEABLE = ("data=NAME", "data.*", "train.batch_size", "pipeline.microbatches", "run.memory_check")


def with_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """``cfg`` (typed by its schema) with the user's data and batch changes (see
    :data:`CHANGEABLE`); changed data is checked, opened again and described (``data.resolved``),
    and must give the model what it was trained on. Bad input: a ConfigError or DataError."""
    from sdpipe_cli.config.composition import compose
    from sdpipe_cli.config.validation import validate_data

    check_keys(overrides)
    cfg = cfg.copy()
    trained = cfg.data.get("resolved")
    trained = OmegaConf.to_container(trained) if trained is not None else None
    dotlist = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.lstrip("+~") == "data":
            dirs = [d for d in cfg.run.get("config_dirs") or [] if Path(d).is_dir()]
            search = [f"hydra.searchpath=[{','.join('file://' + d for d in dirs)}]"] if dirs else []
            cfg.data = compose([*search, f"data={value}"]).data
        else:
            dotlist.append(f"{key.lstrip('+~')}={value}")
    try:
        # a mapping merged into the DictConfig cfg: a DictConfig
        cfg = cast(DictConfig, OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist)))
    except Exception as err:  # OmegaConf's errors name the key
        raise ConfigError(getattr(err, "full_key", None) or "overrides",
                          str(err).splitlines()[0]) from None
    for key in ("train.batch_size", "pipeline.microbatches"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(key, f"must be a positive integer, got {value!r}")
    if cfg.train.batch_size % cfg.pipeline.microbatches:
        raise ConfigError("pipeline.microbatches", f"{cfg.pipeline.microbatches} does not divide "
                          f"train.batch_size={cfg.train.batch_size}")
    validate_data(cfg)
    if any(o.split("=", 1)[0].lstrip("+~").split(".")[0] == "data" for o in overrides):
        cfg.data.resolved = None
        _fits(cfg, trained, sources.resolve(cfg))
    return cfg


def _fits(cfg: DictConfig, trained, now: dict) -> None:
    """The new data gives the model what it was trained on: samples of the same layout, token
    ids within its vocabulary, classes within its outputs; then it is the config's data."""
    if trained and (now["input"], now["target"]) != (trained["input"], trained["target"]):
        raise DataError("data", f"its samples are {now['input']} -> {now['target']}; the model "
                        f"was trained on {trained['input']} -> {trained['target']}")
    vocab = now.get("vocab_size") or (256 if cfg.data.name in sources.CORPORA else None)
    if vocab is not None and cfg.model.get("vocab_size") and vocab > cfg.model.vocab_size:
        raise DataError("data", f"its tokens go up to {vocab}, beyond the model's vocabulary of "
                        f"{cfg.model.vocab_size}")
    classes = now.get("classes")
    if classes is not None and cfg.model.get("num_classes") and classes > cfg.model.num_classes:
        raise DataError("data", f"it has {classes} classes, the model {cfg.model.num_classes}")
    cfg.data.resolved = now


def check_keys(overrides: Sequence[str]) -> None:
    """Every override is KEY=VALUE of a key :data:`CHANGEABLE` names; else a ConfigError."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.lstrip("+~")
        if not sep:
            raise ConfigError(key or "overrides", f"'{item}' is not KEY=VALUE")
        if not (key == "data" or key.startswith("data.")
                or key in CHANGEABLE):
            raise ConfigError(key, f"cannot change in sdpipe eval (it may change "
                              f"{', '.join(CHANGEABLE)})")


def evaluate(cfg: DictConfig, blocks: Sequence[nn.Module],
             on_batch: Callable[[int], None] | None = None,
             device: torch.device | None = None,
             pipeline: int | None = None,
             say: Callable[[str], None] = lambda line: None) -> validation.Outcome:
    """The loss (and accuracy) of ``blocks`` on ``cfg``'s validation batches; under a low
    ``train.precision`` activations cross the stage boundaries of ``pipeline``'s partition (its
    own, with ``pipeline.partitions``; by default pipeline 0's, whose replica a merge of equal
    ones takes), as that pipeline's eval did. The data must be what the run read (unless it
    was overridden); ``say`` is told when that can be checked by its sizes only."""
    device = device or default_device()
    low = models.AUTOCAST.get(str(cfg.train.precision))
    cuts = set()
    if low is not None:
        own = partitions_of(cfg.pipeline, int(cfg.cluster.pipelines))
        cuts = {int(c) for c in own[pipeline or 0]}
    module = nn.Sequential(*[m for i, block in enumerate(blocks)
                             for m in ((_Crossing(low), block) if i in cuts else (block,))])
    module = module.to(device).eval()
    stage = Executor(module, 0, 1, None, None, (None, None), device,
                     models.loss_function(cfg.model), autocast=low)
    splits = sources.open_splits(cfg)
    if not sources.check_same(splits, cfg.data.get("resolved"), "sdpipe eval", "when it trained"):
        say(f"note: the run recorded no digest of its data's content (an older sdpipe): "
            f"{data_name(cfg)} is checked by its sizes only")
    batches = ((b.inputs, b.targets) for b in evaluation_batches(
        splits.val, sources.val_count(cfg), int(cfg.train.batch_size), int(cfg.train.seed),
        sources.workers(cfg)))
    with torch.no_grad():
        outcome = validation.validate(stage, batches, int(cfg.pipeline.microbatches), first=True,
                                      last=True, classify=objective(cfg) == "classify",
                                      device=device, on_batch=on_batch)
    assert outcome is not None  # the one stage is the last
    return outcome


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_memory(cfg: DictConfig, device: torch.device | None = None) -> None:
    """Refuse an evaluation that cannot fit on ``device`` (by default :func:`evaluate`'s), as
    a training run is refused (:func:`~sdpipe_cli.cli.preparing.check_memory`,
    ``run.memory_check``), before its first batch is made: a batch far too large otherwise grows
    the process for minutes and ends in a MemoryError. The weights are in memory already; on a
    GPU they are copied there."""
    if not cfg.run.memory_check:
        return
    device = device or default_device()
    size = int(cfg.train.batch_size)
    need = memory.evaluation(cfg, sources.example(cfg, size, device="meta"),
                             sources.example(cfg, size // int(cfg.pipeline.microbatches),
                                             device="meta")[0])
    if need is None:
        return
    host = psutil.virtual_memory().available
    if device.type == "cuda":
        places = [("its GPU", need.weights + need.activations, torch.cuda.mem_get_info(device)[0]),
                  ("this machine", need.batch, host)]
    else:
        places = [("this machine", need.batch + need.activations, host)]
    for where, bytes_, have in places:
        if bytes_ > have:
            raise ConfigError("train.batch_size", f"the evaluation needs about "
                              f"{bytes_ / memory.GIB:.1f} GiB more on {where} ({need.describe()}), "
                              f"but {have / memory.GIB:.1f} GiB is available; lower "
                              "train.batch_size or raise pipeline.microbatches "
                              "(run.memory_check=false to try anyway)")


class _Crossing(nn.Module):
    """A stage boundary of the run under ``train.precision=bf16|fp16``: an activation's floating
    tensors cross it in the low precision (as the run's messages did), so the one-process
    evaluation computes what the run's stages computed."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return map_tensors(lambda t: t.to(self.dtype) if t.is_floating_point() else t, x)


def data_name(cfg: DictConfig) -> str:
    path = cfg.data.get("path")
    return f"{cfg.data.name} ({Path(str(path)).name})" if path else str(cfg.data.name)
