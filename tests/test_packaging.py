"""What a company's adoption review reads first: a license, and package metadata that says it.

Before: no LICENSE, and pyproject.toml had no license, classifiers or authors, so the built
wheel's METADATA named no license at all.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.split("\n")[:2] == [
        "                              Apache License",
        "                        Version 2.0, January 2004",
    ]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_pyproject_declares_the_license_and_ships_its_file():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert PROJECT["readme"] == {"file": "README.md", "content-type": "text/markdown"}
    classifiers = set(PROJECT["classifiers"])
    assert {
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Topic :: System :: Distributed Computing",
    } <= classifiers
    # PEP 639: with a `license` expression, a "License ::" classifier is an error at build time
    assert not [c for c in classifiers if c.startswith("License ::")]


def test_the_installed_distribution_carries_the_license_metadata():
    """The metadata pip wrote when the test command installed ckptlib (`pip install -e`)."""
    metadata = importlib.metadata.metadata("ckptlib")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata["Summary"] == PROJECT["description"]
    assert set(metadata.get_all("Classifier")) == set(PROJECT["classifiers"])


def _constraint_pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line, following nested `-c` files (as pip does,
    relative to the file that names them)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-c "):
            pins.update(_constraint_pins(path.parent / line[3:].strip()))
        elif "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_published_requirements_pin_nothing_exactly_and_ci_pins_the_checking_tools():
    # A user installing ckptlib[test] or ckptlib[examples] must not be forced onto one ruff or
    # transformers release; CI still checks with exact versions, through its constraints files.
    requirements = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        requirements += extra
    assert [r for r in requirements if "==" in r.split(";")[0]] == []
    tools = {"ruff": "0.17.6", "vulture": "2.16", "transformers": "5.24.0"}
    for constraints in [ROOT / "constraints.txt", *sorted((ROOT / "ci").glob("constraints-torch-*.txt"))]:
        pins = _constraint_pins(constraints)
        assert {name: pins.get(name) for name in tools} == tools, constraints
