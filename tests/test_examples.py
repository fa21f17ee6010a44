"""The examples run end to end (tiny sizes) and pass their own checks."""

from __future__ import annotations

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_indexer_topk_example(capsys):
    example = load("indexer_topk")
    assert example.main(["--seq", "48", "--keys", "320", "--topk", "32", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "top-k agreement 100.00%" in out
