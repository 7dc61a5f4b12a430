"""The code a saved config names runs only under this user's seal (sdpipe_cli.config.trust)."""

from __future__ import annotations

import copy
import os
import signal
import stat

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.config import trust
from sdpipe_cli.config.schema import ConfigError

BUILT_IN = {"model": {"name": "mlp", "arch": "mlp", "_target_": None, "kwargs": {},
                      "loss": "cross_entropy"},
            "data": {"name": "synthetic", "_target_": None, "kwargs": {}}, "run": {}}
CUSTOM = {"model": {"name": "custom", "arch": "custom", "_target_": "mynets.build",
                    "kwargs": {"width": 64}, "loss": {"_target_": "mylosses.focal", "gamma": 2}},
          "data": {"name": "custom", "_target_": "mydata.build", "kwargs": {"n": 10}}, "run": {}}


@pytest.fixture
def key(tmp_path, monkeypatch):
    path = tmp_path / "conf" / "sdpipe" / "trust.key"
    monkeypatch.setenv(trust.KEY_ENV, str(path))
    return path


def sealed(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg["run"]["code_seal"] = trust.seal(cfg)
    return cfg


def test_a_config_of_built_ins_names_no_code_and_needs_no_seal(key):
    assert trust.code_named(BUILT_IN) == {}
    assert trust.seal(BUILT_IN) is None and not key.exists()  # no key made for nothing
    trust.check(BUILT_IN, "manifest.json")


def test_every_key_that_names_code_is_named_with_its_arguments():
    assert trust.code_named(CUSTOM) == {
        "model._target_": "mynets.build", "model.kwargs": {"width": 64},
        "model.loss": {"_target_": "mylosses.focal", "gamma": 2},
        "data._target_": "mydata.build", "data.kwargs": {"n": 10}}
    # a _target_ on a built-in model is still code it would be asked to import
    assert "model._target_" in trust.code_named({"model": {"arch": "mlp", "_target_": "os.mkdir"}})


def test_the_key_is_made_once_readable_by_its_owner_only(key):
    first = sealed(CUSTOM)["run"]["code_seal"]
    assert key.is_file() and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert sealed(CUSTOM)["run"]["code_seal"] == first  # the same key: the same seal


def test_a_sealed_config_passes_and_a_doctored_one_is_refused_naming_its_key(key):
    good = sealed(CUSTOM)
    trust.check(good, "m.json")
    bad = copy.deepcopy(good)
    bad["model"]["_target_"] = "os.mkdir"
    with pytest.raises(ConfigError) as refused:
        trust.check(bad, "m.json")
    assert refused.value.key == "model._target_" and "m.json" in str(refused.value)
    assert "--trust-code" in str(refused.value)
    trust.check(bad, "m.json", trusted=True)  # the user said so


def test_a_seal_made_with_another_key_or_none_at_all_is_refused(key, tmp_path, monkeypatch):
    theirs = sealed(CUSTOM)
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "mine.key"))
    with pytest.raises(ConfigError):
        trust.check(theirs, "m.json")  # no key of mine yet
    trust.seal(BUILT_IN | {"model": CUSTOM["model"]})  # makes my key
    with pytest.raises(ConfigError):
        trust.check(theirs, "m.json")
    unsealed = copy.deepcopy(CUSTOM)
    with pytest.raises(ConfigError):
        trust.check(unsealed, "m.json")


def refused_naming(path, *calls) -> list[str]:
    """Each call refused with one ConfigError naming the key's file; their reasons."""
    reasons = []
    for call in calls:
        with pytest.raises(ConfigError) as refused:
            call()
        assert refused.value.key == str(path) and "\n" not in str(refused.value)
        reasons.append(refused.value.reason)
    return reasons


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660], ids=oct)
def test_a_key_others_can_read_or_write_is_refused_sealing_and_checking(key, mode):
    """Whoever can read the key can seal a manifest naming code of theirs for this user to run:
    a seal made with it, even a matching one, is no longer this user's word."""
    good = sealed(CUSTOM)
    key.chmod(mode)
    reasons = refused_naming(key, lambda: trust.seal(CUSTOM), lambda: trust.check(good, "m.json"))
    assert all(f"(mode {mode:04o})" in r and f"chmod 600 {key}" in r for r in reasons), reasons
    trust.check(good, "m.json", trusted=True)  # --trust-code needs no key
    key.chmod(0o600)
    trust.check(good, "m.json")  # the owner's own again


@pytest.mark.parametrize("make, says", [
    (lambda path: path.write_bytes(b""), "holds 0 bytes, too few for a key"),
    (lambda path: path.write_bytes(b"k" * 31), "holds 31 bytes, too few for a key"),
    (lambda path: path.write_bytes(b"k" * 5000), "too many for a key"),
    (lambda path: path.mkdir(), "is a folder"),
    (lambda path: os.mkfifo(path, 0o600), "is not a regular file"),  # and no reader waits on it
])
def test_a_file_that_is_no_key_is_refused_naming_it(tmp_path, monkeypatch, make, says):
    path = tmp_path / "trust.key"
    monkeypatch.setenv(trust.KEY_ENV, str(path))
    make(path)
    if path.is_file():
        path.chmod(0o600)
    unsealed = copy.deepcopy(CUSTOM)
    unsealed["run"]["code_seal"] = "0" * 64
    previous = signal.signal(signal.SIGALRM, _waited_on)
    signal.setitimer(signal.ITIMER_REAL, 10)  # a reader blocked on the FIFO fails, not hangs
    try:
        reasons = refused_naming(path, lambda: trust.seal(CUSTOM), lambda: trust.check(unsealed, "m"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert all(says in r for r in reasons), reasons


def _waited_on(signum, frame):
    raise AssertionError("reading the key blocked")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_key_of_another_user_is_refused(key):
    sealed(CUSTOM)
    os.chown(key, 65534, 65534)  # nobody's: mode 0600, but they can change it
    assert "belongs to another user" in refused_naming(key, lambda: trust.seal(CUSTOM))[0]


@pytest.mark.parametrize("where", ["env", "xdg"])
def test_a_key_that_cannot_be_made_is_refused_not_left_unsealed(tmp_path, monkeypatch, where):
    """Sealing nothing would start a run that its own user could resume only with --trust-code."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    if where == "env":
        monkeypatch.setenv(trust.KEY_ENV, str(blocker / "trust.key"))
    else:
        monkeypatch.delenv(trust.KEY_ENV, raising=False)
        monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))
    path = blocker / "trust.key" if where == "env" else blocker / "sdpipe" / "trust.key"
    assert "cannot be made" in refused_naming(path, lambda: trust.seal(CUSTOM))[0]


def test_a_config_of_built_ins_needs_no_key_and_a_bad_one_does_not_stop_it(tmp_path, monkeypatch):
    path = tmp_path / "trust.key"
    path.write_bytes(b"")
    path.chmod(0o666)
    monkeypatch.setenv(trust.KEY_ENV, str(path))
    assert trust.seal(BUILT_IN) is None
    trust.check(BUILT_IN, "m.json")


def test_the_default_key_lives_in_the_users_config_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert trust.key_path() == tmp_path / "sdpipe" / "trust.key"


_values = st.one_of(st.none(), st.integers(), st.text(max_size=8),
                    st.lists(st.integers(), max_size=3))


@settings(max_examples=60, deadline=None)
@given(where=st.sampled_from(["model._target_", "model.kwargs", "model.loss", "data._target_",
                              "data.kwargs"]),
       value=st.one_of(st.text(min_size=1, max_size=12), st.dictionaries(
           st.text(min_size=1, max_size=4), _values, min_size=1, max_size=3)))
def test_any_change_to_the_code_or_its_arguments_breaks_the_seal(where, value, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(trust.KEY_ENV, str(tmp_path_factory.getbasetemp() / "property.key"))
        good = sealed(CUSTOM)
        section, name = where.split(".")
        changed = copy.deepcopy(good)
        changed[section][name] = value
        if trust.code_named(changed) == trust.code_named(good):
            return  # the same code, the same arguments
        with pytest.raises(ConfigError):
            trust.check(changed, "m.json")


def test_an_interpolation_in_a_saved_config_is_refused_before_it_can_resolve_into_code(key):
    """Runs save their config resolved; ``${oc.create:{_target_: ...}}`` in a manifest would pass
    a check of the raw values and become code when the config is resolved."""
    doctored = sealed(BUILT_IN)
    doctored["model"]["loss"] = "${oc.create:{_target_: os.mkdir, path: MARK}}"
    with pytest.raises(ConfigError) as refused:
        trust.check(doctored, "m.json", trusted=True)  # not even with --trust-code
    assert refused.value.key == "model.loss" and "interpolation" in str(refused.value)
    quiet = sealed(BUILT_IN)
    quiet["model"]["loss"] = "focal"  # not cross_entropy: a name that may become code
    with pytest.raises(ConfigError, match="model.loss"):
        trust.check(quiet, "m.json")
