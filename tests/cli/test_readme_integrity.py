"""README's load/integrity documentation matches the code: the keywords `ckptlib.load` takes,
the error classes ckptlib exports, and an Integrity section saying what `verify=False` skips."""

from __future__ import annotations

import inspect
import os
import re

import ckptlib

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def _readme() -> str:
    with open(README) as f:
        return f.read()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_readme_load_signature_lists_every_public_keyword():
    documented = re.search(r"`ckptlib\.load\(uri, state, \*, ([^)]*)\)`", _readme().replace("\n  ", " "))
    assert documented, "README documents ckptlib.load(uri, state, *, ...)"
    names = [part.split("=")[0].strip() for part in documented.group(1).split(",")]
    public = [p for p in inspect.signature(ckptlib.load).parameters if p not in ("uri", "state", "process_group")]
    assert names == public


def test_readme_names_every_exported_error():
    text = _readme()
    errors = sorted(
        name
        for name in ckptlib.__all__
        if isinstance(getattr(ckptlib, name), type) and issubclass(getattr(ckptlib, name), ckptlib.CheckpointError)
    )
    assert [e for e in errors if f"`{e}`" not in text] == []


def test_readme_integrity_section_says_what_is_checked_refused_and_skipped():
    section = _section(_readme(), "Integrity")
    for phrase in (
        "What a load (with the default `verify=True`) and `ckpt verify` check:",
        "What is refused, whatever `verify` says",
        "What `verify=False` skips:",
    ):
        assert phrase in section
    skipped = section[section.index("What `verify=False` skips:") :]
    assert "CRC-32 of `.metadata` and of every item or block" in skipped
    for refused in ("pickles that would run code", "escape the checkpoint", "safetensors headers", "cannot be pickled"):
        assert refused in section, refused
