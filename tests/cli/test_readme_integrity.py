"""The manual's load/integrity documentation matches the code: docs/api.md gives the keywords
`ckptlib.load` takes and names every error class ckptlib exports, and docs/integrity.md says
what a load checks, what is refused and what `verify=False` skips."""

from __future__ import annotations

import inspect
import os
import re

import ckptlib

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")


def _page(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_api_page_load_signature_lists_every_public_keyword():
    documented = re.search(r"`ckptlib\.load\(uri, state, \*, ([^)]*)\)`", _page("api.md").replace("\n  ", " "))
    assert documented, "docs/api.md documents ckptlib.load(uri, state, *, ...)"
    names = [part.split("=")[0].strip() for part in documented.group(1).split(",")]
    public = [p for p in inspect.signature(ckptlib.load).parameters if p not in ("uri", "state", "process_group")]
    assert names == public


def test_api_page_names_every_exported_error():
    text = _page("api.md")
    errors = sorted(
        name
        for name in ckptlib.__all__
        if isinstance(getattr(ckptlib, name), type) and issubclass(getattr(ckptlib, name), ckptlib.CheckpointError)
    )
    assert [e for e in errors if f"`{e}`" not in text] == []


def test_integrity_page_says_what_is_checked_refused_and_skipped():
    text = _page("integrity.md")
    checked = _section(text, "What a load checks")
    assert "What a load (with the default `verify=True`) and `ckpt verify` check:" in checked
    refused = _section(text, "What is refused")
    assert "What is refused, whatever `verify` says" in refused
    for phrase in ("pickles that would run code", "escape the checkpoint", "safetensors headers", "cannot be pickled"):
        assert phrase in refused, phrase
    skipped = _section(text, "What `verify=False` skips")
    assert "What `verify=False` skips:" in skipped
    assert "CRC-32 of `.metadata` and of every item or block" in skipped
