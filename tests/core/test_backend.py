"""Backend selection: JAX_DG_BACKEND, use_backend, and the concrete backend per platform."""

from __future__ import annotations

import pytest

import jax_dg
from jax_dg.core import backend as selection


def test_env_and_context_choose_the_backend(monkeypatch):
    monkeypatch.setenv(selection.ENV, "torch")
    assert selection.requested() == "torch"
    with jax_dg.use_backend("xla"):
        assert selection.requested() == "xla"
    monkeypatch.setenv(selection.ENV, "bogus")
    with pytest.raises(ValueError, match="choose one of"):
        selection.requested()


def test_auto_is_deep_gemm_on_cuda_and_torch_on_cpu():
    assert selection.concrete("auto", "cuda") == "deep_gemm"
    assert selection.concrete("auto", "cpu") == "torch"
    # deep_gemm asked for on a CPU stays itself: the resolver refuses it, once, while tracing
    assert selection.concrete("deep_gemm", "cpu") == "deep_gemm"
    assert selection.concrete("xla", "cuda") == "xla"


def test_the_torch_namespace_is_the_torch_emulation():
    # jax_dg's own kernels are native FFI handlers now: no namespace offers them
    from jax_dg.backends import torch_emu
    from jax_dg.core import dispatch
    from jax_dg.ops import mqa
    ns = dispatch.kernels(mqa.FP8_MQA_LOGITS, "torch")
    assert ns is torch_emu
    assert ns.get_paged_mqa_logits_metadata is torch_emu.get_paged_mqa_logits_metadata
    assert not hasattr(ns, "topk_rows") and not hasattr(ns, "neg_inf_outside")
