import os
import re
from pathlib import Path

from service.contract.config import ENV_PREFIX, OTHER_VARIABLES, UNPREFIXED_ENV_NAMES, Settings, env_name

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_second():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2
    assert first_block[0].endswith("blockserve serve")
    ci_script = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert first_block[1] in ci_script


SETTING_ROW = re.compile(r"^\| `([A-Z0-9_]+)` \| ([^|]+) \|", re.M)  # | `VARIABLE` | default | meaning |


def test_readme_documents_every_setting_with_its_default(monkeypatch):
    """Each setting has a row in the README's tables, and each row's default, read as its variable, is the
    settings' own: `(unset)` for an empty or absent one."""
    rows = [(variable, default.strip()) for variable, default in SETTING_ROW.findall(README)]
    field_of = {env_name(field_name): field_name for field_name in Settings.model_fields}
    missing = set(field_of) - {variable for variable, _ in rows}
    assert not missing, f"no row in README.md's settings tables for {sorted(missing)}"
    for variable in [name for name in os.environ if name.upper().startswith(ENV_PREFIX)] + list(
        UNPREFIXED_ENV_NAMES.values()
    ):
        monkeypatch.delenv(variable, raising=False)
    for variable, documented in rows:
        if variable not in field_of:
            assert variable in OTHER_VARIABLES, f"README.md has a row for {variable}, which names no setting"
            continue
        default = Settings.model_fields[field_of[variable]].get_default(call_default_factory=True)
        if documented == "(unset)":
            assert default in (None, ""), f"README.md says {variable} is unset by default; it is {default!r}"
            continue
        with monkeypatch.context() as env:
            env.setenv(variable, documented.strip("`"))
            read = getattr(Settings(), field_of[variable])
        assert read == default, f"README.md gives {variable} the default {documented}; it is {default!r}"
