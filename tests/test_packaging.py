"""tokenloom as a user gets it from a wheel, outside the checkout: the wheel holds every file
the CPU kernels are built from (a missing header makes an installed tokenloom fall back to
the slow torch paths without a word), and from a fresh virtual environment the kernels load
and a request is served.

The fresh environment borrows the heavy dependencies (torch, transformers, the packaged
SmolLM2) from the running interpreter's site-packages through a ``.pth`` file, leaving out
any tokenloom installed there, so the test stays offline and takes about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "tokenloom" / "kernels" / "csrc"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the source (the checkout stays untouched by the build)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "tokenloom", source / "tokenloom", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        timeout=600,
    )
    [built] = out.glob("tokenloom-*.whl")
    return built


def test_the_wheel_ships_every_kernel_source_and_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"tokenloom/kernels/csrc/{path.name}" for path in CSRC.iterdir() if path.is_file()}
    assert any(name.endswith(".h") for name in expected)  # the files a .cpp-only glob would miss
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"


def borrowed_site_packages(directory: Path) -> Path:
    """A directory of links to the running interpreter's installed packages, tokenloom's own
    (its editable finder, its metadata) left out so that only the wheel's tokenloom exists."""
    directory.mkdir()
    for site_dir in map(Path, site.getsitepackages()):
        for entry in site_dir.iterdir():
            if "tokenloom" in entry.name.lower() or entry.suffix == ".pth" or (directory / entry.name).exists():
                continue
            (directory / entry.name).symlink_to(entry)
    return directory


PROBE = textwrap.dedent("""
    import json, sys
    import tokenloom
    from tokenloom.kernels import cpu_native
    from tokenloom.llm import LLM
    from tokenloom.core.sampling_params import SamplingParams

    ops = cpu_native.load()
    llm = LLM("smollm2", max_model_len=256)
    [output] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.0))
    print(json.dumps({"tokenloom": tokenloom.__file__, "kernels": ops is not None,
                      "text": output.outputs[0].text, "tokens": len(output.outputs[0].token_ids)}))
""")


def test_an_installed_wheel_loads_its_kernels_and_serves_a_request(wheel, tmp_path):
    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    own_site = Path(
        subprocess.run(
            [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    borrowed = borrowed_site_packages(tmp_path / "borrowed")
    # after the environment's own site-packages, so the installed wheel comes first
    (own_site / "zz_borrowed_dependencies.pth").write_text(f"{borrowed}\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "TOKENLOOM_CPU_KERNELS", "VIRTUAL_ENV")
    }
    result = subprocess.run(
        [str(python), "-c", PROBE], cwd=outside, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokenloom"].startswith(str(own_site)), report  # the wheel's tokenloom, not the checkout's
    assert report["kernels"], f"the installed tokenloom fell back to the torch paths:\n{result.stderr[-3000:]}"
    assert report["tokens"] == 6 and "Paris" in report["text"], report
