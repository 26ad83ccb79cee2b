"""The package runs on the oldest Python that setup.cfg declares: `vermin` reads every module for the language
features and standard-library members it uses, and the newest Python any of them needs must not be newer.
(`hashlib.file_digest`, 3.11+, once made every checkpoint write fail on 3.10.)"""

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared_minimum() -> str:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    match = re.fullmatch(r">=\s*(3\.\d+)", parser["options"]["python_requires"].strip())
    assert match, f"python_requires={parser['options']['python_requires']!r}: expected '>=3.N'"
    return match.group(1)


def vermin(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    assert exe, "vermin is not installed (requirements-cpu.txt pins it)"
    # `long`: vermin takes torch.long for Python 2's builtin
    return subprocess.run([exe, "--no-tips", "--violations", "--exclude", "long", *args], capture_output=True,
                          text=True, timeout=300)


def test_no_module_needs_a_newer_python_than_setup_cfg_declares():
    minimum = declared_minimum()
    result = vermin(f"-t={minimum}-", str(ROOT / "dllm_rl"), str(ROOT / "scripts"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_catches_a_newer_member(tmp_path):
    (tmp_path / "new.py").write_text("import hashlib\n\ndef digest(f):\n    return hashlib.file_digest(f, 'sha256')\n")
    result = vermin("-t=3.10-", str(tmp_path))
    assert result.returncode != 0 and "hashlib.file_digest" in result.stdout
