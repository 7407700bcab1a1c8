"""YaRN's rotary frequencies and attention factor against the paper's formulas written out in float64."""

import math

import numpy as np
import pytest

from spmd_train.config.model_schema import RopeScaling
from spmd_train.ops.rope import inverse_frequencies, rope_attention_factor, rope_tables


def _yarn_longhand(head_dim, theta, factor, original, beta_fast, beta_slow, truncate):
    # arXiv:2309.00071, section 3.2 ("NTK-by-parts"): pair i turns original / (2 pi theta^(2i/d)) times over the
    # original context; pairs turning more than beta_fast times keep their frequency, fewer than beta_slow are
    # divided by the factor, and a linear ramp over the pair index joins the two.
    def pair(turns):
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(beta_fast), pair(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    out = []
    for i in range(head_dim // 2):
        freq = theta ** (-2 * i / head_dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: kept, 1: divided
        out.append(freq * (1 - ramp) + freq / factor * ramp)
    return np.array(out)


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize(("head_dim", "theta", "factor", "original"), [(128, 1e6, 4.0, 32768), (64, 150000.0, 32.0,
                                                                                                 4096)])
def test_yarn_frequencies_follow_the_ramp_between_beta_fast_and_beta_slow(head_dim, theta, factor, original,
                                                                            truncate):
    scaling = RopeScaling(type="yarn", factor=factor, original_max_position=original, truncate=truncate)
    got = np.asarray(inverse_frequencies(head_dim, theta, scaling), np.float64)
    want = _yarn_longhand(head_dim, theta, factor, original, 32.0, 1.0, truncate)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = np.asarray(inverse_frequencies(head_dim, theta), np.float64)
    assert got[0] == pytest.approx(plain[0]) and got[-1] == pytest.approx(plain[-1] / factor)  # both ends


def test_yarn_attention_factor_and_the_tables_it_scales():
    assert rope_attention_factor(None) == 1.0
    assert rope_attention_factor(RopeScaling(type="linear", factor=4.0)) == 1.0
    assert rope_attention_factor(RopeScaling(type="yarn", factor=4.0)) == pytest.approx(1 + 0.1 * math.log(4))
    # DeepSeek's pair: (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1); equal values cancel to 1.
    both = RopeScaling(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.5)
    assert rope_attention_factor(both) == pytest.approx((0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1))
    assert rope_attention_factor(RopeScaling(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0)) == 1.0
    assert rope_attention_factor(RopeScaling(type="yarn", factor=40.0, attention_factor=0.9)) == 0.9  # as given
    assert rope_attention_factor(RopeScaling(type="yarn", factor=1.0)) == 1.0
    scaling = RopeScaling(type="yarn", factor=4.0, original_max_position=64)
    cos, sin = rope_tables(16, 32, 10000.0, scaling=scaling)
    angles = np.arange(16)[:, None] * np.asarray(inverse_frequencies(32, 10000.0, scaling), np.float64)
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles) * (1 + 0.1 * math.log(4)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles) * (1 + 0.1 * math.log(4)), rtol=1e-5, atol=1e-6)


def test_mla_under_yarn_multiplies_its_softmax_scale_by_mscale_all_dim_squared():
    from spmd_train.config.load import load_config
    from spmd_train.models.transformer import layer_scoring
    from spmd_train.ops.rope import yarn_softmax_factor

    deepseek = RopeScaling(type="yarn", factor=40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=1.0)
    assert yarn_softmax_factor(deepseek) == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)  # 1.874
    assert rope_attention_factor(deepseek) == 1.0  # mscale / mscale_all_dim: the whole temperature is on the logits
    assert yarn_softmax_factor(RopeScaling(type="yarn", factor=40.0)) == 1.0  # Qwen's YaRN: cos and sin only
    assert yarn_softmax_factor(RopeScaling(type="linear", factor=40.0)) == 1.0
    mla = ["model.num_kv_heads=8", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
           "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6", "model.rope_scaling.type=yarn",
           "model.rope_scaling.factor=40", "model.rope_scaling.mscale=1", "model.rope_scaling.mscale_all_dim=1"]
    scoring = layer_scoring(load_config(None, mla).model, "full")
    assert scoring.scale == pytest.approx(12**-0.5 * yarn_softmax_factor(deepseek))
    grouped = load_config(None, mla[5:]).model  # grouped-query attention keeps 1/sqrt(head_dim)
    assert layer_scoring(grouped, "full").scale is None
