"""What is trained: any model as an ordered list of blocks, its loss, and what crosses each stage.

A pipeline stage owns a contiguous range of blocks (or, interleaved, one a chunk), so a model
here is a list of modules, each taking one value (a tensor, or a tuple or dict of tensors) and
returning one. ``model.arch`` picks the builder (the registry below):

* ``gpt``, ``mlp``: the project's byte-level models (:mod:`sdpipe_cli.model.bytes_lm`);
* ``resnet18``, ``resnet50``, ``resnet_cifar``: ResNets written in the project with
  torchvision's parameter names (:mod:`sdpipe_cli.model.resnet`), split at residual blocks;
* ``gpt2``, ``bert``: Hugging Face transformers models built from their configs
  (:mod:`sdpipe_cli.model.hf`, the ``hf`` extra), split at transformer layers;
* ``custom``: ``model._target_`` names any importable callable, called with ``model.kwargs``,
  that returns a ``torch.nn.Sequential``, a list of modules, or an object with a
  ``pipeline_blocks()`` method returning either.

Every process builds the whole model from ``train.seed`` and keeps its slice, so all replicas
start identical without a broadcast. Parameters that one block shares with another (tied input
and output embeddings) are found by identity (:func:`tied_parameters`): across stages each holds
a copy, and the worker keeps the copies equal.

The layout of the value between two blocks is inferred once, on the meta device, from an example
micro-batch (:func:`boundaries`): the same on every process, nothing allocated, and a block whose
output does not fit the next one is an error before any process starts.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from sdpipe_cli.config.schema import HF_ARCHS, RESNET_BLOCKS, Config, ConfigError, ModelConfig
from sdpipe_cli.config.settings import plain
from sdpipe_cli.config.targets import import_callable
from sdpipe_cli.core.interleaved import stage_blocks
from sdpipe_cli.model import bytes_lm
from sdpipe_cli.model.boundary import Boundary, map_tensors
from sdpipe_cli.model.layout import ModelLayout, stage_ties as layout_ties
from sdpipe_cli.model.shapes_only import ShapesOnly

__all__ = ["build", "build_stage_module", "build_whole", "boundaries", "block_param_counts", "chunk_slices",
           "count_blocks", "loss_function", "tied_parameters"]

Blocks = tuple[list[nn.Module], list[str]]
RunConfig = DictConfig | Config  # a run's config: its record, or its settings (a worker's)
ModelSection = DictConfig | ModelConfig
IGNORE_INDEX = -100  # targets that take no part in the loss (masked LM: the unmasked tokens)


# -- builders -------------------------------------------------------------------------------------

def _bytes_lm(m: ModelSection) -> Blocks:
    names = ["embedding", *(f"layer{i}" for i in range(1, int(m.n_layers) + 1)), "head"]
    return bytes_lm.build_blocks(m), names


def _resnet(m: ModelSection) -> Blocks:
    from sdpipe_cli.model import resnet

    return resnet.build(m.arch, num_classes=int(cast(int, m.num_classes))).blocks()  # checked


def _hf(m: ModelSection) -> Blocks:
    from sdpipe_cli.model import hf

    try:
        return hf.build_blocks(m.arch, hf_overrides(m), m.pretrained, bool(m.tie_embeddings))
    except (ImportError, ValueError) as err:
        raise ConfigError(*_split_key(str(err), "model.arch")) from None


def hf_overrides(m: ModelSection) -> dict[str, Any]:
    """transformers config keys from the model's settings, then ``model.hf`` on top."""
    if m.arch == "gpt2":
        base = {"vocab_size": m.vocab_size, "n_positions": m.seq_len, "n_embd": m.d_model,
                "n_layer": m.n_layers, "n_head": m.n_heads, "n_inner": m.d_hidden,
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout}
    else:
        base = {"vocab_size": m.vocab_size, "max_position_embeddings": m.seq_len,
                "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
                "num_attention_heads": m.n_heads, "intermediate_size": m.d_hidden,
                "hidden_dropout_prob": m.dropout, "attention_probs_dropout_prob": m.dropout}
    return {**base, **cast(dict[str, Any], plain(m.hf))}  # the schema's dict[str, Any]


def _custom_parts(m: ModelSection) -> tuple[Any, list[nn.Module], list[str]]:
    """What the user's builder returned, and its blocks and their names."""
    target = getattr(m, "_target_", None)
    fn = import_callable(target, "model._target_")
    kwargs = cast(dict[str, Any], plain(m.kwargs))  # the schema's dict[str, Any]
    returned = made = _call_builder(fn, str(target), kwargs)
    if hasattr(made, "pipeline_blocks") and callable(made.pipeline_blocks):
        made = made.pipeline_blocks()
    names: list[str] | None = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], (list, tuple)) \
            and all(isinstance(n, str) for n in made[1]):
        made, names = made[0], list(made[1])
    if isinstance(made, nn.Sequential):
        names = names or [name for name, _ in made.named_children()]
        blocks = list(made.children())
    elif isinstance(made, (list, tuple, nn.ModuleList)):
        blocks = list(made)
    else:
        raise ConfigError("model._target_", f"{target} returned a {type(made).__name__}; return a "
                          "torch.nn.Sequential, a list of modules, or an object with pipeline_blocks()")
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise ConfigError("model._target_", f"{target} returned no blocks" if not blocks else
                          f"{target} returned a block that is not a torch.nn.Module")
    names = names or [f"block{i}" for i in range(len(blocks))]
    if len(names) != len(blocks):
        raise ConfigError("model._target_", f"{target} named {len(names)} of {len(blocks)} blocks")
    return returned, blocks, names


def _call_builder(fn: Callable[..., Any], target: str, kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)``: arguments it does not take are ``model.kwargs``'s fault, any other failure
    of the user's code (``sys.exit()`` included; Ctrl-C stays an interrupt) ``model._target_``'s."""
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call tells
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as err:
            raise ConfigError("model.kwargs", f"{target}: {err}") from None
    try:
        return fn(**kwargs)
    except TypeError as err:
        if signature is None:
            raise ConfigError("model.kwargs", f"{target}: {err}") from None
        raise ConfigError("model._target_", f"{target}({', '.join(kwargs)}) failed: {_text(err)}") from None
    except Exception as err:  # the user's code: its failure is their input's
        raise ConfigError("model._target_", f"{target}({', '.join(kwargs)}) failed: {_text(err)}") from None
    except SystemExit as exit_:
        raise ConfigError("model._target_", f"{target} called sys.exit({exit_.code!r}) while building "
                          "the model") from None


def _text(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


BUILDERS: dict[str, Callable[[ModelSection], Blocks]] = {
    "gpt": _bytes_lm, "mlp": _bytes_lm, "custom": lambda m: _custom_parts(m)[1:],
    **{arch: _resnet for arch in RESNET_BLOCKS}, **{arch: _hf for arch in HF_ARCHS}}


# Modules every worker of a model of these architectures imports: the fork server imports them
# once for all (transformers' model code takes seconds of CPU per process).
IMPORTS = {"gpt2": ["transformers.models.gpt2.modeling_gpt2", "transformers.masking_utils"],
           "bert": ["transformers.models.bert.modeling_bert", "transformers.masking_utils"]}


def imports(model_cfg: ModelSection) -> list[str]:
    return list(IMPORTS.get(str(model_cfg.arch), []))  # IMPORTS of the model's architecture


def build(model_cfg: ModelSection) -> Blocks:
    """The whole model's blocks and their names, initialised from the caller's torch RNG (callers
    seed it first). Raises :class:`ConfigError` naming the key when it cannot be built."""
    blocks, names = BUILDERS[model_cfg.arch](model_cfg)
    if not model_cfg.tie_embeddings:
        _untie(blocks)
    return blocks, names


Partition = Sequence[int] | None  # a pipeline's own split (RunPlan); None: pipeline.partition


def _held(cfg: RunConfig, partition: Partition, blocks: int) -> list[list[tuple[int, int]]]:
    bounds = cfg.pipeline.partition if partition is None else partition
    return stage_blocks([int(b) for b in bounds], blocks, int(cfg.pipeline.stages))


def build_stage_module(cfg: RunConfig, stage: int, partition: Partition = None) -> nn.Sequential:
    """Stage ``stage``'s blocks, chunk after chunk (see :func:`chunk_slices`)."""
    torch.manual_seed(cfg.train.seed)
    blocks, names = build(cfg.model)
    return nn.Sequential(*[blocks[i] for a, b in _held(cfg, partition, len(blocks))[stage]
                           for i in range(a, b)])


def chunk_slices(cfg: RunConfig, stage: int, partition: Partition = None, blocks: int = 0) -> list[slice]:
    """Where each of stage ``stage``'s chunks lies in its module (:func:`build_stage_module`)
    (``blocks``: the model's, where known)."""
    sizes = [b - a for a, b in _held(cfg, partition, blocks or count_blocks(cfg.model))[stage]]
    return [slice(end - n, end) for n, end in zip(sizes, itertools.accumulate(sizes))]


def build_whole(model_cfg: ModelSection) -> tuple[nn.Module, list[nn.Module], list[str]]:
    """The model as one module, whose state dict is the model's under the names its own code
    gives it, and its blocks, which share that module's parameters (what ``sdpipe export``
    writes): the transformers model (``GPT2LMHeadModel``, ``BertForMaskedLM``), the ResNet with
    torchvision's names, the module a user's builder returned (an ``nn.Sequential``, or the
    module whose ``pipeline_blocks()`` gave the blocks, if it holds every block's tensors); for a
    list of blocks, and the byte-level models, an ``nn.Sequential`` of the blocks (keyed by
    index, or by block name).
    Initialised from the caller's torch RNG; :class:`ConfigError` as :func:`build`."""
    from collections import OrderedDict

    arch = model_cfg.arch
    if arch in HF_ARCHS:
        from sdpipe_cli.model import hf

        try:
            whole = hf.build_model(arch, hf_overrides(model_cfg), model_cfg.pretrained,
                                   bool(model_cfg.tie_embeddings))
        except (ImportError, ValueError) as err:
            raise ConfigError(*_split_key(str(err), "model.arch")) from None
        blocks, names = hf.split_blocks(whole)
    elif arch in RESNET_BLOCKS:
        from sdpipe_cli.model import resnet

        whole = resnet.build(arch, num_classes=int(cast(int, model_cfg.num_classes)))
        blocks, names = whole.blocks()
    else:
        made, (blocks, names) = None, ([], [])
        if arch == "custom":
            made, blocks, names = _custom_parts(model_cfg)
        else:
            blocks, names = BUILDERS[arch](model_cfg)
        if isinstance(made, nn.Module) and _holds(made, blocks):
            whole = made
        elif arch == "custom":
            whole = nn.Sequential(*blocks)
        else:
            whole = nn.Sequential(OrderedDict(zip(names, blocks)))
    if not model_cfg.tie_embeddings:
        _untie(blocks)
    return whole, blocks, names


def _holds(module: nn.Module, blocks: Sequence[nn.Module]) -> bool:
    """Every parameter and buffer of the blocks is ``module``'s (it may hold more: tensors no
    block uses keep the values it was built with)."""
    def ids(tensors):
        return {id(t) for t in tensors}

    inside = ids(module.parameters()) | ids(module.buffers())
    held = set().union(*(ids(b.parameters()) | ids(b.buffers()) for b in blocks))
    return held <= inside


@functools.lru_cache(maxsize=8)
def _meta_blocks(model_json: str) -> Blocks:
    with torch.device("meta"), ShapesOnly():
        try:  # the JSON of a model section (meta_blocks): a mapping
            return build(cast(DictConfig, OmegaConf.create(json.loads(model_json))))
        except RuntimeError as err:  # sizes past what a tensor can hold, even on the meta device
            raise ConfigError("model", f"cannot be built at these sizes: {_text(err)}") from None


def meta_blocks(model_cfg: Any) -> Blocks:
    """The blocks built on the meta device (no memory, no initialisation cost); cached by the
    section's values (the record's or the settings')."""
    return _meta_blocks(json.dumps(plain(model_cfg), sort_keys=True, default=str))


def count_blocks(model_cfg: ModelSection) -> int:
    return len(meta_blocks(model_cfg)[0])


def block_names(model_cfg: ModelSection) -> list[str]:
    return list(meta_blocks(model_cfg)[1])


def block_param_counts(model_cfg: ModelSection) -> list[int]:
    """Parameters per block, for balancing stages (a tied weight counts in each block)."""
    return [sum(p.numel() for p in block.parameters()) for block in meta_blocks(model_cfg)[0]]


# -- stage boundaries --------------------------------------------------------------------------------

def boundaries(cfg: RunConfig, example: Any) -> list[Boundary]:
    """The layout after each block but the last, for an example micro-batch input (of the real
    shapes and dtypes), by a forward on the meta device; a model that reads values on the way
    (``.item()`` has no meta version) runs once for real, on the CPU, without touching the RNG
    (on zeros of the example's shapes, if it was given on the meta device). ConfigError if a
    block fails on what the block before it returns."""
    try:
        return _trace(*meta_blocks(cfg.model), map_tensors(
            lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), example))
    except ConfigError:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(cfg.train.seed))
            blocks, names = build(cfg.model)
            for block in blocks:
                block.eval()
            return _trace(blocks, names, map_tensors(
                lambda t: torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t, example))


def _trace(blocks: Sequence[nn.Module], names: Sequence[str], value: Any) -> list[Boundary]:
    out: list[Boundary] = []
    with torch.no_grad():
        for i, (block, name) in enumerate(zip(blocks, names)):
            try:
                value = block(value)
            except Exception as err:  # any error of user code: name the block
                got = "the input" if i == 0 else f"{names[i - 1]}'s output {out[-1]}"
                text = " ".join(str(err).split())[:300]
                raise ConfigError("model", f"block {i} ({name}) fails on {got}: "
                                  f"{type(err).__name__}: {text}") from None
            if i < len(blocks) - 1:
                try:
                    out.append(Boundary.of(value, f"block {i} ({name})'s output"))
                except TypeError as err:
                    raise ConfigError("model", str(err)) from None
    return out


def activation_bytes(cfg: RunConfig, example: Any) -> int:
    """Bytes of the largest message between two stages (the simulator's and the profile's
    activation size): a pipeline is as slow as its slowest link."""
    return max((b.nbytes for b in boundaries(cfg, example)), default=0)


def layout(cfg: RunConfig, example: Any, microbatch_size: int) -> ModelLayout:
    """The model's :class:`ModelLayout` for micro-batches of ``microbatch_size`` samples, like
    ``example`` (the plan carries the launcher's to the workers: :mod:`~sdpipe_cli.model.layout`)."""
    return ModelLayout(microbatch_size, tuple(boundaries(cfg, example)),
                       tuple(tied_parameters(meta_blocks(cfg.model)[0])))


# -- tied parameters -----------------------------------------------------------------------------

def tied_parameters(blocks: Sequence[nn.Module]) -> list[tuple[tuple[int, str], ...]]:
    """For each parameter held by more than one block, where it is: ``((block, name), ...)``."""
    where: dict[int, list[tuple[int, str]]] = {}
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters(remove_duplicate=False):
            places = where.setdefault(id(p), [])
            if all(b != i for b, _ in places):
                places.append((i, name))
    return [tuple(places) for places in where.values() if len(places) > 1]


def _untie(blocks: Sequence[nn.Module]) -> None:
    """Give every block but the first its own copy of each shared parameter."""
    for places in tied_parameters(blocks):
        for b, name in places[1:]:
            owner, _, attr = name.rpartition(".")
            module = blocks[b].get_submodule(owner) if owner else blocks[b]
            setattr(module, attr, nn.Parameter(getattr(module, attr).detach().clone()))


# -- loss ------------------------------------------------------------------------------------------

def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the last dimension of ``output`` (language models and classifiers
    alike); targets of -100 take no part."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def loss_function(model_cfg: ModelSection) -> Callable[[Any, Any], torch.Tensor]:
    """``model.loss``: ``cross_entropy``, or a node whose ``_target_`` is a function (called with
    its other keys as keyword arguments) or a loss class (instantiated with them)."""
    loss = model_cfg.loss
    if loss == "cross_entropy":
        return cross_entropy
    node = plain(loss)
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError("model.loss", f"is {loss!r}; use cross_entropy or a node with _target_")
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    fn = import_callable(loss.get("_target_"), "model.loss._target_")
    if isinstance(fn, type):
        try:
            return fn(**kwargs)
        except Exception as err:  # the user's class: its failure is their input's
            raise ConfigError("model.loss", f"{loss.get('_target_')}({', '.join(kwargs)}) failed: "
                              f"{type(err).__name__}: {' '.join(str(err).split())[:200]}") from None
    return functools.partial(fn, **kwargs) if kwargs else fn


def _split_key(message: str, default: str) -> tuple[str, str]:
    key, sep, reason = message.partition(": ")
    return (key, reason) if sep and key.startswith("model.") else (default, message)


def stage_ties(cfg: RunConfig, stage: int, partition: Partition = None,
               known: ModelLayout | None = None) -> list[tuple[tuple[int, ...], str]]:
    """The shared parameters that stage ``stage`` holds a copy of while other stages hold
    theirs (:func:`~sdpipe_cli.model.layout.stage_ties`), from the ``known`` layout or the model
    built on the meta device."""
    blocks, tied = (known.blocks, known.ties) if known else (
        count_blocks(cfg.model), tuple(tied_parameters(meta_blocks(cfg.model)[0])))
    return layout_ties(tied, _held(cfg, partition, blocks), stage)


def check(cfg: RunConfig, known: ModelLayout | None = None) -> ModelLayout:
    """What only building the model shows, before any process starts: each block takes what the
    one before it returns, its tied weights are possible here, the loss can be had (ConfigError).
    Returns the layout it found (or was given, ``known``, checking another split of the same
    model), which the run's plan carries to the workers."""
    from sdpipe_cli.config.schema import ASYNC_SCHEDULES
    from sdpipe_cli.core.plan import microbatch_size
    from sdpipe_cli.data import sources

    p = cfg.pipeline
    size = microbatch_size(cfg)
    example = sources.example(cfg, size, device="meta")[0]
    found = known if known is not None and known.microbatch_size == size else layout(cfg, example, size)
    after = found.outputs
    names = block_names(cfg.model)
    for cut in p.partition:  # what a stage sends must carry a gradient back
        if not after[cut - 1].differentiable():
            raise ConfigError("pipeline.partition", f"the stages meet after block {cut - 1} "
                              f"({names[cut - 1]}), whose output {after[cut - 1]} has no floating-"
                              "point tensor to carry a gradient back; cut elsewhere")
    asynchronous = p.schedule in ASYNC_SCHEDULES
    if asynchronous and any(stage_ties(cfg, s, known=found) for s in range(p.stages)):
        raise ConfigError("model.tie_embeddings", "tied weights on different stages need a flushed "
                          "schedule (their copies are summed once per iteration); use "
                          "pipeline.schedule=1f1b or model.tie_embeddings=false")
    if asynchronous and cfg.train.precision == "fp16":
        raise ConfigError("train.precision", "fp16's skip-or-step decision needs a flushed "
                          "schedule; use bf16 with async_1f1b")
    check_dtypes(cfg, example, after)
    loss_function(cfg.model)  # a loss that does not import or build: here, not in every worker
    return found


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # train.precision's compute dtypes


def check_dtypes(cfg: RunConfig, example: Any, after: Sequence[Boundary]) -> None:
    """Each block with weights gets floating tensors it can take: the meta device does not check
    dtypes (a float64 activation into a float32 Linear runs there and fails in a worker). What a
    block gets is what the block before it returns, or at a stage's start under
    ``train.precision=bf16|fp16`` the low precision it crosses in. A floating dtype other than
    the block's weights' (under autocast: float64 on either side) is tried for real on that block
    alone, on zeros; ConfigError if it fails there, naming the blocks and the dtypes."""
    blocks, names = meta_blocks(cfg.model)
    low = AUTOCAST.get(str(cfg.train.precision))
    cuts = set(int(c) for c in cfg.pipeline.partition)
    inputs = [Boundary.of(example, "the input"), *after]
    for j, block in enumerate(blocks):
        weights = _weights_dtype(block)
        traced = inputs[j]
        got = traced.with_floats(low) if low is not None and j in cuts else traced
        odd = next((s.dtype for s in got.specs if s.dtype.is_floating_point and weights is not None
                    and s.dtype != weights and (low is None or torch.float64 in (s.dtype, weights))),
                   None)
        if odd is None:
            continue
        failure = _try_block(block, got, low)
        if failure is None:
            continue
        if j == 0:
            what = f"the data's input is {odd}"
        elif got is not traced and odd == low:
            what = (f"block {j - 1} ({names[j - 1]}) ends a stage and its output crosses to the next "
                    f"as {odd} (train.precision={cfg.train.precision})")
        else:
            what = f"block {j - 1} ({names[j - 1]}) returns {odd}"
        raise ConfigError("model._target_" if cfg.model.arch == "custom" else "model",
                          f"{what}, but block {j} ({names[j]})'s weights are {weights} and it fails on "
                          f"that: {_text(failure)[:200]}; cast what reaches it to its weights' dtype "
                          f"(x.to({weights}))")


def _weights_dtype(block: nn.Module) -> torch.dtype | None:
    """The floating dtype of all of ``block``'s parameters (None: none, or several)."""
    kinds = {p.dtype for p in block.parameters() if p.dtype.is_floating_point}
    return kinds.pop() if len(kinds) == 1 else None


def _try_block(block: nn.Module, layout: Boundary, low: torch.dtype | None) -> Exception | None:
    """What ``block`` (on the meta device) raises on zeros of ``layout``, run for real on the CPU
    by a copy with zeroed weights (under autocast to ``low``, if given); None if it runs."""
    import contextlib
    import copy

    try:
        real = copy.deepcopy(block).to_empty(device="cpu").eval()
    except Exception:  # cannot be tried alone: leave it to the run
        return None
    value = layout.unflatten([torch.zeros(s.shape, dtype=s.dtype) for s in layout.specs])
    cast = torch.autocast("cpu", dtype=low) if low is not None else contextlib.nullcontext()
    try:
        with torch.no_grad(), cast:
            for t in [*real.parameters(), *real.buffers()]:
                t.zero_()
            real(value)
    except Exception as err:  # the user's code fails on that dtype
        return err
    return None

