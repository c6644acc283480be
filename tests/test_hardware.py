"""Every figure names its CPU: model name, family and model, core generation and vector extension."""

from verispec.bench.hardware import cpu_description

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16
processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
"""


def test_amd_names_family_model_core_and_isa():
    assert cpu_description(ZEN4) == "AMD EPYC (family 25 model 17, Zen 4; AVX-512 BF16)"
    zen3 = ZEN4.replace("model\t\t: 17", "model\t\t: 1").replace(" avx512f avx512_bf16", "")
    assert cpu_description(zen3) == "AMD EPYC (family 25 model 1, Zen 3; AVX2)"
    zen5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")
    assert cpu_description(zen5) == "AMD EPYC (family 26 model 2, Zen 5; AVX-512 BF16)"


def test_intel_and_missing_fields():
    intel = ZEN4.replace("AuthenticAMD", "GenuineIntel").replace("cpu family\t: 25", "cpu family\t: 6") \
        .replace("model name\t: AMD EPYC", "model name\t: Intel Xeon").replace(" avx512_bf16", "")
    assert cpu_description(intel) == "Intel Xeon (family 6 model 17; AVX-512)"
    amx = intel.replace("model\t\t: 17", "model\t\t: 143").replace("avx512f", "avx512f avx512_bf16 amx_bf16")
    assert cpu_description(amx) == "Intel Xeon (family 6 model 143; AVX-512 BF16, AMX)"
    assert cpu_description("model name\t: Some CPU\n") == "Some CPU"


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(monkeypatch):
    import verispec.config as config

    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    assert config.dtype_name("auto") == "float32"  # AVX2 / AVX-512 without BF16: bf16 would be emulated
    assert config.dtype_name("auto", "cuda:0") == "bfloat16"
    assert config.dtype_name("bfloat16") == "bfloat16"
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)
    assert config.dtype_name("auto") == "bfloat16"
