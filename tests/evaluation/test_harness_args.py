"""The lm_eval adapter's token-count model_args: one line naming the argument, before any model is opened."""

import pytest

pytestmark = pytest.mark.tier("fast")


def _harness():
    """evaluation.harness, imported by the test: imported at this module's top it would be in the rank pool's
    zygote, and `python -m evaluation.harness` run forked from it (tests/evaluation/test_cli.py) would register
    the "ptdp" model a second time."""
    from evaluation import harness

    return harness


@pytest.mark.parametrize("value,expected", [(8, 8), ("8", 8), (8.0, 8), ("1", 1)])
def test_a_whole_token_count_is_taken(value, expected):
    assert _harness()._whole_tokens("max_gen_toks", value) == expected


@pytest.mark.parametrize("value", ["x", "1.5", 0, -1, float("nan"), float("inf"), ""])
def test_a_bad_max_gen_toks_is_one_line_naming_it(value):
    harness = _harness()
    with pytest.raises(harness.ModelInputError) as raised:
        harness.PTDPLM(checkpoint="/nonexistent", max_gen_toks=value)
    message = str(raised.value)
    assert message.startswith("ptdp model_args max_gen_toks=") and "\n" not in message
