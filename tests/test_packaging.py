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
