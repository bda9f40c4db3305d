import os
import re
from pathlib import Path

from service.contract.config import ENV_PREFIX, UNPREFIXED_ENV_NAMES, Settings, env_name

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_second():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2
    assert first_block[0].endswith("blockserve serve")
    ci_script = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert first_block[1] in ci_script


SETTING_ROW = re.compile(r"^\| `([A-Z0-9_]+)` \| ([^|]+) \|", re.M)  # | `VARIABLE` | default | meaning |


def test_readme_documents_every_setting_with_its_default(monkeypatch):
    """Each setting has a row in the README's table whose default, read as its variable, is the settings' own:
    `(unset)` for an empty or absent one."""
    rows = {name: default.strip() for name, default in SETTING_ROW.findall(README)}
    for variable in [name for name in os.environ if name.upper().startswith(ENV_PREFIX)] + list(
        UNPREFIXED_ENV_NAMES.values()
    ):
        monkeypatch.delenv(variable, raising=False)
    for field_name, field in Settings.model_fields.items():
        variable = env_name(field_name)
        assert variable in rows, f"{variable} has no row in README.md's settings table"
        default = field.get_default(call_default_factory=True)
        if rows[variable] == "(unset)":
            assert default in (None, ""), f"README.md says {variable} is unset by default; it is {default!r}"
            continue
        with monkeypatch.context() as env:
            env.setenv(variable, rows[variable].strip("`"))
            documented = getattr(Settings(), field_name)
        assert documented == default, f"README.md gives {variable} the default {rows[variable]}; it is {default!r}"
