"""Where a run's config may name code, and whether a saved config's code may run.

A config is data except for the few keys that name a callable sdpipe imports and calls: a user's
model (``model._target_`` with ``model.kwargs``), loss (``model.loss`` as a node with
``_target_``) and data set (``data._target_`` with ``data.kwargs``). On the command line these
are the user's own words. In a checkpoint's ``manifest.json`` or a run folder's ``config.yaml``
they are whatever the file says, and a file can come from anywhere: a run copied from a shared
disk, a download, a folder someone else can write to. ``sdpipe resume`` reads its config from
such a file, so it must not call what the file names on the file's word alone.

The launcher therefore seals, at every launch, the code its config names: an HMAC-SHA256 of
those keys' values under a secret key of this user's (``run.code_seal``), kept outside every run
folder in ``$SDPIPE_TRUST_KEY`` or ``~/.config/sdpipe/trust.key`` (made on first use, mode 0600).
A plain checksum beside the config would not do: whoever can change the config can recompute
it. A resume then runs a saved config's code only if the seal is this user's and matches, or the
user says so (``--trust-code``). A saved config that names no code (every built-in model and data
set) needs no seal: a checkpoint's tensors are loaded with ``weights_only=True`` and never run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

from sdpipe_cli.config.schema import ConfigError

__all__ = ["KEY_ENV", "check", "code_named", "interpolations", "key_path", "seal"]

KEY_ENV = "SDPIPE_TRUST_KEY"
_KEY_BYTES = 32


def code_named(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``cfg`` (a plain mapping: a saved config, or ``OmegaConf.to_container`` of one)
    that name code sdpipe would call, with the arguments it would pass; empty when the config
    names only sdpipe's own models, losses and data sets."""
    model, data = _section(cfg, "model"), _section(cfg, "data")
    named: dict[str, Any] = {}
    if model.get("_target_") is not None:
        named["model._target_"] = model.get("_target_")
        named["model.kwargs"] = model.get("kwargs")
    loss = model.get("loss")
    if loss is not None and loss != "cross_entropy":  # a node, or anything that may become one
        named["model.loss"] = dict(loss) if isinstance(loss, Mapping) else loss
    hf = model.get("hf")
    attention = hf.get("attn_implementation") if isinstance(hf, Mapping) else None
    if attention not in (None, "eager", "sdpa"):  # transformers may fetch and load kernels by it
        named["model.hf.attn_implementation"] = attention
    if data.get("_target_") is not None:
        named["data._target_"] = data.get("_target_")
        named["data.kwargs"] = data.get("kwargs")
    return named


def _section(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = cfg.get(name) if isinstance(cfg, Mapping) else None
    return section if isinstance(section, Mapping) else {}


def key_path() -> Path:
    """This user's sealing key: ``$SDPIPE_TRUST_KEY``, else ``$XDG_CONFIG_HOME/sdpipe/trust.key``
    (``~/.config`` when unset). On a cluster whose nodes share no home folder, point
    ``SDPIPE_TRUST_KEY`` at one file every node can read."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path("~/.config").expanduser())
    return Path(base) / "sdpipe" / "trust.key"


def _read_key(path: Path) -> Optional[bytes]:
    try:
        key = path.read_bytes()
    except OSError:
        return None
    return key if len(key) >= _KEY_BYTES else None


def _own_key(path: Path) -> Optional[bytes]:
    """The key at ``path``, made (atomically, readable by this user only) if there is none;
    None if it can be neither read nor made (a read-only home: nothing is sealed, and a resume
    of that run's code then needs ``--trust-code``)."""
    key = _read_key(path)
    if key is not None:
        return key
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trust-")  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:  # whole or not at all: another launcher never reads a key half-written
            os.link(tmp, path)
        except FileExistsError:  # another launcher made it a moment ago: take theirs
            pass
        finally:
            os.unlink(tmp)
    except OSError:
        return None
    return _read_key(path)


def _digest(named: Mapping[str, Any], key: bytes) -> str:
    text = json.dumps(named, sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


def seal(cfg: Mapping[str, Any]) -> Optional[str]:
    """The seal of the code ``cfg`` names, under this user's key (made if needed); None when it
    names none, or no key can be had."""
    named = code_named(cfg)
    if not named:
        return None
    key = _own_key(key_path())
    return None if key is None else _digest(named, key)


def interpolations(node: Any, path: str = "") -> Optional[str]:
    """The first key of a saved config whose value holds an OmegaConf interpolation (``${...}``),
    or None. Runs save their config resolved, so one there was written by hand, and resolving
    it could turn a plain value into code (``${oc.create:{_target_: ...}}``) after the check."""
    if isinstance(node, str):
        return path or "config" if "${" in node else None
    items = (node.items() if isinstance(node, Mapping) else
             enumerate(node) if isinstance(node, list) else ())
    for key, value in items:
        found = interpolations(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def check(cfg: Mapping[str, Any], where: str, trusted: bool = False) -> None:
    """Refuse (a :class:`ConfigError` naming the first key that names code) a saved config,
    read from ``where``, whose code no launch of this user's sealed as it stands, unless the
    user ``trusted`` it. A config that names no code passes."""
    found = interpolations(cfg)
    if found is not None:
        raise ConfigError(found, f"{where} holds an interpolation (${{...}}) there: a run saves its "
                          "config resolved, so this one was changed by hand; nothing was run")
    named = code_named(cfg)
    if not named or trusted:
        return
    run = _section(cfg, "run")
    found = run.get("code_seal")
    key = _read_key(key_path())
    if (isinstance(found, str) and key is not None
            and hmac.compare_digest(found, _digest(named, key))):
        return
    first = next(iter(named))
    raise ConfigError(first, f"{where} names code to run ({json.dumps(named[first])[:80]}) that no "
                      f"run of yours sealed: it comes from elsewhere or was changed since. Nothing "
                      f"was run; if you trust it, pass --trust-code (docs/SECURITY.md)")
