import re
from pathlib import Path

from service.contract.config import Settings, env_name

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_second():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    assert len(first_block) == 2
    assert first_block[0].endswith("blockserve serve")
    ci_script = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert first_block[1] in ci_script


def test_readme_documents_every_setting():
    for field in Settings.model_fields:
        assert f"`{env_name(field)}`" in README, f"{env_name(field)} is not in README.md"
