"""A BLOCKSERVE_ variable or secrets-dir file that names no setting is named at start-up, with the closest setting;
BLOCKSERVE_STRICT_SETTINGS refuses it."""

from __future__ import annotations

import logging
import os

import pytest

from service.contract.config import (
    OTHER_VARIABLES,
    Settings,
    SettingsError,
    check_setting_names,
    env_name,
    load_settings,
    unknown_names,
)
from service.contract.configuration_exit import CONFIGURATION_ERROR_STATUS, TERMINATION_MESSAGE_VARIABLE
from service.launch import cli


@pytest.fixture
def environment(monkeypatch):
    """The test process's environment without any BLOCKSERVE_ variable; set more with monkeypatch."""
    for name in list(os.environ):
        if name.upper().startswith("BLOCKSERVE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_a_misspelt_variable_gets_one_warning_naming_it_and_the_closest_setting(environment, caplog):
    environment.setenv("BLOCKSERVE_MAX_NUM_SEQ", "4")
    environment.setenv("BLOCKSERVE_KV_CACHE_DTYPES", "fp8_e4m3")
    caplog.set_level(logging.WARNING)

    unknown = check_setting_names(load_settings())

    assert sorted(unknown) == ["BLOCKSERVE_KV_CACHE_DTYPES", "BLOCKSERVE_MAX_NUM_SEQ"]
    assert warnings_of(caplog) == [
        "BLOCKSERVE_KV_CACHE_DTYPES names no setting (the closest is BLOCKSERVE_KV_CACHE_DTYPE); ignored",
        "BLOCKSERVE_MAX_NUM_SEQ names no setting (the closest is BLOCKSERVE_MAX_NUM_SEQS); ignored",
    ]


def test_every_setting_and_every_variable_blockserve_reads_besides_is_known():
    environ = {env_name(field): "" for field in Settings.model_fields} | dict.fromkeys(OTHER_VARIABLES, "")
    environ["blockserve_max_num_seqs"] = "8"  # read ignoring case, as pydantic-settings reads it
    environ["BLOCKSERVE_KV_CACHE_RATIO"] = "0.5"  # the prefixed name of an unprefixed setting is read too
    environ["MAX_NUM_SEQ"] = "4"  # not ours: no prefix

    assert unknown_names(environ, secrets_dir="") == {}


def test_a_secrets_dir_file_that_names_no_setting_is_named_too(environment, tmp_path, caplog):
    (tmp_path / "BLOCKSERVE_MAX_NUM_SEQS").write_text("8")
    (tmp_path / "BLOCKSERVE_API_KEYZ").write_text("secret")
    (tmp_path / "..data").mkdir()  # how a Kubernetes Secret volume keeps its files: not a setting
    environment.setenv("BLOCKSERVE_SECRETS_DIR", str(tmp_path))
    caplog.set_level(logging.WARNING)

    settings = load_settings()

    assert settings.max_num_seqs == 8
    assert check_setting_names(settings) == ["BLOCKSERVE_API_KEYZ"]
    assert warnings_of(caplog) == [
        f"file {tmp_path / 'BLOCKSERVE_API_KEYZ'} names no setting (the closest is BLOCKSERVE_API_KEY); ignored"
    ]


def test_strict_settings_refuse_the_names_that_set_nothing(environment, caplog):
    environment.setenv("BLOCKSERVE_MAX_NUM_SEQ", "4")
    environment.setenv("BLOCKSERVE_STRICT_SETTINGS", "1")

    with pytest.raises(SettingsError, match=r"BLOCKSERVE_MAX_NUM_SEQ names no setting .*BLOCKSERVE_MAX_NUM_SEQS"):
        check_setting_names(load_settings())
    assert warnings_of(caplog) == []


def test_a_role_with_strict_settings_exits_with_one_line_and_the_configuration_status(environment, tmp_path, capsys):
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")  # there already, as Kubernetes' /dev/termination-log is
    environment.setenv(TERMINATION_MESSAGE_VARIABLE, str(termination_log))
    environment.setenv("BLOCKSERVE_STRICT_SETTINGS", "true")
    environment.setenv("BLOCKSERVE_MAX_NUM_SEQ", "4")

    assert cli.main(["scheduler"]) == CONFIGURATION_ERROR_STATUS

    line = (
        "blockserve scheduler: configuration error: BLOCKSERVE_MAX_NUM_SEQ names no setting (the closest is "
        "BLOCKSERVE_MAX_NUM_SEQS) (BLOCKSERVE_STRICT_SETTINGS=1: rename or remove them)"
    )
    assert capsys.readouterr().err.splitlines()[-1] == line
    assert termination_log.read_text() == line + "\n"


def test_an_invalid_setting_ends_a_role_the_same_way_and_no_termination_file_is_made(environment, tmp_path, capsys):
    absent = tmp_path / "termination-log"
    environment.setenv(TERMINATION_MESSAGE_VARIABLE, str(absent))
    environment.setenv("BLOCKSERVE_MAX_NUM_SEQS", "many")

    assert cli.main(["api"]) == CONFIGURATION_ERROR_STATUS

    assert capsys.readouterr().err.startswith("blockserve api: configuration error: invalid configuration: ")
    assert not absent.exists()  # outside a container nobody made it: not ours to create


def test_serve_with_strict_settings_refuses_before_it_starts_a_role(environment, capsys, monkeypatch):
    from service.launch import supervisor

    environment.setenv("BLOCKSERVE_STRICT_SETTINGS", "0")  # so that what the flag sets is undone after the test
    environment.setenv("BLOCKSERVE_MAX_NUM_SEQ", "4")
    monkeypatch.setattr(supervisor.Supervisor, "start", lambda self: pytest.fail("a role was started"))

    assert cli.main(["serve", "--strict-settings"]) == CONFIGURATION_ERROR_STATUS

    assert os.environ["BLOCKSERVE_STRICT_SETTINGS"] == "1"  # what the roles would inherit
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("blockserve serve: configuration error: BLOCKSERVE_MAX_NUM_SEQ names no setting")
    )
