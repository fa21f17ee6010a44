"""What jax_dg reads from an installed DeepGEMM (backends.deep_gemm.Api) and how it calls each
version, on stand-ins with 2.5.0's and 2.8.2's signatures (tests/backends/standins.py)."""

from __future__ import annotations

import pytest

from jax_dg.backends import deep_gemm as dgb
from tests.backends import standins


@pytest.fixture(params=["python", "pybind", "pybind_undocumented"])
def form(request):
    return request.param


def _as(form, mod):
    return mod if form == "python" else standins.as_pybind(mod, documented=form == "pybind")


def test_api_25(form):
    api = dgb.Api.of(_as(form, standins.deep_gemm_25()))
    assert api.version == (2, 5) and api.era == (2, 5) and not api.untested
    assert api.mqa_full_form
    assert api.logits_dtypes("fp8_fp4_mqa_logits") == ("float32", "bfloat16")
    assert api.logits_dtypes("fp8_fp4_paged_mqa_logits") == ("float32", "bfloat16")
    assert api.sm90_mqa_heads == (16, 32, 64) and api.sm90_paged_next_n == (1, 2, 4)
    assert api.has("fp8_gemm_nt_skip_head_mid") and not api.has("batched_syrk")
    assert not api.ensure_zero_padding


def test_api_28(form):
    api = dgb.Api.of(_as(form, standins.deep_gemm_28()))
    assert api.version == (2, 8) and api.era == (2, 8) and not api.untested
    assert not api.mqa_full_form
    assert api.logits_dtypes("fp8_fp4_mqa_logits") == ("float32",)
    assert api.logits_dtypes("fp8_fp4_paged_mqa_logits") == ("float32",)
    assert api.sm90_mqa_heads == (32, 64) and api.sm90_paged_next_n == (1, 2)
    assert not api.has("fp8_gemm_nt_skip_head_mid")
    assert api.has("batched_syrk") and api.has("use_deterministic_algorithms")
    assert api.ensure_zero_padding


def test_api_newer_than_tested_takes_the_newest_facts():
    api = dgb.Api.of(standins.deep_gemm_28("2.9.1"))
    assert api.version == (2, 9) and api.era == (2, 8) and api.untested
    assert api.sm90_mqa_heads == (32, 64)


@pytest.fixture
def installed(monkeypatch):
    """Makes `mod` the installed deep_gemm for lookup()/api()."""
    def install(mod):
        monkeypatch.setattr(dgb, "module", lambda: mod)
        standins.CALLS.clear()
        return mod
    yield install


def _last_call():
    name, args, kwargs = standins.CALLS[-1]
    return name, kwargs


@pytest.mark.parametrize("version", ["25", "28"])
def test_mqa_logits_call_reaches_each_version_in_its_form(installed, form, version):
    installed(_as(form, getattr(standins, f"deep_gemm_{version}")()))
    call = dgb.lookup("fp8_fp4_mqa_logits")
    call("Q", "KV", "W", "KS", "KE", clean_logits=False, max_seqlen_k=7, logits_dtype=None)
    name, kwargs = _last_call()
    want = {"max_seqlen_k": 7} if version == "28" else {"clean_logits": False, "max_seqlen_k": 7,
                                                       "logits_dtype": None}
    assert name == "fp8_fp4_mqa_logits" and kwargs == want


def test_dropped_keyword_with_another_meaning_is_an_error(installed):
    installed(standins.deep_gemm_28())
    call = dgb.lookup("fp8_fp4_mqa_logits")
    with pytest.raises(RuntimeError, match="clean_logits"):
        call("Q", "KV", "W", "KS", "KE", clean_logits=True, max_seqlen_k=7)
    with pytest.raises(RuntimeError, match="logits_dtype"):
        call("Q", "KV", "W", "KS", "KE", clean_logits=False, max_seqlen_k=7, logits_dtype="torch.bfloat16")


@pytest.mark.parametrize("version", ["25", "28"])
def test_paged_and_einsum_calls(installed, version):
    installed(getattr(standins, f"deep_gemm_{version}")())
    dgb.lookup("fp8_fp4_paged_mqa_logits")("Q", "KV", "W", "C", "T", "S", 64, clean_logits=False,
                                           logits_dtype=None)
    assert _last_call()[1] == ({} if version == "28" else {"clean_logits": False, "logits_dtype": None})
    dgb.lookup("einsum")("bhr,hdr->bhd", "A", "B", "D", use_cublaslt=True)
    assert _last_call()[1] == ({} if version == "28" else {"use_cublaslt": True})


def test_api_of_the_installed(installed):
    installed(standins.deep_gemm_28())
    assert dgb.api().version == (2, 8) and dgb.api() is dgb.api()


@pytest.mark.parametrize("version,tested", [("2.8.2.post20261020", True), ("2.9.0", False)])
def test_info_reports_the_release_and_what_the_ops_plan_with(installed, version, tested):
    from jax_dg.__main__ import collect, format_info
    installed(standins.deep_gemm_28(version))
    info = collect()
    dg = info["deep_gemm"]
    assert dg["release"] == version[:3] and dg["tested"] is tested and dg["as"] == "2.8"
    assert "compressed form only" in dg["facts"]["mqa logits"]
    text = format_info(info)
    assert f"DeepGEMM {version[:3]} (" in text
    assert ("newer than any tested" in text) is not tested
