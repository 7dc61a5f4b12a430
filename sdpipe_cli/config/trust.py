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
it. A resume then runs a saved config's code only if the seal is this user's and matches, or
the user says so (``--trust-code``). A saved config that names no code (every built-in model and
data set) needs no seal: a checkpoint's tensors are loaded with ``weights_only=True`` and never
run.

A seal is worth the key's secrecy, so a key file someone else could read or write, or that is
no plain file of this user's holding a key, is refused wherever it is needed. A launch whose
config names code stops at the start when no usable key can be had, rather than write a run
that its own user's resume would refuse.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sdpipe_cli.config.schema import ConfigError

__all__ = ["KEY_ENV", "check", "code_named", "interpolations", "key_path", "seal"]

KEY_ENV = "SDPIPE_TRUST_KEY"
_KEY_BYTES = 32
_MAX_KEY_BYTES = 4096  # a key, not a file read whole into memory


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


def _read_key(path: Path) -> bytes | None:
    """The key at ``path``, or None when there is none. A seal is worth the key's secrecy: whoever
    can read the key can seal code of their own for this user to run, and whoever can write it can
    swap in one they know. So a file there that anyone else may read or write, that is not a plain
    file of this user's, or that holds too few bytes to be a key, is refused
    (:class:`ConfigError` naming it), never taken."""
    try:  # O_NONBLOCK: a named pipe there must not hang the launch (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):  # none there (and maybe no folder for one)
        return None
    except OSError as err:
        raise _unusable(path, f"cannot be read: {err.strerror or err}") from None
    try:
        _check_file(path, os.fstat(fd))
        key = os.read(fd, _MAX_KEY_BYTES + 1)
    except OSError as err:
        raise _unusable(path, f"cannot be read: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(key) < _KEY_BYTES:
        raise _unusable(path, f"holds {len(key)} bytes, too few for a key (at least {_KEY_BYTES}; "
                        f"sdpipe makes one of {_KEY_BYTES} random bytes); {_remedy(path, 'remove it')}")
    if len(key) > _MAX_KEY_BYTES:
        raise _unusable(path, f"holds more than {_MAX_KEY_BYTES} bytes, too many for a key; "
                        f"{_remedy(path, 'remove it')}")
    return key


def _check_file(path: Path, info: os.stat_result) -> None:
    """Refuse a key file others could read or change, or that is no plain file of this user's."""
    if stat.S_ISDIR(info.st_mode):
        raise _unusable(path, f"is a folder, not a key file; {_remedy(path, 'remove it')}")
    if not stat.S_ISREG(info.st_mode):
        raise _unusable(path, f"is not a regular file; {_remedy(path, 'remove it')}")
    if info.st_uid != os.geteuid():
        raise _unusable(path, f"belongs to another user (uid {info.st_uid}), who can change it: "
                        f"a key must be yours alone; {_remedy(path, 'remove it')}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        how = [what for what, bits in (("read", 0o044), ("written", 0o022), ("executed", 0o011))
               if mode & bits]
        said = " and ".join([", ".join(how[:-1]), how[-1]] if len(how) > 1 else how)
        raise _unusable(path, f"can be {said} by others (mode {mode:04o}): a key must be yours "
                        f"alone; {_remedy(path, f'chmod 600 {path} if it is a secret of yours')}")


def _remedy(path: Path, fix: str) -> str:
    """What to do about an unusable key: ``fix`` it, or have sdpipe make a new one elsewhere."""
    if os.environ.get(KEY_ENV):
        return f"{fix}, or point {KEY_ENV} at a file of yours (sdpipe makes it if it is not there)"
    return f"{fix} (sdpipe then makes a new one)"


def _unusable(path: Path, reason: str) -> ConfigError:
    return ConfigError(str(path), f"the key that seals the code a config names {reason} "
                       "(docs/SECURITY.md)")


def _own_key(path: Path) -> bytes:
    """The key at ``path``, made (atomically, readable by this user only, in a folder of this
    user's only) if there is none; :class:`ConfigError` naming it if it can be neither read nor
    made: a run of code that nothing sealed could only be resumed with ``--trust-code``, so it
    does not start."""
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
    except OSError as err:
        raise _unusable(path, f"cannot be made: {err.strerror or err}; point {KEY_ENV} at a file "
                        "in a folder of yours you can write") from None
    key = _read_key(path)
    if key is None:  # removed between its making and its reading
        raise _unusable(path, "vanished as it was made; run again")
    return key


def _digest(named: Mapping[str, Any], key: bytes) -> str:
    text = json.dumps(named, sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


def seal(cfg: Mapping[str, Any]) -> str | None:
    """The seal of the code ``cfg`` names, under this user's key (made if needed); None when it
    names none (no key is needed then, nor read). :class:`ConfigError` naming the key's file when
    no usable key can be had: a launch never writes code unsealed."""
    named = code_named(cfg)
    if not named:
        return None
    return _digest(named, _own_key(key_path()))


def interpolations(node: Any, path: str = "") -> str | None:
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
    user ``trusted`` it. A config that names no code passes. A key others could read or write
    is refused naming its file: anyone who read it could have sealed the config."""
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
